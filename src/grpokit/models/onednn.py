"""CPU linear layers through oneDNN: the decode on weights packed once per rollout
(`rollout.packed_weights`), and the training forward and input gradient on the weights as they are
(`train.onednn_linear`).

A decode step multiplies a few rows (the N = B*G active answers) by every weight matrix of the model,
so its cost is reading the weights. On the 2-core AMD EPYC these figures come from (BENCHMARKS.md,
`bench/run.py` reports them per run), torch's own fp32 path (`aten::mm`, MKL) does not come near the
memory bandwidth for such a product: a [16, 896] x [896, 151936] head streamed its weights at
5 GB/s, where a sum over the same tensor reads 26 GB/s. oneDNN's inner-product kernel on a weight
reordered into its blocked layout streams the same product at 20 GB/s (and a [16, 896] x [896, 4864]
MLP matrix at 23), with fp32 accumulation (largest relative difference to float64 7e-7, aten's 4e-7).

The reorder is a copy, so it is done once per call to the sampler (every weight changes at every
optimizer step) and freed at its end: the rollout holds a second copy of the linear weights, 4 bytes
per parameter in fp32, while gradients are not alive (and, for the layer loop's decode steps, one more
copy of the query/key/value and gate/up weights, stacked side by side: `packed_side_by_side`). Where a copy would
take more than half of the memory the system reports available, the sampler runs without it. Only plain CPU
`nn.Linear` modules with fp32 or bf16 weights are packed (a peft LoRA layer's base layer is one; FSDP's
sharded or otherwise subclassed parameters are not); everything else runs as before.

Training cannot pack (the weights change at every step, inside the backward with
`train.optimizer_in_backward`), but oneDNN's kernel on a plain row-major weight is still faster than
aten's for the forward product and the input gradient at these shapes (measured on L's projections,
2560 rows: 104-150 -> 170-197 GFLOP/s forward, 109-183 -> 156-201 input gradient). The weight gradient
stays aten's (`dY^T X`, where oneDNN was not consistently faster). The fused log-softmax head, which multiplies
by the head's weight without calling the module, takes the same product from the module's forward
(`forward.product`) for its logits and dL/dh: on bench/ M's [256, 256] x [256, 32000] chunks 200 against 141
GFLOP/s (logits) and 208 against 171 (dL/dh), 0.41 s of a 7.9 s step. `_Linear` is that split as an
autograd function: it saves what aten's linear saves (input and weight), no more.

Which dtypes oneDNN can run depends on the CPU: its bf16 kernels need AVX-512 (BW, VL, DQ) or
AVX-NE-CONVERT, and on an AVX2-only host the reorder raises ("bf16 path needs the cpu support ...").
`kernel_available(dtype)` asks torch's own capability query and then runs the two ops once on a tiny
tensor, so the choice rests on what the ops do here, not on a list of CPUs; a dtype they cannot run
takes torch's plain path, and `kernel_note` says so once at start-up.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

_AVAILABLE: dict[torch.dtype, bool] = {}  # dtype -> whether this CPU runs oneDNN's linear in it (probed once)


def kernel_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed and plain linear kernels run in `dtype` (float32 or bfloat16) on this CPU."""
    if dtype not in _AVAILABLE:
        _AVAILABLE[dtype] = _probe(dtype)
    return _AVAILABLE[dtype]


def _probe(dtype: torch.dtype) -> bool:
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16 and not ops._is_mkldnn_bf16_supported():  # AVX-512 BW/VL/DQ or AVX-NE-CONVERT
        return False
    try:
        with torch.no_grad():
            w, x = torch.ones(8, 16, dtype=dtype), torch.ones(2, 16, dtype=dtype)  # tiny: microseconds
            packed = ops._reorder_linear_weight(w, 2)
            ok = bool((ops._linear_pointwise(x, packed, None, "none", [], "") == 16).all())
            return ok and bool((ops._linear_pointwise(x, w, None, "none", [], "") == 16).all())
    except RuntimeError:  # the op's own refusal on a CPU it does not support
        return False


def kernel_note(dtype: str | torch.dtype, device: torch.device, *, packed_weights: bool, onednn_linear: bool
                ) -> list[str]:
    """The start-up line (a list of one, or empty) when a oneDNN path the config asks for cannot run in
    `dtype` on this CPU."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    asked = [name for name, on in (("rollout.packed_weights", packed_weights), ("train.onednn_linear", onednn_linear))
             if on]
    if not asked or device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or kernel_available(dtype):
        return []
    from grpokit.models.cpu import describe_cpu

    return [f"{' and '.join(asked)}: this CPU ({describe_cpu()}) has no oneDNN {str(dtype).removeprefix('torch.')} "
            f"linear kernel, so its linear layers take torch's plain path (same results, a slower step)"]


def _memory_allows(nbytes: int) -> bool:
    """Whether a packed copy of `nbytes` fits in half of the memory Linux says is available (MemAvailable);
    True where /proc/meminfo cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return True
    return nbytes <= kb * 1024 // 2


def _packable(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module) is nn.Linear and type(w) in (nn.Parameter, torch.Tensor) and w.device.type == "cpu"
            and w.dtype in (torch.float32, torch.bfloat16) and w.dim() == 2 and kernel_available(w.dtype))


def _packed_forward(module: nn.Linear, packed: torch.Tensor, rows: int):
    linear, bias = torch.ops.mkldnn._linear_pointwise, module.bias
    bias = None if bias is None else bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if x.dtype != packed.dtype or torch.is_grad_enabled():  # not what it was packed for: the plain path
            return nn.Linear.forward(module, x)
        return linear(x, packed, bias, "none", [], "")

    forward.packed_rows = rows  # packed_side_by_side reads it
    return forward


def packed_side_by_side(groups: list[list[nn.Module]]) -> list | None:
    """One packed oneDNN product per group of linear layers that read the same input (each layer's query,
    key and value projections; its gate and up projections), or None where the modules are not all packed
    (outside `packed_linears`, or a module it left plain), their weights differ in dtype, or the stacked
    copies would crowd the machine (decided once for all groups, before any copy is made).

    Returns one forward per group: x [..., in] -> the group's outputs [..., out_i], in order, from their
    weights stacked into one matrix, packed once, multiplied in one call. Each output is the same dot
    products as its module's own (bitwise equal on a 2-core AMD EPYC). One call instead of three (or two)
    saves oneDNN's per-call cost, much of a decode step's small products: on Qwen2 widths 256/1024 with 8
    rows, 61 -> 35 us for q/k/v and 79 -> 69 us for gate/up. A forward with gradients or in another dtype
    runs the modules themselves, as the modules' packed forwards do."""
    modules = [m for group in groups for m in group]
    forwards = [m.__dict__.get("forward") for m in modules]
    if not modules or not all(hasattr(f, "packed_rows") for f in forwards) \
            or len({m.weight.dtype for m in modules}) != 1:
        return None
    nbytes = [sum(m.weight.numel() for m in group) * modules[0].weight.element_size() for group in groups]
    if not _memory_allows(sum(nbytes) + max(nbytes)):  # the packed copies, and one group's stack while packing
        return None
    rows = forwards[0].packed_rows
    return [_stacked_forward(group, rows) for group in groups]


def _stacked_forward(modules: list[nn.Module], rows: int):
    weight = torch.cat([m.weight.detach() for m in modules])  # [sum out, in]
    sizes = [m.weight.shape[0] for m in modules]
    bias = None
    if any(m.bias is not None for m in modules):
        bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(n)
                          for m, n in zip(modules, sizes)])
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    del weight
    linear = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # x [..., in] -> ([..., out_i] per module)
        if x.dtype != packed.dtype or torch.is_grad_enabled():  # not what it was packed for: the modules
            return tuple(m(x) for m in modules)
        return linear(x, packed, bias, "none", [], "").split(sizes, -1)

    return forward


def _restore(modules: list[nn.Module], before: list) -> None:
    for m, forward in zip(modules, before):
        if forward is None:
            m.__dict__.pop("forward", None)
        else:
            m.forward = forward


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _Linear(torch.autograd.Function):
    """y = x W^T + b with oneDNN for y and dL/dx, aten for dL/dW and dL/db."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # x [..., in], weight [out, in], bias [out] -> [..., out]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):  # dy [..., out]
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        dx = _linear(dy, weight.t(), None) if need_x else None  # [..., out] x [out, in] -> [..., in]
        dy2 = dy.reshape(-1, dy.shape[-1])  # [rows, out]
        dw = dy2.t() @ x.reshape(-1, x.shape[-1]) if need_w else None  # [out, in]
        db = dy2.sum(0) if need_b and ctx.has_bias else None  # [out]
        return dx, dw, db


def _training_forward(module: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != module.weight.dtype:  # autocast or a mixed-dtype caller: the plain path decides
            return nn.Linear.forward(module, x)
        return _Linear.apply(x, module.weight, module.bias)

    # the product itself, for code that multiplies by this module's weight without calling it: the fused
    # log-softmax head (algorithms/fused_logprobs.py) computes the logits and dL/dh with it
    forward.product = _linear
    return forward


@contextmanager
def onednn_linears(*models: nn.Module | None, enabled: bool = True) -> Iterator[int]:
    """Within the block, every packable `nn.Linear` of `models` (None and other objects are skipped)
    computes its forward and input gradient through oneDNN (`_Linear`) on its live weights; yields how
    many modules were switched. The backward of a forward run inside must run inside too (a checkpointed
    layer's replay must save what its first forward saved)."""
    models = [m for m in models if isinstance(m, nn.Module)] if enabled else []
    modules = list({id(m): m for model in models for m in model.modules() if _packable(m)}.values())
    before = [m.__dict__.get("forward") for m in modules]
    try:
        for m in modules:
            m.forward = _training_forward(m)
        yield len(modules)
    finally:
        _restore(modules, before)


@contextmanager
def packed_linears(model: nn.Module, rows: int, enabled: bool = True) -> Iterator[int]:
    """Within the block, every packable `nn.Linear` of `model` multiplies through oneDNN with its weight
    packed for about `rows` rows; yields how many modules were packed (0: nothing changed).

    For inference only (the sampler runs under `torch.inference_mode`): the packed copy does not follow
    later changes to the weights, and the block must not be used for a forward that needs gradients.
    """
    modules = [m for m in model.modules() if _packable(m)] if enabled else []
    if not _memory_allows(sum(m.weight.numel() * m.weight.element_size() for m in modules)):
        modules = []  # the copy would crowd the machine: the plain path (slower decode, no extra memory)
    before = [m.__dict__.get("forward") for m in modules]  # a block inside another: put back the outer one's
    try:
        with torch.no_grad():
            for m in modules:
                packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), max(1, rows))
                m.forward = _packed_forward(m, packed, max(1, rows))  # an instance attribute shadows the class's
        yield len(modules)
    finally:
        _restore(modules, before)
