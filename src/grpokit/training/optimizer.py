"""The optimizer: AdamW, stepped after the backward (the default) or inside it (`train.optimizer_in_backward`).

fp32 AdamW holds 16 bytes per trained parameter at the peak of a step: the weight, its gradient and the
two moments. Stepping inside the backward removes the gradient from that sum: each parameter is
updated the moment its gradient is complete (a post-accumulate-grad hook) and the gradient is freed
right away, so at most a layer's worth of gradients exists at any time (about 4 bytes per parameter
saved: 2 GB at 0.5B parameters). torchtune calls this optimizer-in-backward.

What it needs: the whole minibatch's gradient must be complete when the hook fires, so one backward per
optimizer step (no micro-batches), no gradient clipping across parameters (the norm is known only after
every gradient: `train.max_grad_norm = 0`) and one process (the all-reduce runs after the backward).
`config/schema.py` refuses the rest.

The update is AdamW's own (`torch.optim.AdamW` per parameter) and its state is one ordinary AdamW state:
checkpoints are the same as the default's, and a run may resume with either setting. A parameter whose
gradient is not finite is left as it is (its moments too), as the default path skips a whole update;
since the others are already updated by then, such a step counts as skipped and is partial.

The learning-rate schedule (`lr_lambda`) counts the same optimizer steps in both settings. Either
setting can keep the moments in bfloat16 (`train.optimizer_state_dtype`, training/low_precision_state.py).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from grpokit.config.schema import Config
from grpokit.training.low_precision_state import AdamWBF16State, narrow_moments


def build_optimizer(params, *, lr: float, betas: tuple[float, float], weight_decay: float,
                    in_backward: bool, state_dtype: str = "float32", seed: int = 0) -> torch.optim.Optimizer:
    """AdamW over the trainable `params`; `state_dtype` "bfloat16" stores its moments in bfloat16
    (training/low_precision_state.py; `seed` names its rounding noise)."""
    params = [p for p in params if p.requires_grad]
    kwargs = dict(lr=lr, betas=betas, weight_decay=weight_decay)
    low = state_dtype == "bfloat16"
    if in_backward:
        return AdamWInBackward(params, low_precision_seed=seed if low else None, **kwargs)
    return AdamWBF16State(params, seed=seed, **kwargs) if low else \
        torch.optim.AdamW(params, fused=fused_kernel_applies(params), **kwargs)


def fused_kernel_applies(params: list[torch.Tensor]) -> bool | None:
    """Whether AdamW runs torch's fused kernel (`fused=True`): one pass over each parameter, its gradient
    and both moments, where the default on a CPU is a loop of ~8 elementwise ops per parameter (torch
    picks its foreach or fused kernels by default on CUDA only). The update is the same formula (to float
    rounding); on a 2-core AMD EPYC one step took 7.7 ms against 43 ms for a 14M-parameter model and
    0.16 s against 2.4 s for Qwen2.5-0.5B's shapes. transformers' Trainer (and so TRL) uses it by default
    from torch 2.8 on. It runs on plain floating-point tensors on a device it supports; FSDP2's sharded
    parameters (DTensors) keep torch's default. AdamW's param_groups carry the setting into a checkpoint,
    and the default optimizer resumes with the kernel it was saved with (a checkpoint from before this
    setting: the loop); AdamW in the backward chooses anew for its one-parameter optimizers."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    # contiguous: torch's kernel pairs elements by memory position, so a weight whose layout differs from
    # its gradient's or moments' would be updated from the wrong elements (autograd gives plain layouts)
    return all(type(p) in (torch.nn.Parameter, torch.Tensor)  # not a tensor subclass (DTensor)
               and p.is_floating_point() and p.device.type in devices and p.is_contiguous() for p in params) or None


def lr_lambda(config: Config) -> Callable[[int], float]:
    """Linear warmup over `train.warmup_steps` optimizer steps, then constant or cosine decay to 0 at the
    last optimizer step: a training step takes μ x (answers / minibatch_size) of them."""
    per_step = config.algorithm.num_iterations * max(1, config.generation_batch_size // config.minibatch_size)
    warmup, cosine = config.train.warmup_steps, config.train.lr_schedule == "cosine"
    total = config.train.steps * per_step

    def factor(step: int) -> float:  # `step` counts optimizer steps taken so far
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class AdamWInBackward(torch.optim.AdamW):
    """AdamW whose update of each parameter runs inside the backward; `step()` only closes the step.

    It is an AdamW to the schedule and the checkpoint code (param_groups, state, state_dict); each
    parameter's update is a one-parameter AdamW sharing this optimizer's state and learning rate."""

    def __init__(self, params, low_precision_seed: int | None = None, **kwargs):
        params = list(params)
        fused = fused_kernel_applies(params) if low_precision_seed is None else None
        super().__init__(params, fused=fused, **kwargs)  # (never steps: its param_groups record the choice)
        if low_precision_seed is None:
            self._single = {p: torch.optim.AdamW([p], fused=fused, **kwargs) for p in params}
        else:  # bfloat16 moments, each parameter's noise stream named by its index in the whole model
            self._single = {p: AdamWBF16State([p], seed=low_precision_seed, first_index=i, **kwargs)
                            for i, p in enumerate(params)}
        self._low_precision = low_precision_seed is not None
        self._link_state()
        for p in params:
            p.register_post_accumulate_grad_hook(self._update)
        self._norm_sq, self._finite = 0.0, True

    def _link_state(self) -> None:
        for single in self._single.values():
            single.state = self.state  # one state dict: this optimizer's state_dict is a plain AdamW's

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # replaces self.state (floating state widened to the parameter's dtype)
        if self._low_precision:
            narrow_moments(self.state)
        self._link_state()

    @torch.no_grad()
    def _update(self, p: torch.Tensor) -> None:
        grad = p.grad
        p.grad = None  # freed whatever happens: nothing else reads it
        sq = float(torch.linalg.vector_norm(grad, dtype=torch.float32)) ** 2  # no squared copy of the gradient
        if not math.isfinite(sq):
            self._finite = False
            return
        self._norm_sq += sq
        single = self._single[p]
        single.param_groups[0]["lr"] = self.param_groups[0]["lr"]  # the schedule sets this optimizer's lr
        p.grad = grad
        single.step()
        p.grad = None

    def finish_step(self) -> tuple[float, bool]:
        """The gradient norm of the updates the backward just made, and whether every gradient was finite."""
        norm, finite = math.sqrt(self._norm_sq), self._finite
        self._norm_sq, self._finite = 0.0, True
        return norm, finite

    def step(self, closure=None):  # the updates happened in the backward
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:  # every gradient is freed in the backward
        return None
