"""Packed sequences: a micro-batch's answers as one row without padding (`train.packed_sequences`).

A padded micro-batch is [rows, longest answer]: every shorter answer computes padding, through every layer and
the 32k-word head. Sorting by length (`train.micro_batch_grouping`) leaves 6-9% of it on realistic lengths
(16-512 tokens) and needs many small micro-batches to get there. Packed, the answers' tokens run back to back
as one row, each answer's positions starting where its prompt ends, and every layer's attention keeps each
answer to itself, so nothing but real tokens is computed and a token budget fills a micro-batch with any mix of
lengths.

The layout keeps the shared prompt forward (models/forward.py): each distinct prompt runs once as a [U, P]
forward that fills a KV cache, then the answers run as one row [1, Q] (Q = sum of (length - 1): the last token of
an answer predicts nothing). Answer i's queries see its prompt's cached keys and its own earlier tokens: a
variable-length, causal attention whose diagonal sits at the bottom right of each answer's [q_i, p_i + q_i]
block (`varlen_attention`).

Kernels: on a GPU with FlashAttention installed, `flash_attn_varlen_func` computes exactly this (cu_seqlens_q
and cu_seqlens_k, causal=True aligns the diagonal bottom-right); elsewhere (a CPU: torch's SDPA has no
variable-length kernel) SDPA runs once per answer, on views of the packed tensors. A dense block-diagonal mask
over the row would compute attention over the whole row, quadratically in the packed length.

The layers' attention is reached through transformers' attention interface: the packed forward runs with the
model's `attn_implementation` set to PACKED_ATTENTION (registered here), which receives the layout as the
`packed` keyword. `packing_applies` checks once per model, on a few tokens, that this gives the padded forward's
hidden states; a model whose layers do not pass the keyword through, or that attends another way, runs padded.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from grpokit.models.prompt_forward import distinct_prompts, position_ids_from_mask, prompt_forward

PACKED_ATTENTION = "grpokit_packed"

try:  # a GPU with FlashAttention 2.1 or later (its causal mask aligned bottom-right): its variable-length kernel
    import flash_attn
    from flash_attn import flash_attn_varlen_func

    if tuple(int(p) for p in flash_attn.__version__.split(".")[:2]) < (2, 1):
        flash_attn_varlen_func = None
except Exception:  # noqa: BLE001 - not installed, or its CUDA extension does not load
    flash_attn_varlen_func = None


@dataclass(frozen=True)
class PackedLayout:
    """Where each answer's queries and keys sit in the packed row, for every layer's attention."""

    cache: object  # the [U, P] prompt forward's DynamicCache: layer l's keys / values [U, h_kv, P, d]
    key_index: Tensor  # [K] each key's position in cat(prompt keys flattened [U*P], the row's own keys [Q])
    q_lens: list[int]  # per answer with queries: its query count q_i (its length - 1)
    k_lens: list[int]  # its key count: its prompt's real tokens + q_i
    cu_q: Tensor  # [n+1] int32 query offsets (FlashAttention's cu_seqlens_q)
    cu_k: Tensor  # [n+1] int32 key offsets


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, layout: PackedLayout, scale: float | None,
                     dropout: float = 0.0) -> Tensor:
    """Causal attention within each answer, its diagonal bottom-right: q [Q, h, d], k and v [K, h_kv, d] ->
    [Q, h, d]. Answer i's query j sees its keys 0 .. j + k_i - q_i (its prompt, then its own tokens up to j)."""
    if q.is_cuda and flash_attn_varlen_func is not None and q.dtype in (torch.float16, torch.bfloat16):
        return flash_attn_varlen_func(q, k, v, layout.cu_q, layout.cu_k, max(layout.q_lens), max(layout.k_lens),
                                      dropout_p=dropout, softmax_scale=scale, causal=True)
    gqa = q.shape[1] != k.shape[1]
    out = []
    # [h, Q, d] split per answer (views); split's backward is one concatenation, not a zero-filled copy per answer
    for qi, ki, vi in zip(q.transpose(0, 1).split(layout.q_lens, 1), k.transpose(0, 1).split(layout.k_lens, 1),
                          v.transpose(0, 1).split(layout.k_lens, 1)):
        n_q, n_k = qi.shape[1], ki.shape[1]
        mask = None if n_q == n_k else torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        out.append(F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=mask, dropout_p=dropout,
                                                  is_causal=mask is None, scale=scale, enable_gqa=gqa)[0])
    return torch.cat(out, 1).transpose(0, 1)  # [Q, h, d]


UNSUPPORTED = ("sliding_window", "softcap", "s_aux")  # attention features the packed kernels do not compute


def _packed_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *, packed: PackedLayout,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention interface for the packed row: query [1, h, Q, d], the row's own key and value
    [1, h_kv, Q, d] (after the rotary embedding) -> [1, Q, h, d], with each answer's prompt keys from the cache."""
    if any(kwargs.get(name) is not None for name in UNSUPPORTED):  # the model then runs padded (packing_applies)
        raise ValueError(f"packed attention does not compute {[n for n in UNSUPPORTED if kwargs.get(n) is not None]}")
    layer = packed.cache.layers[module.layer_idx]
    U, h_kv, P, d = layer.keys.shape

    def keys(prompt: Tensor, own: Tensor) -> Tensor:  # [U, h_kv, P, d], [1, h_kv, Q, d] -> [K, h_kv, d]
        flat = torch.cat([prompt.transpose(1, 2).reshape(U * P, h_kv, d), own[0].transpose(0, 1)])
        return flat.index_select(0, packed.key_index)

    out = varlen_attention(query[0].transpose(0, 1), keys(layer.keys, key), keys(layer.values, value), packed,
                           scaling, dropout)
    return out[None], None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)


_register()


@contextmanager
def _attention_implementation(model, name: str):
    """The text layers look up their config's `_attn_implementation` on every call: `name` for this block only.
    (Set on the text config itself: the public setter would also write, and on the way back overwrite, every
    sub-config's own kernel, a vision tower's included.)"""
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}.values()
    before = [c._attn_implementation_internal for c in configs]
    for c in configs:
        c._attn_implementation_internal = name
    try:
        yield
    finally:
        for c, kernel in zip(configs, before):
            c._attn_implementation_internal = kernel


def packed_completion_hidden(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                             completion_mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """The hidden states [S, H] that predict each real completion token (S = completion_mask.sum(), row by row)
    and each one's flat position [S] in the [N, T] layout, from one prompt forward and one packed row. None where
    the layout does not apply: answers with holes in their mask, an empty prompt, a model whose cache is not plain
    full attention."""
    N, P = prompt_ids.shape
    T = completion_ids.shape[1]
    lengths = completion_mask.sum(-1)  # [N]
    prompt_lens = prompt_mask.sum(-1)  # [N]
    device = completion_ids.device
    if N == 0 or bool((prompt_lens < 1).any()) or not bool(
            (completion_mask.bool() == (torch.arange(T, device=device) < lengths[:, None])).all()):
        return None
    inverse, first = distinct_prompts(prompt_ids, prompt_mask)  # [N], [U]
    found = prompt_forward(model, prompt_ids[first], prompt_mask[first])
    if found is None:
        return None
    last, cache, _ = found  # [U, H], the prompts' KV cache
    U = len(first)
    q_lens = (lengths - 1).clamp(min=0)  # [N] the tokens each answer feeds in
    S, Q = int(lengths.sum()), int(q_lens.sum())
    rows = torch.arange(N, device=device)
    q_start = torch.cumsum(q_lens, 0) - q_lens  # [N]
    token_row = rows.repeat_interleave(lengths)  # [S] each real token's row
    token_col = torch.arange(S, device=device) - (torch.cumsum(lengths, 0) - lengths).repeat_interleave(lengths)
    # the state predicting token j of row i: its prompt's last one (j = 0), else the row's output at q_start + j - 1
    source = torch.where(token_col == 0, inverse[token_row], U + q_start[token_row] + token_col - 1)  # [S]
    if Q == 0:
        return last.index_select(0, source), token_row * T + token_col
    q_row = rows.repeat_interleave(q_lens)  # [Q]
    q_col = torch.arange(Q, device=device) - q_start.repeat_interleave(q_lens)  # [Q]
    ids = completion_ids[q_row, q_col]  # [Q]
    positions = prompt_lens[q_row] + q_col  # [Q] each answer continues from its prompt's length
    # keys per answer with queries: its prompt's real tokens in the cache, then its own tokens in the row
    active = q_lens > 0  # [N]
    prompt_keys = (inverse[:, None] * P + torch.arange(P, device=device))[prompt_mask.bool() & active[:, None]]
    own_keys = U * P + torch.arange(Q, device=device)
    key_row = torch.cat([rows.repeat_interleave(prompt_lens * active), q_row])
    key_index = torch.cat([prompt_keys, own_keys])[torch.argsort(key_row, stable=True)]  # [K]
    q_list = q_lens[active].tolist()
    k_list = (q_lens + prompt_lens)[active].tolist()
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    layout = PackedLayout(cache, key_index, q_list, k_list,
                          torch.cat([zero, torch.tensor(q_list, device=device).cumsum(0, dtype=torch.int32)]),
                          torch.cat([zero, torch.tensor(k_list, device=device).cumsum(0, dtype=torch.int32)]))
    with _attention_implementation(model, PACKED_ATTENTION):
        out = model.base_model(input_ids=ids[None], position_ids=positions[None], use_cache=False, packed=layout)
    hidden = torch.cat([last, out.last_hidden_state[0]]).index_select(0, source)  # [S, H]
    return hidden, token_row * T + token_col


def packing_applies(model) -> bool:
    """Whether the packed forward gives `model`'s padded hidden states: checked once per model on three answers
    (two sharing a prompt, one prompt left-padded, one answer of a single token) against the plain forward."""
    known = getattr(model, "_grpokit_packing_applies", None)
    if known is not None:
        return known
    try:
        device = next(model.parameters()).device
        # a GPU packs with FlashAttention's varlen kernel (fp16/bf16) only: SDPA once per answer is a kernel
        # launch per answer and layer there, likely slower than the padded batch
        ok = device.type == "cpu" or (device.type == "cuda" and flash_attn_varlen_func is not None
                                      and next(model.parameters()).dtype in (torch.float16, torch.bfloat16))
        ok = ok and _same_as_padded(model)
    except Exception:  # noqa: BLE001 - a model whose layers reject the keyword or attend another way: padded
        ok = False
    try:
        object.__setattr__(model, "_grpokit_packing_applies", ok)
    except Exception:  # noqa: BLE001 - a wrapper that refuses attributes: check again next time
        pass
    return ok


@torch.no_grad()
def _same_as_padded(model) -> bool:
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (3, 4), generator=g)
    prompts[1] = prompts[0]
    prompt_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    answers = torch.randint(1, vocab, (3, 5), generator=g)
    answer_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    prompts, prompt_mask, answers, answer_mask = (t.to(device) for t in (prompts, prompt_mask, answers, answer_mask))
    packed = packed_completion_hidden(model, prompts, prompt_mask, answers, answer_mask)
    if packed is None:
        return False
    hidden, flat = packed
    mask = torch.cat([prompt_mask, answer_mask], 1)
    full = model.base_model(input_ids=torch.cat([prompts, answers], 1), attention_mask=mask,
                            position_ids=position_ids_from_mask(mask), use_cache=False).last_hidden_state
    want = full[:, 3:8].reshape(15, -1).index_select(0, flat)  # [S, H] the states predicting each answer token
    if hidden.shape != want.shape:
        return False
    tol = 1e-4 if hidden.dtype in (torch.float32, torch.float64) else 2e-2
    error = (hidden - want).float().norm(dim=-1) / want.float().norm(dim=-1).clamp(min=1e-6)  # [S] per token
    return bool((error <= tol).all())
