"""The training forward of a vision-language model: log-probs of completions given prompt + pixels.

The same contract as `forward.completion_logprobs` (which calls this when the batch carries
`RowMedia`): each row's images travel with it (`RowMedia.model_inputs` lays them out as the
processor does), the positions are the family's (multimodal RoPE for Qwen2-VL), and with a linear
head the decoder's hidden states go through the chunked / fused log-prob head, so the [N, T, V]
logits never exist.

With `share_prompts` (`train.shared_prompt_forward`) each distinct prompt (its ids and its images' digest)
runs once with its pixels, the image encoder included, and its KV cache is repeated over its answers for
a text-only forward of the completions, as the text path does (`forward._shared_prompt_hidden`); the G
answers of a group share one image encoding in scoring as in sampling. Where a completion holds images
(tool results) every row runs whole.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpokit.algorithms.logprobs import token_logprobs, token_logprobs_from_hidden
from grpokit.models.media import RowMedia


def vision_completion_logprobs(
    model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
    media: RowMedia, *, temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
    linear_head: bool = True, fused: bool = True, grad_fn=None, share_prompts: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs `[N, T]` (and entropies) of the completion tokens under `model`, the rows' images in view."""
    if len(media) != prompt_ids.shape[0]:
        raise ValueError(f"media has {len(media)} rows for a batch of {prompt_ids.shape[0]}")
    hidden = _shared_prompt_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, media) \
        if share_prompts and linear_head else None
    if hidden is not None:
        return token_logprobs_from_hidden(hidden, model.get_output_embeddings(), completion_ids,
                                          temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                                          grad_fn=grad_fn if fused else None, fused=fused)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P+T]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [N, P+T]
    inputs = media.model_inputs(input_ids)
    positions, _ = media.position_ids(model, input_ids, attention_mask, inputs)  # [N, P+T] or [3, N, P+T]
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    if linear_head:
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                                  use_cache=False, **inputs).last_hidden_state[:, P - 1: P + T - 1]  # [N, T, H]
        return token_logprobs_from_hidden(hidden, model.get_output_embeddings(), completion_ids,
                                          temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                                          grad_fn=grad_fn if fused else None, fused=fused)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False,
                   logits_to_keep=T + 1, **inputs).logits[:, :-1]  # [N, T, V]
    out = token_logprobs(logits, completion_ids, temperature=temperature, chunk_size=chunk_size,
                         with_entropy=with_entropy)
    return out if with_entropy else (out, None)


def _shared_prompt_hidden(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                          completion_mask: Tensor, media: RowMedia) -> Tensor | None:
    """The hidden states [N, T, H] that predict each completion token, each distinct (prompt, images) run once
    [U, P] with its pixels; None where nothing repeats, a completion holds image tokens, or the model's cache is
    not plain full attention (the caller then runs every row whole)."""
    from grpokit.models.forward import _full_attention_cache, position_ids_from_mask

    N, P = prompt_ids.shape
    T = completion_ids.shape[1]
    if N < 2 or P < 1 or T < 1 or bool((completion_ids == media.image_token_id).any()):
        return None
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)  # [N, 2P]
    _, same_text = torch.unique(key, dim=0, return_inverse=True)  # [N]
    groups: dict = {}
    inverse = torch.tensor([groups.setdefault((int(t), None if r is None else r.digest), len(groups))
                            for t, r in zip(same_text.tolist(), media.rows)], device=prompt_ids.device)  # [N]
    U = len(groups)
    found = _full_attention_cache(model) if U < N else None
    if found is None:
        return None
    cache, cache_kwarg = found
    first = torch.zeros(U, dtype=torch.long, device=inverse.device).scatter_(
        0, inverse, torch.arange(N, device=inverse.device))  # [U] one row per distinct prompt
    ids, p_mask, prompts = prompt_ids[first], prompt_mask[first], media.select(first)
    inputs = prompts.model_inputs(ids)
    positions, deltas = prompts.position_ids(model, ids, p_mask, inputs)  # [3, U, P] or [U, P]; [U, 1] or None
    out = model.base_model(input_ids=ids, attention_mask=p_mask, position_ids=positions, use_cache=True,
                           **inputs, **{cache_kwarg: cache})
    last = out.last_hidden_state[:, -1].index_select(0, inverse)  # [N, H]
    if T == 1:
        return last[:, None]
    for layer in cache.layers:  # [U, h, P, d] -> [N, h, P, d]
        layer.keys, layer.values = layer.keys.index_select(0, inverse), layer.values.index_select(0, inverse)
    mask = torch.cat([prompt_mask, completion_mask[:, : T - 1]], dim=1)  # [N, P+T-1]
    text = position_ids_from_mask(mask)[:, P:]  # [N, T-1]
    later = text if deltas is None else (text + deltas.index_select(0, inverse)).unsqueeze(0).expand(3, -1, -1)
    extra = RowMedia(media.family, (None,) * N, media.image_token_id).model_inputs(completion_ids[:, : T - 1])
    out = model.base_model(input_ids=completion_ids[:, : T - 1], attention_mask=mask, position_ids=later,
                           use_cache=True, **extra, **{cache_kwarg: cache})
    return torch.cat([last[:, None], out.last_hidden_state], dim=1)  # [N, T, H]
