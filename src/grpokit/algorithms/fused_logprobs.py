"""Fused selective log-softmax through a linear output head, with an optional one-pass backward.

For hidden states h ``[R, H]``, a linear head (W ``[V, H]``, b ``[V]``), chosen ids y ``[R]`` and
temperature τ, this computes per row

    z = (h Wᵀ + b) / τ,   logp = z_y − logsumexp(z),   entropy = −Σ softmax(z) · log softmax(z)

chunk by chunk, so at most ``chunk_size`` rows of logits exist at once, with the fewest passes
over the vocabulary: one exp per logit (exp dominates: on a CPU it costs about as much as the
head's matmul), and no autograd graph over ``[R, V]`` tensors. Backward recomputes each chunk's
logits (``lse`` is kept, so the max/sum passes are not redone) and applies the closed form
``∂logp/∂z = onehot(y) − softmax(z)`` (and ``∂H/∂z = −p (log p + H)`` when the entropy has a
gradient).

**One-pass mode** (``grad_fn``). The GRPO losses grpokit uses are, per token, a function of that
token's log-prob only (token-level ratios; GSPO's sequence ratio is constant on the first,
on-policy pass), so ``dLoss/dlogp`` of a chunk is known as soon as the chunk's log-probs are.
``grad_fn(logp_chunk, start)`` returns it, and forward then also computes the head's gradient
for it (three matmuls per token, the model-FLOP minimum, instead of four, and one exp instead of
two). Backward checks that the gradient autograd delivers equals the one used (``torch.equal``):
if it does, the stored gradients are returned; if it does not (a loss that is not per-token),
it falls back to the recompute path, so the result is right either way.

Pure torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Product = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]  # (x [r, K], w [O, K], b [O] | None) -> x wᵀ + b [r, O]

# How often each backward path ran (read by tests and benchmarks; never by the library).
PATH_COUNTS = {"one_pass": 0, "recompute": 0}




def _acc(weight: Tensor) -> torch.dtype:
    return torch.promote_types(weight.dtype, torch.float32)  # float32, or float64 for float64 heads


class _Workspace:
    """Two [chunk, V] buffers, reused by every chunk and kept between calls (one set per device,
    dtype and vocabulary size, the largest asked for). A fresh tensor of that size costs page
    faults on every allocation (glibc maps large blocks anew each time), which on a CPU costs
    several times the exp that fills it. With a `product` (oneDNN, which has no `out=`) the logits
    are its output and only the exp buffer is kept; training keeps freed memory mapped
    (`train.keep_freed_memory`), so that output reuses the previous chunk's pages."""

    _kept: dict = {}

    def __new__(cls, rows: int, weight: Tensor):
        V, acc = weight.shape[0], _acc(weight)
        key = (weight.device, acc, V)
        work = cls._kept.get(key)
        if work is None or work.exp.shape[0] < rows:
            work = super().__new__(cls)
            work.logits = None  # made by the first chunk that writes into it (not with a `product`: its output)
            work.exp = torch.empty(rows, V, dtype=acc, device=weight.device)
            cls._kept[key] = work
        return work

    def scaled_logits(self, h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float,
                      product: Product | None = None) -> Tensor:
        """z = (h Wᵀ + b) / temperature → [r, V], written into the logits buffer (with `product`: its output)."""
        if product is not None and weight.dtype == self.exp.dtype:
            z = product(h, weight, bias)  # [r, V] (a new tensor: the allocator hands back the last chunk's pages)
            return z.div_(temperature) if temperature != 1.0 else z
        if self.logits is None:
            self.logits = torch.empty_like(self.exp)
        z = self.logits[: h.shape[0]]
        if weight.dtype == z.dtype:
            if bias is None:
                torch.mm(h, weight.t(), out=z)
            else:
                torch.addmm(bias, h, weight.t(), out=z)
        else:  # low-precision head: matmul in its dtype, softmax math in float32
            z.copy_(torch.nn.functional.linear(h, weight, bias))
        if temperature != 1.0:
            z.div_(temperature)
        return z


def _grad_logits(z: Tensor, buf: Tensor, lse: Tensor, ids: Tensor, g: Tensor, g_ent: Tensor | None,
                 ent: Tensor | None, temperature: float) -> Tensor:
    """∂L/∂(h Wᵀ + b) for one chunk, in place on z [r, V] (z = the scaled logits; buf: scratch)."""
    z.sub_(lse[:, None])  # log p
    if g_ent is None:
        grad = z.exp_().mul_(-g[:, None])  # −g p
    else:  # −p (g + g_ent (log p + H))
        p = torch.exp(z, out=buf[: z.shape[0]])
        grad = z.add_(ent[:, None]).mul_(g_ent[:, None]).add_(g[:, None]).mul_(p).neg_()
    grad.scatter_add_(1, ids[:, None], g[:, None].to(grad.dtype))  # + g onehot(y)
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


def _head_grads(grad: Tensor, h: Tensor, weight: Tensor, sl: slice, gh, gw, gb, product: Product | None) -> None:
    """Given ∂L/∂logits [r, V] of the rows ``sl``: write ∂L/∂h, accumulate ∂L/∂W and ∂L/∂b."""
    grad = grad.to(weight.dtype)
    if gh is not None and product is not None:
        gh[sl] = product(grad, weight.t(), None)  # [r, V] x [V, H] -> [r, H]
    elif gh is not None:
        torch.mm(grad, weight, out=gh[sl])  # [r, H]
    if gw is not None:
        if gw.dtype == weight.dtype and sl.start == 0:  # the first chunk writes: no zero-filled [V, H] buffer
            torch.mm(grad.t(), h, out=gw)  # [V, H]
        elif gw.dtype == weight.dtype:
            gw.addmm_(grad.t(), h)  # [V, H]
        else:  # low-precision head: matmul in its dtype, accumulate in float32
            gw.add_(grad.t() @ h)
    if gb is not None:
        gb.add_(grad.sum(0))


def _grad_buffers(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None):
    acc = _acc(weight)
    gh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
    gw = None
    if ctx.needs_input_grad[1]:  # written by the first chunk (zeros only when it is not overwritten)
        empty = hidden.shape[0] == 0 or acc != weight.dtype
        gw = torch.zeros_like(weight, dtype=acc) if empty else torch.empty_like(weight, dtype=acc)
    gb = torch.zeros_like(bias, dtype=acc) if bias is not None and ctx.needs_input_grad[2] else None
    return gh, gw, gb


def _cast_grads(gh, gw, gb, weight, bias):
    return gh, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype)


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, chunk_size, with_entropy, grad_fn, product):
        R = hidden.shape[0]
        f32 = dict(dtype=_acc(weight), device=hidden.device)
        logp, lse = torch.empty(R, **f32), torch.empty(R, **f32)
        ent = torch.empty(R, **f32) if with_entropy else None
        one_pass = grad_fn is not None and any(ctx.needs_input_grad[:3])
        if one_pass:
            g_all = torch.empty(R, **f32)
            gh, gw, gb = _grad_buffers(ctx, hidden, weight, bias)
        work = _Workspace(min(chunk_size, max(R, 1)), weight)
        for start in range(0, R, chunk_size):
            sl = slice(start, min(start + chunk_size, R))
            h, y = hidden[sl], ids[sl]
            z = work.scaled_logits(h, weight, bias, temperature, product)  # [r, V]
            top = z.amax(-1)  # [r]
            z.sub_(top[:, None])
            e = torch.exp(z, out=work.exp[: z.shape[0]])  # [r, V] unnormalised probabilities
            s = e.sum(-1)  # [r]
            log_s = s.log()
            lse[sl] = top + log_s
            logp[sl] = z.gather(1, y[:, None])[:, 0] - log_s
            if with_entropy:  # H = log s − Σ e z' / s (z is not needed after this)
                ent[sl] = log_s - z.mul_(e).sum(-1) / s
            if one_pass:
                g = grad_fn(logp[sl], start).to(f32["dtype"])  # [r] dLoss/dlogp of these rows
                g_all[sl] = g
                grad = e.mul_((-g / s)[:, None])  # −g p
                grad.scatter_add_(1, y[:, None], g[:, None])  # + g onehot(y)
                if temperature != 1.0:
                    grad.div_(temperature)
                _head_grads(grad, h, weight, sl, gh, gw, gb, product)
        ctx.temperature, ctx.chunk_size, ctx.product = temperature, chunk_size, product
        ctx.stash = (g_all, gh, gw, gb) if one_pass else None
        ctx.save_for_backward(hidden, weight, bias, ids, lse, ent)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        none = (None,) * 6
        if g_logp is None and g_ent is None:
            return (None, None, None) + none
        hidden, weight, bias, ids, lse, ent = ctx.saved_tensors
        stash, ctx.stash = ctx.stash, None
        if stash is not None and g_ent is None and g_logp is not None:
            g_all, gh, gw, gb = stash
            if torch.equal(g_logp.to(g_all.dtype), g_all):
                PATH_COUNTS["one_pass"] += 1
                return _cast_grads(gh, gw, gb, weight, bias) + none
        PATH_COUNTS["recompute"] += 1
        R, acc = hidden.shape[0], _acc(weight)
        g = torch.zeros(R, dtype=acc, device=hidden.device) if g_logp is None else g_logp.to(acc)
        gh, gw, gb = _grad_buffers(ctx, hidden, weight, bias)
        work = _Workspace(min(ctx.chunk_size, max(R, 1)), weight)
        for start in range(0, R, ctx.chunk_size):
            sl = slice(start, min(start + ctx.chunk_size, R))
            h = hidden[sl]
            z = work.scaled_logits(h, weight, bias, ctx.temperature, ctx.product)
            grad = _grad_logits(z, work.exp, lse[sl], ids[sl], g[sl], None if g_ent is None else g_ent[sl].to(acc),
                                None if ent is None else ent[sl], ctx.temperature)
            _head_grads(grad, h, weight, sl, gh, gw, gb, ctx.product)
        return _cast_grads(gh, gw, gb, weight, bias) + none


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    grad_fn: Callable[[Tensor, int], Tensor] | None = None,
    product: Product | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs ``[R]`` (and entropies ``[R]`` or None) of ``ids`` ``[R]`` under the linear head
    applied to ``hidden`` ``[R, H]``; differentiable in hidden, weight and bias.

    ``grad_fn(logp_chunk [r], start) -> dLoss/dlogp [r]`` enables the one-pass backward (see the
    module docstring); it must depend only on the rows it is given.

    ``product(x, w, b) -> x wᵀ + b`` (None: torch's matmul): the kernel for the logits (w = W) and for
    ∂L/∂h (w = Wᵀ, a transposed view), in the weight's dtype; the weight gradient stays torch's.
    """
    return _LinearLogprobs.apply(hidden, weight, bias, ids, temperature, chunk_size, with_entropy, grad_fn,
                                 product)
