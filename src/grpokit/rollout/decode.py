"""Rollout engine: sample G completions per prompt from a Hugging Face causal LM.

Generation dominates the cost of GRPO, so this module does the least work that
gives exact samples and exact log-probabilities:

- **Prefill sharing.** The B prompts are left-padded and run through the model
  once, as a [B, P] batch that fills a KV cache. Only then are the cache and the
  last-position logits repeated to N = B*G rows, so a prompt's prefill is paid
  once, not G times (``model.generate(num_return_sequences=G)`` prefills N rows).
- **One decode loop, finished rows dropped.** All N rows decode together with the
  KV cache. A row that emits an EOS token or a stop string leaves the batch (its
  cache, attention-mask and position rows are sliced out), so it stops costing
  compute; ``generate`` keeps running finished rows on padding until the last
  row is done.
- **Gumbel-max sampling.** A token is drawn as ``argmax(p / E)`` with ``E``
  exponential noise (the Gumbel-max trick, ``argmax(log p + Gumbel)``, written
  in the probability domain). That is one exp, one uniform draw and one log per
  vocabulary entry, instead of a softmax plus ``torch.multinomial``, which on a
  32k vocabulary costs more than the model's own decode step. The uniform noise
  comes from ``torch.rand`` (``Tensor.exponential_`` is about 3x slower on CPU).
  Top-k / top-p filtering sorts the vocabulary, so it runs only when asked, and
  the noise is then drawn over the surviving candidates only.

Log-probabilities are those of the *unfiltered* tempered distribution
``log_softmax(logits / temperature)``, which is what the trainer recomputes, so
with μ = 1 the policy ratio is exactly 1 on the first pass. With temperature 0
(greedy) the log-probabilities are those of ``log_softmax(logits)``.

The noise for a step is one [n_active, C] draw from ``generator``: the same seed,
prompts and model give the same samples, but the samples of one prompt depend
on the other prompts in the batch (greedy decoding does not).
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
from torch import Tensor

from grpokit.models.forward import position_ids_from_mask
from grpokit.models.media import RowMedia
from grpokit.rollout.batch import Rollout, left_pad
from grpokit.rollout.layer_loop import layer_loop_for
from grpokit.rollout.sampling import sample_tokens
from grpokit.rollout.vision import MediaPrefill, suppressed_tokens


def _preallocated_layer(capacity: int):
    """A ``DynamicLayer`` that writes each step's keys and values into buffers [n, h, capacity, d]
    allocated once, and hands attention a view of the filled part: a decode step then copies one
    position per layer, where ``DynamicLayer``'s ``torch.cat`` copies the whole cache (quadratic
    in the completion length)."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        preallocated = True  # rollout/layer_loop.py writes into it directly

        def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
            n, h, _, _ = key_states.shape
            self.device, self.length = key_states.device, 0
            self.k_buf = key_states.new_empty(n, h, capacity, key_states.shape[-1])  # [n, h, C, d]
            self.v_buf = value_states.new_empty(n, h, capacity, value_states.shape[-1])  # [n, h, C, d]
            self.is_initialized = True

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > self.k_buf.shape[-2]:  # more positions than planned: grow (never on the normal path)
                grow = lambda b: torch.cat([b, b.new_empty(*b.shape[:2], end, b.shape[-1])], dim=2)  # noqa: E731
                self.k_buf, self.v_buf = grow(self.k_buf), grow(self.v_buf)
            self.k_buf[:, :, self.length:end] = key_states
            self.v_buf[:, :, self.length:end] = value_states
            self.length = end
            self._views()
            return self.keys, self.values

        def _views(self) -> None:
            self.keys, self.values = self.k_buf[:, :, :self.length], self.v_buf[:, :, :self.length]

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self.k_buf = self.k_buf.repeat_interleave(repeats, dim=0)
                self.v_buf = self.v_buf.repeat_interleave(repeats, dim=0)
                self._views()

        def batch_select_indices(self, indices: Tensor) -> None:
            if self.is_initialized:
                self.k_buf, self.v_buf = self.k_buf[indices], self.v_buf[indices]
                self._views()

    return PreallocatedLayer()


class Decoder:
    """Calls the model with a DynamicCache, under the keyword names this transformers uses.

    transformers 5.x renamed ``past_key_values`` to ``cache``; the cache object is
    updated in place, so the output's cache field is never read. Plain (full-attention)
    cache layers are replaced by preallocated ones sized for ``capacity`` positions.
    """

    def __init__(self, model, capacity: int | None = None, media: RowMedia | None = None, layer_loop: bool = True):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        params = inspect.signature(model.forward).parameters
        self.model = model
        self.cache = DynamicCache(config=model.config)
        if capacity is not None:  # sliding-window and other special layers keep their own logic
            self.cache.layers = [_preallocated_layer(capacity) if type(layer) is DynamicLayer else layer
                                 for layer in self.cache.layers]
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.keep_last = "logits_to_keep" in params
        self.media = None if media is None else MediaPrefill(media)  # prompts with images (rollout/vision.py)
        # one-token steps without transformers' per-step Python, where that is the same computation
        self.layer_loop = layer_loop_for(model, self.cache) if layer_loop and media is None else None

    def __call__(self, ids: Tensor, mask: Tensor, positions: Tensor) -> Tensor:
        """Run ids [n, L] (mask [n, past+L], positions [n, L]); return last logits [n, V]."""
        if self.layer_loop is not None and ids.shape[1] == 1 and self.cache.get_seq_length() > 0:
            return self.layer_loop(ids, mask, positions)  # [n, V]
        return self.all_logits(ids, mask, positions, keep=1)[:, -1, :]  # [n, V]

    def all_logits(self, ids: Tensor, mask: Tensor, positions: Tensor, keep: int | None = None, images=None
                   ) -> Tensor:
        """Run ids [n, L] as `__call__` does; return the logits of the last `keep` positions (all L by
        default) [n, keep, V]. `images`: per row, the images of a tool result in these ids (or None)."""
        kwargs = {self.cache_kwarg: self.cache, "use_cache": True}
        if self.keep_last:
            kwargs["logits_to_keep"] = keep or ids.shape[1]
        if self.media is not None:  # the prefill's pixels; multimodal positions
            positions, extra = self.media.inputs(self.model, ids, mask, positions, images)
            kwargs.update(extra)
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs).logits

    def repeat_rows(self, repeats: int) -> None:
        self.cache.batch_repeat_interleave(repeats)
        if self.media is not None:
            self.media.repeat_rows(repeats)

    def select_rows(self, rows: Tensor) -> None:
        self.cache.batch_select_indices(rows)
        if self.media is not None:
            self.media.select_rows(rows)

    def keep_columns(self, columns: Tensor) -> None:
        """Keep, per row, the cache positions `columns` [n, W] (in that order) and drop the others: the
        multi-turn sampler's compaction of masked holes. Exact for full attention: keys are stored with
        their rotary positions already applied, and only the mask ever looked at the dropped ones."""
        for layer in self.cache.layers:
            keys, values = layer.keys, layer.values  # [n, h, L, d]
            index = columns[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])  # [n, h, W, d]
            keys, values = keys.gather(2, index), values.gather(2, index)
            if hasattr(layer, "k_buf"):  # preallocated: the kept part at the front of the same buffers
                layer.k_buf[:, :, :keys.shape[2]] = keys
                layer.v_buf[:, :, :values.shape[2]] = values
                layer.length = keys.shape[2]
                layer._views()
            else:
                layer.keys, layer.values = keys, values


def _stop_string_hits(tokens: Tensor, rows: Tensor, t: int, tokenizer, stops, window: int
                      ) -> Tensor:
    """Whether each row's completion tail (last ``window`` tokens) holds a stop string → [n].

    A stop string of k bytes spans at most k tokens, so a window of k + 2 tokens
    sees it whole, with one token to spare for decoders that strip a leading space.
    """
    tails = tokens[rows, max(0, t + 1 - window): t + 1].tolist()
    texts = tokenizer.batch_decode(tails, skip_special_tokens=True)
    hits = [any(s in text for s in stops) for text in texts]
    return torch.tensor(hits, dtype=torch.bool, device=tokens.device)


def _decode_loop(model, ids: Tensor, mask: Tensor, *, group_size: int, max_new_tokens: int,
                 eos: Tensor | None, pad_token_id: int, sampling: dict, stops: tuple[str, ...],
                 tokenizer, preallocate: bool = True, media: RowMedia | None = None, layer_loop: bool = True
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Prefill [B, P] once (with `media`: the B prompts' images), expand to N rows and decode them.

    Returns tokens and logprobs [N, max_new_tokens], lengths [N] and finished [N].
    """
    step = Decoder(model, capacity=ids.shape[1] + max_new_tokens if preallocate else None, media=media,
                   layer_loop=layer_loop)
    positions = position_ids_from_mask(mask)  # [B, P]
    logits = step(ids, mask, positions)  # [B, V]: the prefill runs on B rows, not N
    step.repeat_rows(group_size)
    logits = logits.repeat_interleave(group_size, 0)  # [N, V]
    mask = mask.repeat_interleave(group_size, 0)  # [N, P]
    next_pos = positions[:, -1].repeat_interleave(group_size) + 1  # [N]
    n, device = logits.shape[0], logits.device
    tokens = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long,
                        device=device)  # [N, T]
    logps = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)  # [N, T]
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)  # [N]
    finished = torch.zeros(n, dtype=torch.bool, device=device)  # [N]
    active = torch.arange(n, device=device)  # [n_active] original row ids
    window = max((len(s.encode()) for s in stops), default=0) + 2
    for t in range(max_new_tokens):
        tok, lp = sample_tokens(logits, **sampling)  # [n_active]
        tokens[active, t] = tok
        logps[active, t] = lp
        done = torch.isin(tok, eos) if eos is not None else torch.zeros_like(tok, dtype=torch.bool)
        if stops:
            done |= _stop_string_hits(tokens, active, t, tokenizer, stops, window)
        n_done = int(done.sum())  # the one host sync per step (more only when rows finish)
        if n_done:
            lengths[active[done]] = t + 1
            finished[active[done]] = True
        if t == max_new_tokens - 1 or n_done == len(active):
            break
        if n_done:  # drop finished rows so they stop costing compute
            keep = (~done).nonzero()[:, 0]  # [n_keep]
            step.select_rows(keep)
            active, tok, mask, next_pos = active[keep], tok[keep], mask[keep], next_pos[keep]
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)  # [n_active, P+t+1]
        logits = step(tok[:, None], mask, next_pos[:, None])  # [n_active, V]
        next_pos = next_pos + 1
    return tokens, logps, lengths, finished


def _validate(model, prompt_ids, group_size, max_new_tokens, temperature, top_p, top_k,
              stop_strings, tokenizer, generator) -> None:
    """Every input error before any model work, each naming the bad value."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: pass at least one prompt (a list of token ids)")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode completions: pass tokenizer=")
    if any(not s for s in stop_strings):
        raise ValueError("stop_strings must not contain an empty string")
    if generator is not None and generator.device.type != model.device.type:
        raise ValueError(f"generator is on {generator.device}, the model on {model.device}: "
                         f"create it with torch.Generator(device={str(model.device)!r})")
    config = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    max_pos = getattr(config, "max_position_embeddings", None)
    vocab = getattr(config, "vocab_size", None)
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if max_pos is not None and len(p) + max_new_tokens > max_pos:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that is "
                f"{len(p) + max_new_tokens} positions, more than the model's "
                f"max_position_embeddings={max_pos}: shorten the prompt or lower max_new_tokens")
        if vocab is not None and (min(p) < 0 or max(p) >= vocab):
            raise ValueError(f"prompt {i} has a token id outside the vocabulary [0, {vocab})")


def sample_groups(
    model, prompt_ids: list[list[int]], *, group_size: int, max_new_tokens: int,
    eos_token_ids: int | Sequence[int] | None, pad_token_id: int, temperature: float = 1.0,
    top_p: float = 1.0, top_k: int = 0, stop_strings: Sequence[str] = (), tokenizer=None,
    generator: torch.Generator | None = None, ignore_eos: bool = False, sampler: str = "inverse_cdf",
    preallocate_kv_cache: bool = True, share_prefill: bool = True, layer_loop: bool = True,
    media: RowMedia | None = None,
) -> Rollout:
    """Sample ``group_size`` completions for each prompt; see the module docstring for how.

    A completion ends at the first EOS token (any of ``eos_token_ids``, unless
    ``ignore_eos``) or the first token after which its decoded text contains one
    of ``stop_strings``; that token is kept and masked in. The model runs in
    eval mode (dropout off) and is put back in its previous mode afterwards.

    Sampling runs under ``torch.inference_mode``, but the returned tensors are
    ordinary ones: inference tensors cannot be used in autograd, and the
    trainer indexes its differentiable logits with ``completion_ids``.

    The last four options change speed, not the distribution (`rollout.sampler`,
    `rollout.preallocated_kv_cache`, `rollout.shared_prefill`, `rollout.layer_loop`; benchmark
    ablations): the token sampler, a preallocated KV cache (False: transformers' DynamicCache, which
    concatenates every step), one prefill per prompt (False: all N = B*G rows), and decode steps as
    a plain loop over the layers where that is the model's own computation (rollout/layer_loop.py).

    `media` (`models.media.RowMedia`, one row per prompt): the prompts' images, for a vision-language
    model (rollout/vision.py): they go into the prefill only, Qwen2-VL's decode positions carry its
    rope deltas, image tokens are never sampled, and the returned rollout carries them per answer.
    """
    stops = tuple(stop_strings)
    _validate(model, prompt_ids, group_size, max_new_tokens, temperature, top_p, top_k,
              stops, tokenizer, generator)
    if media is not None and len(media) != len(prompt_ids):
        raise ValueError(f"media has {len(media)} rows for {len(prompt_ids)} prompts: give one per prompt")
    device = model.device
    eos = None
    if eos_token_ids is not None and not ignore_eos:
        eos = torch.as_tensor(eos_token_ids, dtype=torch.long).reshape(-1).to(device)  # [E]
        eos = eos if eos.numel() else None
    ids, mask = left_pad(prompt_ids, pad_token_id, device)  # [B, P]
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, sampler=sampler)
    if media is not None:
        sampling["suppress"] = suppressed_tokens(model, device)  # image placeholders: never drawn
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            share = share_prefill or group_size == 1
            tokens, logps, lengths, finished = _decode_loop(
                model, ids if share else ids.repeat_interleave(group_size, 0),
                mask if share else mask.repeat_interleave(group_size, 0), group_size=group_size if share else 1,
                max_new_tokens=max_new_tokens, eos=eos, pad_token_id=pad_token_id, sampling=sampling, stops=stops,
                tokenizer=tokenizer, preallocate=preallocate_kv_cache, layer_loop=layer_loop,
                media=None if media is None else media if share else media.repeat_interleave(group_size))
    finally:
        model.train(was_training)
    tokens, logps, lengths, finished = (x.clone() for x in (tokens, logps, lengths, finished))
    width = int(lengths.max())
    completion_mask = torch.arange(width, device=device)[None, :] < lengths[:, None]  # [N, T]
    return Rollout(
        prompt_ids=ids.repeat_interleave(group_size, 0),  # [N, P]
        prompt_mask=mask.repeat_interleave(group_size, 0),  # [N, P]
        completion_ids=tokens[:, :width].masked_fill(~completion_mask, pad_token_id),  # [N, T]
        completion_mask=completion_mask.long(),  # [N, T]
        logprobs=logps[:, :width].masked_fill(~completion_mask, 0.0),  # [N, T]
        truncated=~finished,  # [N]
        media=None if media is None else media.repeat_interleave(group_size),  # [N] each answer's prompt images
    )
