"""Drawing one token per row from logits: top-k / top-p filtering and two exact samplers."""

from __future__ import annotations

import torch
from torch import Tensor


def filter_candidates(z: Tensor, top_k: int, top_p: float) -> tuple[Tensor, Tensor]:
    """Top-k then top-p (nucleus) filtering, as in HF's warpers.

    Returns the candidates' logits sorted descending, -inf where filtered out,
    [n, C], and their vocabulary ids [n, C]. Top-p keeps the smallest prefix
    whose probability (renormalised after top-k) reaches ``top_p``; the most
    likely token always survives.
    """
    if 0 < top_k < z.shape[-1]:
        vals, idx = z.topk(top_k, dim=-1)  # [n, k], sorted descending
    else:
        vals, idx = z.sort(dim=-1, descending=True)  # [n, V]
    if top_p < 1.0:
        probs = vals.softmax(-1)  # [n, C]
        mass_before = probs.cumsum(-1) - probs  # [n, C]
        vals = vals.masked_fill(mass_before >= top_p, float("-inf"))
    return vals, idx


def exponential_race(weights: Tensor, generator: torch.Generator | None) -> Tensor:
    """Index of ``argmax(weights / E)``, E ~ Exponential(1): a sample ∝ weights [n, C] → [n].

    This is the Gumbel-max trick in the probability domain; weights need not be
    normalised, and zero weights are never chosen.
    """
    u = torch.rand(weights.shape, generator=generator, device=weights.device)  # [n, C]
    return (weights / u.log_().neg_()).argmax(-1)  # [n]


_BLOCK = 256  # vocabulary entries per block of the two-level inverse-CDF sampler


def _first_above(cdf: Tensor, target: Tensor, weights: Tensor) -> Tensor:
    """First index whose cdf [n, C] exceeds target [n], never an index of zero weight [n, C]."""
    idx = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]  # [n]
    cols = torch.arange(weights.shape[1], device=weights.device)
    last_positive = torch.where(weights > 0, cols, -1).amax(-1)  # rounding may overshoot the last bin
    return torch.minimum(idx, last_positive)


def inverse_cdf_sample(weights: Tensor, generator: torch.Generator | None) -> Tensor:
    """Index of a sample ∝ weights [n, V] (non-negative, some positive per row) → [n].

    One uniform per row, located by inverse CDF in two levels: among the sums of blocks of
    ``_BLOCK`` entries, then inside the chosen block. The full-vocabulary work is one read of
    ``weights``; the cumulative sums are over [n, V / _BLOCK] and [n, _BLOCK] only, in float64.
    """
    n, V = weights.shape
    u = torch.rand(n, generator=generator, device=weights.device, dtype=torch.float64)  # [n]
    if V <= 2 * _BLOCK:
        w = weights.double()
        cdf = w.cumsum(-1)  # [n, V]
        return _first_above(cdf, u * cdf[:, -1], w)
    full = V // _BLOCK * _BLOCK
    sums = weights[:, :full].reshape(n, full // _BLOCK, _BLOCK).sum(-1)  # [n, nb] (a view: no copy)
    if full < V:
        sums = torch.cat([sums, weights[:, full:].sum(-1, keepdim=True)], dim=1)  # the tail block
    sums = sums.double()
    cdf = sums.cumsum(-1)  # [n, nb]
    target = u * cdf[:, -1]  # [n]
    block = _first_above(cdf, target, sums)  # [n]
    before = (cdf.gather(1, block[:, None]) - sums.gather(1, block[:, None]))[:, 0]  # mass of earlier blocks
    cols = block[:, None] * _BLOCK + torch.arange(_BLOCK, device=weights.device)  # [n, _BLOCK]
    inner = weights.gather(1, cols.clamp(max=V - 1)).double().masked_fill_(cols >= V, 0.0)  # [n, _BLOCK]
    return block * _BLOCK + _first_above(inner.cumsum(-1), (target - before).clamp_(min=0.0), inner)


# rollout.sampler: exact draws from unnormalised weights [n, V] (config/variants.py lists the names)
SAMPLERS = {"inverse_cdf": inverse_cdf_sample, "gumbel": exponential_race}


def sample_tokens(
    logits: Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
    generator: torch.Generator | None = None, sampler: str = "inverse_cdf", suppress: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample one token per row from logits [n, V]; return ids [n] and their log-probs [n].

    Unfiltered sampling draws with `sampler` (`rollout.sampler`): "inverse_cdf" (two-level, by
    blocks) or "gumbel" (the exponential race over the whole vocabulary); both are exact.

    The log-prob is under the unfiltered ``softmax(logits / temperature)``
    (``softmax(logits)`` when greedy), in float32. Greedy ignores top-k / top-p.

    `suppress` [S]: token ids that are never drawn (a vision-language model's image placeholders, as TRL's
    `suppress_tokens`); like top-k / top-p filtering it changes what is drawn, not the reported log-prob,
    which stays that of the unmasked distribution the trainer recomputes.
    """
    z = logits.float()  # [n, V]
    if temperature == 0:
        tokens = (z if suppress is None else z.index_fill(1, suppress, float("-inf"))).argmax(-1)  # [n]
        return tokens, z.gather(1, tokens[:, None])[:, 0] - z.logsumexp(-1)
    if temperature != 1.0:
        z = z / temperature
    if top_k == 0 and top_p >= 1.0:
        top = z.amax(-1, keepdim=True)  # [n, 1]
        weights = (z - top).exp_()  # [n, V] unnormalised probabilities
        log_norm = top[:, 0] + weights.sum(-1).log()  # [n]
        if suppress is not None:
            weights.index_fill_(1, suppress, 0.0)
        tokens = SAMPLERS[sampler](weights, generator)  # [n]
    else:
        allowed = z if suppress is None else z.index_fill(1, suppress, float("-inf"))  # [n, V]
        vals, idx = filter_candidates(allowed, top_k, top_p)  # [n, C]
        pick = exponential_race((vals - vals[:, :1]).exp_(), generator)  # [n]
        tokens = idx.gather(1, pick[:, None])[:, 0]  # [n]
        log_norm = z.logsumexp(-1)  # [n]
    return tokens, z.gather(1, tokens[:, None])[:, 0] - log_norm
