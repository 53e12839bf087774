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

**In-flight weight updates** (``DecodeSpeed.between_steps``, asynchronous workers with
``rollout.in_flight_updates``): a callable run before the prefill and before every decode
step, which may copy newer weights into the model and returns the version it holds. Each
token is tagged with the version whose forward produced its logits (``Rollout.token_version``).
The KV cache of unfinished answers is kept across a switch (PipelineRL's choice): the keys and
values of earlier positions stay those the older weights computed, so a token after a switch is
the new weights' prediction over the old weights' cache, not a clean recompute under the new
weights (docs/ASYNC.md measures the gap). Without the callable nothing of this runs.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from grpokit.models.forward import position_ids_from_mask
from grpokit.models.media import RowMedia
from grpokit.rollout.batch import Rollout, left_pad
from grpokit.rollout.layer_loop import layer_loop_for
from grpokit.rollout.request import RolloutRequest, SamplingParams
from grpokit.rollout.sampling import sample_tokens
from grpokit.rollout.vision import MediaPrefill, suppressed_tokens


@dataclass(frozen=True)
class DecodeSpeed:
    """How the built-in sampler decodes: these change speed, not the distribution (the same seed, prompts and
    model give the same answers; benchmark ablations).

    - `sampler` (`rollout.sampler`): the token sampler (rollout/sampling.py).
    - `preallocate_kv_cache` (`rollout.preallocated_kv_cache`): a KV cache allocated once for the whole answer
      (False: transformers' DynamicCache, which concatenates every step).
    - `share_prefill` (`rollout.shared_prefill`): one prefill per prompt (False: all N = B*G rows).
    - `layer_loop` (`rollout.layer_loop`): decode steps as a plain loop over the layers where that is the model's
      own computation (rollout/layer_loop.py).
    - `between_steps`: no speed option but the loop's one hook, in-flight weight updates (the module docstring;
      an async worker's `GlooSubscriber.apply`). It copies weights in place, which oneDNN-packed copies
      (`rollout.packed_weights`) would not follow: a worker that swaps weights samples unpacked.
    """

    sampler: str = "inverse_cdf"
    preallocate_kv_cache: bool = True
    share_prefill: bool = True
    layer_loop: bool = True
    between_steps: Callable[[], int] | None = None

    @classmethod
    def from_config(cls, config) -> "DecodeSpeed":
        r = config.rollout
        return cls(r.sampler, r.preallocated_kv_cache, r.shared_prefill, r.layer_loop)


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


def _decode_loop(model, ids: Tensor, mask: Tensor, *, group_size: int, sampling: SamplingParams, draw: dict,
                 tokenizer, speed: DecodeSpeed, media: RowMedia | None = None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Prefill [B, P] once (with `media`: the B prompts' images), expand to N rows and decode them: each token
    drawn by `sample_tokens(logits, **draw)`, the answers' budget, end tokens and stop strings `sampling`'s.

    Returns tokens and logprobs [N, max_new_tokens], lengths [N], finished [N] and, with `speed.between_steps`,
    each token's weight version [N, max_new_tokens] (-1 where none was sampled; else None).
    """
    max_new_tokens, pad_token_id, stops = sampling.max_new_tokens, sampling.pad_token_id, tuple(sampling.stop_strings)
    capacity = ids.shape[1] + max_new_tokens if speed.preallocate_kv_cache else None
    step = Decoder(model, capacity=capacity, media=media, layer_loop=speed.layer_loop)
    positions = position_ids_from_mask(mask)  # [B, P]
    swap = speed.between_steps
    version = swap() if swap is not None else 0  # the weights the prefill runs with
    logits = step(ids, mask, positions)  # [B, V]: the prefill runs on B rows, not N
    step.repeat_rows(group_size)
    logits = logits.repeat_interleave(group_size, 0)  # [N, V]
    mask = mask.repeat_interleave(group_size, 0)  # [N, P]
    next_pos = positions[:, -1].repeat_interleave(group_size) + 1  # [N]
    n, device = logits.shape[0], logits.device
    eos = None if sampling.ignore_eos or sampling.eos_token_ids is None else \
        torch.as_tensor(sampling.eos_token_ids, dtype=torch.long).reshape(-1)
    eos = eos.to(device) if eos is not None and eos.numel() else None  # [E]
    tokens = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long,
                        device=device)  # [N, T]
    logps = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)  # [N, T]
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)  # [N]
    finished = torch.zeros(n, dtype=torch.bool, device=device)  # [N]
    versions = None if swap is None else torch.full((n, max_new_tokens), -1, dtype=torch.long, device=device)  # [N, T]
    active = torch.arange(n, device=device)  # [n_active] original row ids
    window = max((len(s.encode()) for s in stops), default=0) + 2
    for t in range(max_new_tokens):
        tok, lp = sample_tokens(logits, **draw)  # [n_active]
        tokens[active, t] = tok
        logps[active, t] = lp
        if versions is not None:
            versions[active, t] = version  # the weights whose forward gave these logits
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
        if swap is not None:  # newer weights may land here; the cache of earlier positions is kept as it is
            version = swap()
        logits = step(tok[:, None], mask, next_pos[:, None])  # [n_active, V]
        next_pos = next_pos + 1
    return tokens, logps, lengths, finished, versions


def _validate(model, request: RolloutRequest, tokenizer) -> None:
    """Every input error before any model work, each naming the bad value."""
    prompt_ids, group_size, s, generator = request.prompt_ids, request.group_size, request.sampling, request.generator
    max_new_tokens = s.max_new_tokens
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: pass at least one prompt (a list of token ids)")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if s.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {s.top_k}")
    if s.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode completions: pass tokenizer=")
    if any(not stop for stop in s.stop_strings):
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
    if request.media is not None and len(request.media) != len(prompt_ids):
        raise ValueError(f"media has {len(request.media)} rows for {len(prompt_ids)} prompts: give one per prompt")


# `sample_groups`' keywords before it took a `RolloutRequest` (grpokit 0.x): still accepted, with a warning
_OLD_KEYWORDS = ("group_size", "max_new_tokens", "eos_token_ids", "pad_token_id", "temperature", "top_p", "top_k",
                 "stop_strings", "generator", "ignore_eos", "sampler", "preallocate_kv_cache", "share_prefill",
                 "layer_loop", "media")


def _request_from_keywords(prompt_ids, old: dict) -> tuple[RolloutRequest, DecodeSpeed]:
    """The request and speed options the old spelling `sample_groups(model, prompt_ids, group_size=..., ...)`
    meant; a keyword it never had, or a required one left out, is a TypeError as before."""
    unknown = sorted(set(old) - set(_OLD_KEYWORDS))
    if unknown:
        raise TypeError(f"sample_groups() got an unexpected keyword argument {unknown[0]!r}")
    missing = [k for k in ("group_size", "max_new_tokens", "eos_token_ids", "pad_token_id") if k not in old]
    if missing:
        raise TypeError(f"sample_groups() missing required keyword argument {missing[0]!r}")
    eos = old["eos_token_ids"]
    eos = () if eos is None else tuple(torch.as_tensor(eos, dtype=torch.long).reshape(-1).tolist())
    sampling = SamplingParams(old["max_new_tokens"], eos, old["pad_token_id"], old.get("temperature", 1.0),
                              old.get("top_p", 1.0), old.get("top_k", 0), tuple(old.get("stop_strings", ())),
                              old.get("ignore_eos", False))
    speed = DecodeSpeed(**{k: old[k] for k in ("sampler", "preallocate_kv_cache", "share_prefill", "layer_loop")
                           if k in old})
    return RolloutRequest(list(prompt_ids), old["group_size"], sampling, old.get("generator"),
                          media=old.get("media")), speed


def sample_groups(model, request: RolloutRequest, *, tokenizer=None, speed: DecodeSpeed = DecodeSpeed(),
                  **deprecated) -> Rollout:
    """Sample `request.group_size` completions for each of `request.prompt_ids`, drawn as `request.sampling`
    says with `request.generator`'s noise; see the module docstring for how.

    A completion ends at the first EOS token (any of `sampling.eos_token_ids`, unless
    `sampling.ignore_eos`) or the first token after which its decoded text contains one
    of `sampling.stop_strings` (they need `tokenizer`); that token is kept and masked in. The model runs in
    eval mode (dropout off) and is put back in its previous mode afterwards.

    Sampling runs under ``torch.inference_mode``, but the returned tensors are
    ordinary ones: inference tensors cannot be used in autograd, and the
    trainer indexes its differentiable logits with ``completion_ids``.

    `speed` (`DecodeSpeed`) changes speed, not the distribution.

    `request.media` (`models.media.RowMedia`, one row per prompt): the prompts' images, for a vision-language
    model (rollout/vision.py): they go into the prefill only, Qwen2-VL's decode positions carry its
    rope deltas, image tokens are never sampled, and the returned rollout carries them per answer.

    The old spelling `sample_groups(model, prompt_ids, group_size=G, max_new_tokens=..., eos_token_ids=...,
    pad_token_id=..., ...)` still works and warns (DeprecationWarning): pass `RolloutRequest(prompt_ids,
    group_size=G, sampling=SamplingParams(...), generator=..., media=...)` and `speed=DecodeSpeed(...)`.
    """
    if not isinstance(request, RolloutRequest):  # the old spelling: a list of prompts and loose keywords
        warnings.warn("sample_groups(model, prompt_ids, group_size=..., max_new_tokens=..., ...) is deprecated: "
                      "call sample_groups(model, RolloutRequest(prompt_ids, group_size, SamplingParams(...), "
                      "generator, media=...), tokenizer=..., speed=DecodeSpeed(...))", DeprecationWarning, stacklevel=2)
        request, speed = _request_from_keywords(request, deprecated)
    elif deprecated:
        raise TypeError(f"sample_groups() got an unexpected keyword argument {next(iter(deprecated))!r} (with a "
                        "RolloutRequest, the sampling settings are the request's)")
    _validate(model, request, tokenizer)
    G, sampling, media, device = request.group_size, request.sampling, request.media, model.device
    ids, mask = left_pad(request.prompt_ids, sampling.pad_token_id, device)  # [B, P]
    draw = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                generator=request.generator, sampler=speed.sampler)
    if media is not None:
        draw["suppress"] = suppressed_tokens(model, device)  # image placeholders: never drawn
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            share = speed.share_prefill or G == 1
            tokens, logps, lengths, finished, versions = _decode_loop(
                model, ids if share else ids.repeat_interleave(G, 0), mask if share else mask.repeat_interleave(G, 0),
                group_size=G if share else 1, sampling=sampling, draw=draw, tokenizer=tokenizer, speed=speed,
                media=None if media is None else media if share else media.repeat_interleave(G))
    finally:
        model.train(was_training)
    tokens, logps, lengths, finished = (x.clone() for x in (tokens, logps, lengths, finished))
    width = int(lengths.max())
    completion_mask = torch.arange(width, device=device)[None, :] < lengths[:, None]  # [N, T]
    pad_token_id = sampling.pad_token_id
    token_version = None if versions is None else versions[:, :width].clone().masked_fill(~completion_mask, -1)
    return Rollout(
        prompt_ids=ids.repeat_interleave(G, 0),  # [N, P]
        prompt_mask=mask.repeat_interleave(G, 0),  # [N, P]
        completion_ids=tokens[:, :width].masked_fill(~completion_mask, pad_token_id),  # [N, T]
        completion_mask=completion_mask.long(),  # [N, T]
        logprobs=logps[:, :width].masked_fill(~completion_mask, 0.0),  # [N, T]
        truncated=~finished,  # [N]
        policy_version=None if versions is None else token_version[:, 0].clone(),  # [N] the oldest: the first token's
        token_version=token_version,  # [N, T] with between_steps: each token's weight version
        media=None if media is None else media.repeat_interleave(G),  # [N] each answer's prompt images
    )
