"""The training forward: log-probs of sampled completions under a Hugging Face causal LM.

With a linear head (logits == lm_head(last hidden state), checked once by `head_is_linear`)
the model body runs once and the head is applied chunk by chunk (`algorithms/logprobs.py`),
so the [N, T, V] logits never exist; answers of the same prompt share one prompt forward.
Models whose output head is more than a linear map of the final hidden state (Gemma-2's
logit soft-capping, for instance) are scored through the model's own logits instead.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch
from torch import Tensor

from grpokit.algorithms.logprobs import token_logprobs, token_logprobs_from_hidden
from grpokit.errors import keywords_moved_into
from grpokit.models.packing import packed_completion_hidden, packing_applies
from grpokit.models.prompt_forward import distinct_prompts, position_ids_from_mask, prompt_forward

if TYPE_CHECKING:
    from grpokit.config.schema import TrainConfig


class _RowsIntoGrad(torch.autograd.Function):
    """An embedding lookup whose backward adds the looked-up rows' gradients straight into the weight's
    existing `.grad` (see `embedding_rows_into_grad`); where there is none yet, the usual dense gradient."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):  # ids [...], weight [V, H] -> [..., H]
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):  # [..., H]
        (ids,) = ctx.saved_tensors
        weight, padding_idx = ctx.weight, ctx.padding_idx
        ids, rows = ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1])  # [n], [n, H]
        if padding_idx is not None:  # the padding row gets no gradient, as in torch's embedding backward
            rows = rows.masked_fill((ids == padding_idx)[:, None], 0.0)
        if weight.grad is None:  # the first backward of a step: the dense gradient, as torch makes it
            return None, torch.zeros_like(weight).index_add_(0, ids, rows.to(weight.dtype)), None
        weight.grad.index_add_(0, ids, rows.to(weight.grad.dtype))  # [V, H] += the rows this batch touched
        return None, None, None


@contextmanager
def embedding_rows_into_grad(model, enabled: bool = True) -> Iterator[bool]:
    """Within the block, the backward of `model`'s input embedding adds its rows into the weight's `.grad`
    (once it exists: from the second micro-step of an optimizer step on) instead of returning a dense
    [vocab, hidden] gradient; yields whether it applies.

    torch's embedding backward zero-fills a [vocab, hidden] tensor and adds the used rows into it, and
    autograd then adds that whole tensor into `.grad`: on bench/ M (32k x 256) 3.7 ms per lookup against
    0.1 ms, 17 lookups per step (2026-12-06, 2-core AMD EPYC). Adding the rows in place is correct because the
    weight's gradient accumulator runs only after every node with an edge to it (this one's too, even when
    it returns None), so the optimizer, the all-reduce and post-accumulate hooks (torch 2.13) see the whole
    gradient. The sums run in another order: float rounding.

    Only for a plain trained float32 `nn.Embedding` on the CPU, without tensor hooks on its weight (those
    would see only the head's share of a step's gradient): FSDP2's sharded DTensors, `max_norm`,
    `scale_grad_by_freq`, sparse embeddings, other dtypes (torch's bf16 lookup gradient rounds differently)
    and GPUs (where `index_add_` adds in a nondeterministic order) keep torch's own lookup."""
    embed = model.get_input_embeddings() if enabled and hasattr(model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    applies = (type(embed) is torch.nn.Embedding and weight.requires_grad and type(weight) is torch.nn.Parameter
               and weight.dtype == torch.float32 and weight.device.type == "cpu" and not weight._backward_hooks
               and embed.max_norm is None and not embed.scale_grad_by_freq and not embed.sparse)
    if not applies:
        yield False
        return
    before = embed.__dict__.get("forward")  # a block inside another: put back the outer one's
    embed.forward = lambda ids: _RowsIntoGrad.apply(ids, embed.weight, embed.padding_idx)
    try:
        yield True
    finally:
        if before is None:
            del embed.forward
        else:
            embed.forward = before


def head_is_linear(model) -> bool:
    """Whether logits == lm_head(last hidden state) for this model (checked once, on 4 tokens)."""
    base, head = model.base_model, model.get_output_embeddings()
    if head is None or base is model:
        return False
    vocab = model.config.get_text_config().vocab_size  # a vision-language config keeps it in its text config
    ids = torch.arange(4, device=model.device).unsqueeze(0) % vocab
    with torch.no_grad():
        full = model(input_ids=ids).logits.float()
        hidden = base(input_ids=ids).last_hidden_state
        mine = head(hidden).float()
    return torch.allclose(full, mine, atol=1e-4, rtol=1e-3)


def _shared_prompt_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, media=None):
    """The hidden states [N, T, H] that predict each completion token, running each distinct prompt
    once: a [U, P] forward fills a KV cache, whose rows are then repeated (index_select, so the
    gradient of every answer flows back into its prompt) for an [N, T-1] forward over the
    completions. None when no prompt repeats or the model's cache is not plain full attention.

    With `media` (a vision-language model's `RowMedia`) a prompt is its ids and its images' digest (the
    same text over other images is another prompt); the [U, P] forward carries the U prompts' pixels
    and positions (Qwen2-VL's 3-D ones, whose offsets carry the completions' on), so the image encoder
    runs once per prompt in scoring as in sampling. None where a completion holds image tokens (tool
    results with images): every row then runs whole."""
    N, P = prompt_ids.shape
    T = completion_ids.shape[1]
    if media is not None and len(media) != N:
        raise ValueError(f"media has {len(media)} rows for a batch of {N}")
    if N < 2 or P < 1 or T < 1 or (media is not None and bool((completion_ids == media.image_token_id).any())):
        return None
    inverse, first = distinct_prompts(prompt_ids, prompt_mask, media)  # [N], [U]
    if len(first) == N:
        return None
    ids, p_mask = prompt_ids[first], prompt_mask[first]
    inputs, positions, deltas = {}, None, None
    if media is not None:  # the U prompts' pixels; Qwen2-VL: positions [3, U, P], offsets [U, 1]
        prompts = media.select(first)
        inputs = prompts.model_inputs(ids)
        positions, deltas = prompts.position_ids(model, ids, p_mask, inputs)
    found = prompt_forward(model, ids, p_mask, positions, inputs)
    if found is None:
        return None
    last, cache, cache_kwarg = found
    last = last.index_select(0, inverse)  # [N, H] (left padding: the last real token)
    if T == 1:
        return last[:, None]
    for layer in cache.layers:  # [U, h, P, d] -> [N, h, P, d]
        layer.keys, layer.values = layer.keys.index_select(0, inverse), layer.values.index_select(0, inverse)
    mask = torch.cat([prompt_mask, completion_mask[:, : T - 1]], dim=1)  # [N, P+T-1]
    later = position_ids_from_mask(mask)[:, P:]  # [N, T-1]
    if deltas is not None:  # a text position p sits at p + the row's offset on all three axes
        later = (later + deltas.index_select(0, inverse)).unsqueeze(0).expand(3, -1, -1)  # [3, N, T-1]
    out = model.base_model(input_ids=completion_ids[:, : T - 1], attention_mask=mask, position_ids=later,
                           use_cache=True, **{cache_kwarg: cache})
    return torch.cat([last[:, None], out.last_hidden_state], dim=1)  # [N, T, H]


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """How the training forward runs: choices of speed and memory that leave the log-probs as they are (up to float
    rounding). A run builds them from its config's [train] section (`from_train`); the per-call inputs (the
    tensors, the temperature, what to return, `grad_fn`, the images) stay arguments of `completion_logprobs`.

    `chunk_size`: flattened [N*T] rows per chunk of the selective log-softmax (`train.logprob_chunk_size`).
    `linear_head`: logits == lm_head(last hidden state) (`head_is_linear`): the model body runs once and the head
    chunk by chunk, the [N, T, V] logits never whole; False scores through the model's own logits.
    `fused` (linear heads): the fused selective log-softmax of `fused_logprobs`, with the one-pass backward of
    `grad_fn` (`train.fused_logprobs`); False is the plain checkpointed path, kept for ablations and tests.
    `share_prompts` (linear heads): run each distinct prompt once and repeat its KV cache over its answers
    (`train.shared_prompt_forward`; False runs every row's prompt, for ablations).
    `packed` (linear heads, with `share_prompts`, text only, where `packing_applies`, answers of different
    lengths): the answers run as one row without padding (models/packing.py, `train.packed_sequences`); the
    log-probs at padding positions are then 0, and `grad_fn`'s offsets become the chunk's flat positions in [N*T]."""

    chunk_size: int = 1024
    linear_head: bool = True
    fused: bool = True
    share_prompts: bool = True
    packed: bool = False

    @classmethod
    def from_train(cls, train: TrainConfig, *, linear_head: bool, packed: bool = False,
                   backward: bool = False) -> ForwardOptions:
        """The options `train` (a config's [train] section) asks for, for a model whose head is `linear_head`
        and a batch that runs `packed` (`Policy.packs_sequences`). `backward`: a forward the loss backpropagates
        through, where `train.gradient_checkpointing` turns the shared prompt forward off (a checkpointed layer
        cannot write the shared prompt's KV cache: its replay would write it twice)."""
        return cls(chunk_size=train.logprob_chunk_size, linear_head=linear_head, fused=train.fused_logprobs,
                   share_prompts=train.shared_prompt_forward and not (backward and train.gradient_checkpointing),
                   packed=packed)


@keywords_moved_into("options", ForwardOptions, "grpokit.models.forward")
def completion_logprobs(
    model,
    prompt_ids: torch.Tensor,  # [N, P] left-padded
    prompt_mask: torch.Tensor,  # [N, P]
    completion_ids: torch.Tensor,  # [N, T] right-padded
    completion_mask: torch.Tensor,  # [N, T]
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    grad_fn=None,
    media=None,
    options: ForwardOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs `[N, T]` (and entropies `[N, T]` `with_entropy`, else None) of the completion tokens under `model`.

    `grad_fn` (linear heads, `options.fused`): dLoss/dlogp of a chunk of the flattened `[N*T]` log-probs, for the
    fused head's one-pass backward. `media` (`models.media.RowMedia`): the rows' images, for a vision-language
    model (`models/vision_forward.py`; the shared prompt forward takes them too). `options`: how the forward runs
    (`ForwardOptions`, its defaults when None); they change the cost, not the log-probs."""
    options = options or ForwardOptions()
    chunk_size, linear_head, fused = options.chunk_size, options.linear_head, options.fused
    share_prompts, packed = options.share_prompts, options.packed
    lengths = completion_mask.sum(-1) if packed else None  # [N] (one length: no padding to save, the batched forward)
    if packed and share_prompts and linear_head and media is None and len(lengths) > 1 \
            and bool(lengths.min() < lengths.max()) and packing_applies(model):
        found = packed_completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        if found is not None:
            hidden, flat = found  # [S, H], [S] each real token's position in the flattened [N*T]
            head_grad = None if grad_fn is None or not fused else \
                (lambda lp, start: grad_fn(lp, flat[start:start + len(lp)]))
            logp, entropy = token_logprobs_from_hidden(
                hidden[None], model.get_output_embeddings(), completion_ids.reshape(-1).index_select(0, flat)[None],
                temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy, grad_fn=head_grad,
                fused=fused)  # [1, S]

            def padded(x: Tensor) -> Tensor:  # [1, S] -> [N, T], 0 at padding
                return x.new_zeros(completion_ids.numel()).index_copy(0, flat, x[0]).view(completion_ids.shape)

            return padded(logp), None if entropy is None else padded(entropy)
    shared = _shared_prompt_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, media) \
        if share_prompts and linear_head else None
    if media is not None and shared is None:
        from grpokit.models.vision_forward import vision_completion_logprobs

        return vision_completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, media,
                                          temperature=temperature, with_entropy=with_entropy, grad_fn=grad_fn,
                                          options=options)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P+T]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [N, P+T]
    positions = position_ids_from_mask(attention_mask)
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    if linear_head:
        hidden = shared
        if hidden is None:
            hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                                      use_cache=False).last_hidden_state  # [N, P+T, H]
            hidden = hidden[:, P - 1 : P + T - 1]  # [N, T, H]: the state that predicts each completion token
        return token_logprobs_from_hidden(hidden, model.get_output_embeddings(), completion_ids,
                                          temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                                          grad_fn=grad_fn if fused else None, fused=fused)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                   use_cache=False, logits_to_keep=T + 1).logits[:, :-1]  # [N, T, V]
    out = token_logprobs(logits, completion_ids, temperature=temperature, chunk_size=chunk_size,
                         with_entropy=with_entropy)
    return out if with_entropy else (out, None)
