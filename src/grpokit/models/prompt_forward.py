"""The prompt forward shared by a prompt's answers: each distinct prompt runs once into a KV cache that its answers'
tokens then attend to (the padded path in models/forward.py repeats the cache per answer; the packed one in
models/packing.py gathers each answer's prompt keys from it)."""

from __future__ import annotations

import torch
from torch import Tensor


def position_ids_from_mask(mask: Tensor) -> Tensor:
    """Positions that count only real tokens, so left padding does not shift them."""
    return (mask.long().cumsum(-1) - 1).clamp_(min=0)  # [N, L]


def full_attention_cache(model):
    """An empty DynamicCache for `model` and the keyword it goes under, or None when some layer is
    not plain full attention (sliding windows, linear attention: their caches have other semantics)."""
    import inspect

    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        cache = DynamicCache(config=model.config)
    except Exception:  # noqa: BLE001 - a config this transformers cannot build a cache from
        return None
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    params = inspect.signature(model.base_model.forward).parameters
    return cache, ("cache" if "cache" in params else "past_key_values")


def distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor, media=None) -> tuple[Tensor, Tensor]:
    """Each row's distinct prompt [N] (its ids and mask; with `media`, also its images) and one row holding
    each distinct prompt [U]."""
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)  # [N, 2P]
    _, inverse = torch.unique(key, dim=0, return_inverse=True)  # [N] prompt group of each row
    if media is not None:  # the same text with other images is another prompt
        groups: dict = {}
        inverse = torch.tensor([groups.setdefault((int(t), None if r is None else r.digest), len(groups))
                                for t, r in zip(inverse.tolist(), media.rows)], device=inverse.device)  # [N]
    U, N = int(inverse.max()) + 1, len(inverse)
    first = torch.zeros(U, dtype=torch.long, device=inverse.device).scatter_(
        0, inverse, torch.arange(N, device=inverse.device))  # [U]
    return inverse, first


def prompt_forward(model, ids: Tensor, mask: Tensor, positions: Tensor | None = None, inputs: dict | None = None):
    """[U, P] left-padded prompts through the model's body into a fresh KV cache: (the states at their last
    token [U, H], the cache, the keyword it goes under), or None when the cache is not plain full attention."""
    found = full_attention_cache(model)
    if found is None:
        return None
    cache, cache_kwarg = found
    positions = position_ids_from_mask(mask) if positions is None else positions  # [U, P]
    out = model.base_model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                           **(inputs or {}), **{cache_kwarg: cache})
    return out.last_hidden_state[:, -1], cache, cache_kwarg
