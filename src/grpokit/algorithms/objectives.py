"""The GRPO policy loss (and its variants), and truncated importance weights.

Objective, per completion token t of answer i (N answers, T tokens, mask m):

    rho_t  = pi_theta(y_t | x, y_<t) / pi_old(y_t | x, y_<t) = exp(logp_t - old_logp_t)
    loss_t = -min(rho_t * A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_i)
             + beta * KL_t,   KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   (k3)

and the scalar loss aggregates loss_t over the mask (``loss_type``):

    grpo     mean over each answer's tokens, then mean over answers (DeepSeekMath)
    bnpo     sum over the micro-batch's tokens / its token count
    dr_grpo  sum / (N * max_completion_length)                       (Dr. GRPO)
    dapo     sum / num_items_in_batch, the token count of the whole generation
             batch, so gradient accumulation does not change the scale (DAPO)
    cispo    loss_t = -sg(min(rho_t, 1 + eps_high)) * A_i * logp_t, aggregated as
             dapo (MiniMax-M1 CISPO: clip the importance weight, never drop a
             token's gradient)

Options beside the loss type, each off by default:

- ``kl_bias_correction``: KL_t is multiplied by the (differentiable) ratio rho_t (GSPO: the
  sequence ratio), so that its gradient is the unbiased gradient of the reverse KL
  (DeepSeek-V3.2); exactly TRL 1.16's ``use_bias_correction_kl`` (TRL's default is on,
  grpokit's off). It changes the gradient even on-policy, where rho_t = 1 in value.
- ``top_entropy_quantile`` q < 1: the policy term (not the KL) is kept only on the tokens
  whose entropy is at least the (1 - q) quantile of the entropies of the valid tokens in
  this call (Wang et al. 2025, "Beyond the 80/20 rule"; TRL's ``get_high_entropy_mask``).
  The normalisers stay those of the full mask, as in TRL. The quantile is over the tokens
  passed in: the trainer passes one micro-batch (the whole minibatch unless
  ``train.micro_batch_size`` is set), as TRL does per device.
- ``entropy_coef`` c > 0: an entropy bonus, loss_t -= c * H_t on the tokens the policy
  term acts on, aggregated with the loss type's own aggregation (so for dapo/bnpo it is
  c times the mean token entropy). TRL instead always takes a plain token mean of H; the
  two agree for bnpo, and for dapo when ``num_items_in_batch`` is this call's token count.

``importance_sampling_level="sequence"`` is GSPO: one ratio per answer,
exp(mean_t(logp_t - old_logp_t)) (length-normalised), shape [N, 1], broadcast
over the answer's tokens, with gradient through every token of the mean. This is
exactly TRL 1.16's implementation.

Deviations from the papers (all but the CISPO one shared with TRL 1.16):

- The KL term is added to the loss per token (DeepSeekMath's choice), not
  subtracted from the reward, and uses k3; TRL's ``use_bias_correction_kl`` (KL_t * rho_t,
  on by default there) is ``kl_bias_correction``, off by default here.
- grpo averages over answers including those with no completion token (they
  contribute 0), as TRL does.
- CISPO's cap is ``1 + eps_high`` (the MiniMax-M1 paper's clip(r, ., 1 + eps_high),
  consistent with what eps_high means for every other loss type here). TRL 1.16
  instead caps at ``epsilon_high`` itself (ScaleRL's eps_max, recommended 5.0):
  TRL's epsilon_high = e is our epsilon_high = e - 1. Like TRL, no lower cap.
- Clip metrics use the sequence ratio broadcast over tokens for GSPO, so they
  are token means everywhere (TRL takes a mean over sequences in that case).
- Padding positions never reach the loss: log-ratios and the KL argument are
  zeroed there before ``exp``, and the per-token loss is selected by the mask
  (``where``), so a sentinel or -inf at padding cannot produce NaN.

Pure torch; no function modifies its inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _token_log_ratio(log_ratio: Tensor, maskf: Tensor) -> Tensor:
    return log_ratio  # [N, T]


def _sequence_log_ratio(log_ratio: Tensor, maskf: Tensor) -> Tensor:
    # GSPO: length-normalised, i.e. the log of the geometric mean of token ratios.
    return (log_ratio * maskf).sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp(min=1.0)  # [N, 1]


IMPORTANCE_SAMPLING_LEVELS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}


def importance_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, *, level: str = "token") -> Tensor:
    """log rho: ``[N, T]`` per token (level="token") or ``[N, 1]`` per answer (level="sequence", GSPO)."""
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {sorted(IMPORTANCE_SAMPLING_LEVELS)}, got {level!r}"
        )
    valid = mask != 0  # [N, T]
    log_ratio = torch.where(valid, logp - old_logp, 0.0)  # [N, T]
    return IMPORTANCE_SAMPLING_LEVELS[level](log_ratio, valid.to(log_ratio.dtype))


def sequence_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """pi_theta(y|x) / pi_old(y|x) ``[N]``: the product of the masked token ratios."""
    log_ratio = torch.where(mask != 0, logp - old_logp, 0.0)  # [N, T]
    return log_ratio.sum(-1).exp()  # [N]


def _clipped_surrogate(ratio: Tensor, adv: Tensor, logp: Tensor, eps_low: float, eps_high: float) -> Tensor:
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # [N, T] or [N, 1]
    return -torch.min(ratio * adv, clipped * adv)


def _cispo_surrogate(ratio: Tensor, adv: Tensor, logp: Tensor, eps_low: float, eps_high: float) -> Tensor:
    weight = ratio.clamp(max=1.0 + eps_high).detach()  # [N, T] or [N, 1]
    return -weight * adv * logp  # [N, T]


def _agg_grpo(loss: Tensor, maskf: Tensor, max_len: int | None, n_items) -> Tensor:
    per_answer = loss.sum(-1) / maskf.sum(-1).clamp(min=1.0)  # [N]
    return per_answer.mean()


def _agg_bnpo(loss: Tensor, maskf: Tensor, max_len: int | None, n_items) -> Tensor:
    return loss.sum() / maskf.sum().clamp(min=1.0)


def _agg_dr_grpo(loss: Tensor, maskf: Tensor, max_len: int | None, n_items) -> Tensor:
    if max_len is None or int(max_len) < 1:
        raise ValueError(f"loss_type='dr_grpo' needs max_completion_length (an integer >= 1), got {max_len!r}")
    return loss.sum() / (loss.shape[0] * max_len)


def _agg_dapo(loss: Tensor, maskf: Tensor, max_len: int | None, n_items) -> Tensor:
    total = maskf.sum() if n_items is None else torch.as_tensor(n_items, dtype=loss.dtype, device=loss.device)
    return loss.sum() / total.clamp(min=1.0)


# loss_type -> (per-token surrogate, aggregation of the masked per-token loss [N, T] to a scalar)
LOSS_TYPES: dict[str, tuple[Callable, Callable]] = {
    "grpo": (_clipped_surrogate, _agg_grpo),
    "bnpo": (_clipped_surrogate, _agg_bnpo),
    "dr_grpo": (_clipped_surrogate, _agg_dr_grpo),
    "dapo": (_clipped_surrogate, _agg_dapo),
    "cispo": (_cispo_surrogate, _agg_dapo),
}


def high_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """Boolean ``[N, T]``: valid tokens whose entropy is at least the ``(1 - quantile)`` quantile
    (linear interpolation, as ``torch.quantile``) of the valid tokens' entropies; ``quantile=0.2``
    keeps the top 20%, ``1.0`` keeps every valid token. No valid token: all False."""
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {quantile!r}")
    valid = mask != 0  # [N, T]
    ent = entropy.detach()
    values = ent[valid].to(torch.promote_types(ent.dtype, torch.float32)).sort().values  # [K] (TRL: float32)
    if values.numel() == 0:
        return torch.zeros_like(valid)
    # torch.quantile by hand: it refuses inputs above 2**24 elements, a long-context batch can have more
    pos = (1.0 - quantile) * (values.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, values.numel() - 1)
    threshold = torch.lerp(values[lo], values[hi], torch.tensor(pos - lo, dtype=values.dtype, device=values.device))
    return (torch.where(valid, ent, 0.0) >= threshold.to(ent.dtype)) & valid  # [N, T]


def _check_entropy_args(logp, entropy, entropy_coef, top_entropy_quantile) -> None:
    if entropy_coef < 0:
        raise ValueError(f"entropy_coef must be >= 0, got {entropy_coef!r}")
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile!r}")
    if (entropy_coef > 0 or top_entropy_quantile < 1.0) and entropy is None:
        raise ValueError("entropy_coef > 0 or top_entropy_quantile < 1 needs entropy (the per-token entropies, [N, T])")
    if entropy is not None and tuple(entropy.shape) != tuple(logp.shape):
        raise ValueError(f"entropy must have shape [N, T] = {tuple(logp.shape)} like logp, got {tuple(entropy.shape)}")


def _check_policy_args(logp, old_logp, advantages, mask, ref_logp, beta, loss_type) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must have shape [N, T], got {tuple(logp.shape)}")
    shape = tuple(logp.shape)
    for name, x in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp)):
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape [N, T] = {shape} like logp, got {tuple(x.shape)}")
    if tuple(advantages.shape) != shape[:1]:
        got = tuple(advantages.shape)
        raise ValueError(f"advantages must have shape [N] = {shape[:1]} (one per answer), got {got}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {sorted(LOSS_TYPES)}, got {loss_type!r}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    if beta > 0 and ref_logp is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logp (the reference model's token log-probs, [N, T])")


def _masked_mean(x: Tensor, maskf: Tensor) -> Tensor:
    return ((x * maskf).sum() / maskf.sum().clamp(min=1.0)).detach()


def _clip_stats(ratio: Tensor, adv: Tensor, maskf: Tensor, eps_low: float, eps_high: float) -> dict[str, Tensor]:
    ratio = ratio.detach().expand_as(maskf)  # [N, T] (GSPO's [N, 1] broadcast)
    low = (ratio < 1.0 - eps_low) & (adv < 0)  # [N, T]
    high = (ratio > 1.0 + eps_high) & (adv > 0)  # [N, T]
    return {
        "clip_ratio/low_mean": _masked_mean(low.to(maskf.dtype), maskf),
        "clip_ratio/high_mean": _masked_mean(high.to(maskf.dtype), maskf),
        "clip_ratio/region_mean": _masked_mean((low | high).to(maskf.dtype), maskf),
    }


def policy_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: int | Tensor | None = None,
    kl_bias_correction: bool = False,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    top_entropy_quantile: float = 1.0,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar policy loss and detached stats; see the module docstring for the math.

    logp, old_logp, ref_logp, mask, entropy: ``[N, T]``; advantages: ``[N]``. ``old_logp=None``
    means on-policy (``logp.detach()``: ratio 1, gradient still flows). ``entropy`` (with its
    gradient, for the bonus) is needed only when ``entropy_coef > 0`` or ``top_entropy_quantile < 1``.
    ``token_weights`` ``[N, T]`` (no gradient) multiply each token's policy term: truncated importance
    sampling for a sampler other than the trainer (``truncated_importance_weights`` below).
    """
    _check_policy_args(logp, old_logp, advantages, mask, ref_logp, beta, loss_type)
    _check_entropy_args(logp, entropy, entropy_coef, top_entropy_quantile)
    surrogate, aggregate = LOSS_TYPES[loss_type]
    eps_low, eps_high = epsilon, (epsilon if epsilon_high is None else epsilon_high)
    old_logp = logp.detach() if old_logp is None else old_logp
    valid = mask != 0  # [N, T]
    maskf = valid.to(logp.dtype)  # [N, T]
    adv = advantages.to(logp.dtype).unsqueeze(-1)  # [N, 1]

    ratio = importance_log_ratio(logp, old_logp, mask, level=importance_sampling_level).exp()  # [N, T] | [N, 1]
    per_token = surrogate(ratio, adv, logp, eps_low, eps_high).expand_as(logp)  # [N, T]
    if token_weights is not None:  # TIS: constant per-token weights of the policy term, before KL (as TRL)
        per_token = per_token * token_weights.detach().to(logp.dtype)
    stats = _clip_stats(ratio, adv, maskf, eps_low, eps_high)
    if top_entropy_quantile < 1.0:  # the policy term only on the high-entropy tokens
        acting = high_entropy_mask(entropy, mask, top_entropy_quantile).to(logp.dtype)  # [N, T]
        per_token = per_token * acting
    else:
        acting = maskf
    if entropy_coef > 0:
        per_token = per_token - entropy_coef * torch.where(valid, entropy, 0.0).to(logp.dtype) * acting
    if beta > 0:
        delta = torch.where(valid, ref_logp - logp, 0.0)  # [N, T]
        kl = delta.exp() - delta - 1.0  # [N, T], k3 >= 0
        if kl_bias_correction:  # DeepSeek-V3.2: KL_t * rho_t (rho not detached), as TRL
            kl = kl * ratio
        per_token = per_token + beta * kl
        stats["kl"] = _masked_mean(kl, maskf)
    per_token = torch.where(valid, per_token, 0.0)  # [N, T]
    loss = aggregate(per_token, maskf, max_completion_length, num_items_in_batch)
    return loss, stats


def truncated_importance_weights(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float
                                 ) -> tuple[Tensor, dict[str, float]]:
    """TIS weights `min(exp(trainer - sampler), cap)` [N, T] (1 on padding), and their statistics.

    trainer_logp, sampler_logp, mask: [N, T]. The weights are constants (no gradient)."""
    if cap <= 0:
        raise ValueError(f"tis cap must be > 0, got {cap}")
    valid = mask != 0  # [N, T]
    T = min(trainer_logp.shape[1], sampler_logp.shape[1], mask.shape[1])
    valid = valid[:, :T]
    gap = torch.where(valid, trainer_logp[:, :T].detach().float() - sampler_logp[:, :T].float(), 0.0)  # [N, T]
    raw = gap.exp()  # [N, T]
    weights = raw.clamp(max=cap)
    count = valid.sum().clamp(min=1)
    stats = {
        "sampling/logprob_gap_mean": float(gap.abs().sum() / count),
        "sampling/logprob_gap_max": float(gap.abs().max()) if valid.any() else 0.0,
        "sampling/tis_weight_mean": float((weights * valid).sum() / count),
        "sampling/tis_clipped_ratio": float(((raw > cap) & valid).sum() / count),
    }
    return weights, stats
