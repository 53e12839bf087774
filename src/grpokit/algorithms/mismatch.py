"""Correction for a sampler whose log-probs are not the trainer's (vLLM's kernels, another dtype, an
engine sampling at other settings): importance weights between the two, truncated or masked.

With r_t = exp(trainer_logp_t - sampler_logp_t), the trainer's log-probs taken before the update:

    token_truncate     w_t = clip(r_t, C_min, C_max)                       (TIS, [N, T])
    token_mask         w_t = r_t if C_min <= r_t <= C_max else 0           (MIS, [N, T])
    sequence_truncate  w_i = clip(prod_t r_t, C_min, C_max)                ([N, 1])
    sequence_mask      w_i = prod_t r_t if C_min <= prod_t r_t <= C_max else 0

Each answer's policy term is then weighted by w (objectives.policy_loss, `token_weights`). A bound
of None is no bound on that side. The sequence ratio is the product over the answer's tokens (a sum
of log-ratios, not GSPO's mean), as TRL 1.16's `vllm_importance_sampling_mode`; a token whose
sampler log-prob is NaN (unscored) counts as ratio 1.

Pure torch; the weights carry no gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_correction(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor, mode: str, *,
                          cap_max: float | None = None, cap_min: float | None = None
                          ) -> tuple[Tensor, dict[str, float]]:
    """The weights ([N, T] for token modes, [N, 1] for sequence modes; 1 on padding) and statistics:
    the sampler-trainer log-prob gap (mean / max over tokens), the weights' min / mean / max (over
    valid tokens, or over answers), and the share of tokens or answers truncated or masked.

    trainer_logp, sampler_logp, mask: [N, T] (the shortest width of the three is used)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if cap_max is None and cap_min is None:
        raise ValueError(f"mode {mode!r} needs a bound: cap_max or cap_min")
    if cap_max is not None and cap_min is not None and cap_min >= cap_max:
        raise ValueError(f"cap_min ({cap_min}) must be below cap_max ({cap_max})")
    T = min(trainer_logp.shape[1], sampler_logp.shape[1], mask.shape[1])
    valid = mask[:, :T] != 0  # [N, T]
    gap = torch.where(valid, trainer_logp[:, :T].detach().double() - sampler_logp[:, :T].double(), 0.0)
    gap = torch.nan_to_num(gap, nan=0.0)  # [N, T]
    sequence = mode.startswith("sequence")
    log_ratio = gap.sum(-1, keepdim=True) if sequence else gap  # [N, 1] | [N, T]
    ratio = log_ratio.exp()
    low = -math.inf if cap_min is None else cap_min
    high = math.inf if cap_max is None else cap_max
    outside = (ratio < low) | (ratio > high)
    weights = ratio.clamp(cap_min, cap_max) if mode.endswith("truncate") else ratio.masked_fill(outside, 0.0)
    counted = torch.ones_like(log_ratio, dtype=torch.bool) if sequence else valid  # answers | valid tokens
    n = counted.sum().clamp(min=1)
    kept = weights[counted]
    tokens = valid.sum().clamp(min=1)
    stats = {
        "sampling/logprob_gap_mean": float(gap.abs().sum() / tokens),
        "sampling/logprob_gap_max": float(gap.abs().max()) if valid.any() else 0.0,
        "sampling/is_ratio_mean": float(kept.sum() / n) if kept.numel() else 0.0,
        "sampling/is_ratio_min": float(kept.min()) if kept.numel() else 0.0,
        "sampling/is_ratio_max": float(kept.max()) if kept.numel() else 0.0,
        ("sampling/is_masked_share" if mode.endswith("mask") else "sampling/is_truncated_share"):
            float((outside & counted).sum() / n),
    }
    weights = torch.where(valid, weights, 1.0) if not sequence else weights  # padding: weight 1
    return weights.to(trainer_logp.dtype), stats


def truncated_importance_weights(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float
                                 ) -> tuple[Tensor, dict[str, float]]:
    """The earlier name of token-level truncation: min(exp(trainer - sampler), cap) [N, T] (1 on padding)."""
    if cap <= 0:
        raise ValueError(f"tis cap must be > 0, got {cap}")
    return importance_correction(trainer_logp, sampler_logp, mask, "token_truncate", cap_max=cap)
