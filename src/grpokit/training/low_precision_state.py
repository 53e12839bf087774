"""AdamW with its two moments stored in bfloat16 (`train.optimizer_state_dtype = "bfloat16"`).

fp32 AdamW keeps 8 bytes of state per trained parameter; in bfloat16 the moments take 4, which at 0.5B
parameters is 2 GB less at every moment of the run (weights, gradients and the update stay fp32).

The update itself is computed in fp32, exactly as `torch.optim.AdamW` computes it, from the stored
moments widened to fp32; only the new moments are narrowed. Narrowing must not round to nearest:
with beta2 = 0.999 the second moment moves by 0.1% of itself per step, less than half of bfloat16's
spacing (2^-8 = 0.4% relative), so round-to-nearest would leave it where it is for ever. Each moment
is rounded *stochastically* instead (up with probability equal to the fraction of the spacing it
passed), which is unbiased: in expectation the stored moment follows the fp32 one. The noise is drawn
from a generator seeded by (train.seed, optimizer step, parameter index), so a resumed run draws the
same noise as an uninterrupted one and the optimizer needs no extra checkpoint state.

The work runs over each parameter in chunks of 4M elements, so the fp32 temporaries stay at a few tens
of MB even for a 150k-row embedding.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 1 << 22  # elements per chunk of the update: 16 MB per fp32 temporary


def round_stochastic(x: Tensor, generator: torch.Generator) -> Tensor:
    """fp32 x -> bfloat16, rounded up or down at random with the probabilities that make it unbiased:
    a bfloat16 is an fp32 with the low 16 bits zero, so add 16 random low bits and cut them off."""
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=generator, device=x.device)
    cut = (bits + noise).bitwise_and_(-65536)  # -65536 = 0xFFFF0000: keep sign, exponent, 7 mantissa bits
    out = cut.view(torch.float32).to(torch.bfloat16)  # exact: the dropped bits are zero
    finite = torch.isfinite(x)  # inf and nan keep their value (the bit trick could turn a large finite into inf)
    return out if bool(finite.all()) else torch.where(finite, out, x.to(torch.bfloat16))


def narrow_moments(states: dict) -> None:
    """The moments of loaded AdamW `states` back to bfloat16 (exact: they were saved in bfloat16)."""
    for state in states.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key] = state[key].to(torch.bfloat16)


class AdamWBF16State(torch.optim.AdamW):
    """`torch.optim.AdamW` (no amsgrad, no foreach/fused kernels) with bfloat16 moments; see the module
    docstring. `seed` and `first_index` name the noise streams (`first_index`: the index of this
    optimizer's first parameter in the whole model, for one-parameter optimizers inside the backward)."""

    def __init__(self, params, *, seed: int = 0, first_index: int = 0, **kwargs):
        super().__init__(params, **kwargs)
        self.seed, self.first_index = seed, first_index

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # torch widens floating state to the parameter's dtype: narrow it back
        narrow_moments(self.state)

    def _generator(self, step: int, index: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1_000_033 + self.first_index + index)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        index = 0
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16,
                                                           memory_format=torch.contiguous_format)
                state["step"] += 1
                step = int(state["step"])
                bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
                generator = self._generator(step, index - 1)
                w = p.view(-1)  # [n] (a view: parameters are contiguous)
                g = p.grad.reshape(-1)  # [n]
                m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)  # [n] bfloat16
                for start in range(0, w.numel(), CHUNK):
                    sl = slice(start, start + CHUNK)
                    gc = g[sl].float()
                    mc, vc = m[sl].float(), v[sl].float()
                    mc.lerp_(gc, 1 - beta1)
                    vc.mul_(beta2).addcmul_(gc, gc, value=1 - beta2)
                    wc = w[sl]
                    wc.mul_(1 - lr * wd)
                    denom = (vc.sqrt() / bias2 ** 0.5).add_(eps)
                    wc.addcdiv_(mc, denom, value=-lr / bias1)
                    m[sl], v[sl] = round_stochastic(mc, generator), round_stochastic(vc, generator)
        return loss
