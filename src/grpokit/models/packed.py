"""Decode matmuls through oneDNN with weights packed once per rollout (`rollout.packed_weights`).

A decode step multiplies a few rows (the N = B*G active answers) by every weight matrix of the model,
so its cost is reading the weights. On the 2-core AMD EPYC these figures come from (BENCHMARKS.md,
`bench/run.py` reports them per run), torch's own fp32 path (`aten::mm`, MKL) does not come near the
memory bandwidth for such a product: a [16, 896] x [896, 151936] head streamed its weights at
5 GB/s, where a sum over the same tensor reads 26 GB/s. oneDNN's inner-product kernel on a weight
reordered into its blocked layout streams the same product at 20 GB/s (and a [16, 896] x [896, 4864]
MLP matrix at 23), with fp32 accumulation (largest relative difference to float64 7e-7, aten's 4e-7).

The reorder is a copy, so it is done once per call to the sampler (every weight changes at every
optimizer step) and freed at its end: the rollout holds a second copy of the linear weights, 4 bytes
per parameter in fp32, while gradients are not alive. Only plain CPU `nn.Linear` modules with fp32 or
bf16 weights are packed (a peft LoRA layer's base layer is one; FSDP's sharded or otherwise
subclassed parameters are not); everything else runs as before.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


def _supported() -> bool:
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight") \
        and hasattr(ops, "_linear_pointwise")


def _packable(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module) is nn.Linear and type(w) in (nn.Parameter, torch.Tensor) and w.device.type == "cpu"
            and w.dtype in (torch.float32, torch.bfloat16) and w.dim() == 2)


def _packed_forward(module: nn.Linear, packed: torch.Tensor):
    linear, bias = torch.ops.mkldnn._linear_pointwise, module.bias
    bias = None if bias is None else bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if x.dtype != packed.dtype or torch.is_grad_enabled():  # not what it was packed for: the plain path
            return nn.Linear.forward(module, x)
        return linear(x, packed, bias, "none", [], "")

    return forward


@contextmanager
def packed_linears(model: nn.Module, rows: int, enabled: bool = True) -> Iterator[int]:
    """Within the block, every packable `nn.Linear` of `model` multiplies through oneDNN with its weight
    packed for about `rows` rows; yields how many modules were packed (0: nothing changed).

    For inference only (the sampler runs under `torch.inference_mode`): the packed copy does not follow
    later changes to the weights, and the block must not be used for a forward that needs gradients.
    """
    modules = [m for m in model.modules() if _packable(m)] if enabled and _supported() else []
    try:
        with torch.no_grad():
            for m in modules:
                packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), max(1, rows))
                m.forward = _packed_forward(m, packed)  # an instance attribute shadows the class's
        yield len(modules)
    finally:
        for m in modules:
            m.__dict__.pop("forward", None)
