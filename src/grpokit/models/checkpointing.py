"""Activation checkpointing per decoder layer (`train.gradient_checkpointing`).

Without it the training forward keeps every layer's activations until the backward: for a long
answer or a real-size model they, not the weights, decide whether a step fits in memory. With it
each decoder layer keeps only its input, and the backward runs the layer again to get the rest
(one more forward of the body per step, about a third more compute).

The layers are the modules transformers itself marks as checkpointable (`GradientCheckpointingLayer`),
but grpokit wraps their `forward` itself instead of calling `model.gradient_checkpointing_enable()`:
transformers checkpoints only in training mode, and grpokit's policy stays in eval mode (no dropout,
so the ratio is exactly 1 before the first update). torch's non-reentrant checkpoint is used, so
the gradient is the plain path's (same kernels run again on the same inputs) and keyword arguments
pass through.

A layer that writes a KV cache is never checkpointed: the replay would write it a second time. So
with gradients on, the training forward runs every answer's whole sequence (no shared prompt forward,
`models/forward.py`); sampling and the old / reference log-probs run without gradients, as before.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


def decoder_layers(model) -> list[torch.nn.Module]:
    """The modules of `model` that transformers marks as checkpointable layers (one per decoder block)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _writes_cache(kwargs: dict) -> bool:
    return bool(kwargs.get("use_cache")) or any(kwargs.get(k) is not None for k in CACHE_KWARGS)


def enable_activation_checkpointing(model) -> int:
    """Checkpoint each decoder layer of `model` whenever gradients are on and no cache is used; returns
    how many layers were wrapped (0: the architecture has none transformers marks; the caller says so)."""
    layers = decoder_layers(model)
    for layer in layers:
        if getattr(layer, "_grpokit_checkpointed", False):
            continue
        plain = layer.forward

        def forward(*args, _plain=plain, **kwargs):
            if torch.is_grad_enabled() and not _writes_cache(kwargs):
                return checkpoint(_plain, *args, use_reentrant=False, **kwargs)
            return _plain(*args, **kwargs)

        layer.forward = forward
        layer._grpokit_checkpointed = True
    return len(layers)
