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
    cispo    loss_t = -sg(min(rho_t, eps_high)) * A_i * logp_t, aggregated as dapo
             (MiniMax-M1 CISPO: clip the importance weight, never drop a token's
             gradient; the cap is eps_high itself, TRL's and ScaleRL's eps_max)
    sapo     loss_t = -sigmoid(tau * (rho_t - 1)) * 4 / tau * A_i, tau = tau_pos if
             A_i > 0 else tau_neg, aggregated as grpo (SAPO: a smooth gate instead of
             the hard clip; its gradient at rho = 1 is the plain policy gradient's)
    luspo    the clipped loss_t, summed over each answer's tokens, then the mean over
             answers (LUSPO: with sequence ratios, GSPO scaled by each answer's length)
    vespo    loss_i = -sg(phi(w_i)) * A_i * logp_t, aggregated as dapo, with w_i the
             answer's sequence ratio prod_t rho_t and phi(w) = e^lam * w^k * e^(-lam * w)
             (VESPO: a smooth gamma-shaped gate, phi(1) = 1; (k, lam) by the sign of A_i)

Options beside the loss type, each off by default:

- ``delta`` (two-sided clipping, INTELLECT-2): the unclipped ratio is capped at delta in the
  clipped losses, min(min(rho, delta) A, clip(rho) A): a negative-advantage token whose ratio ran
  far above 1 no longer has an unbounded loss. TRL's ``delta``.
- ``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence masking): an answer with
  A < 0 whose mean token KL from the sampling policy, mean_t(sampling_logp_t - logp_t), exceeds the
  threshold is dropped from the policy term (not from the KL term). The sampling log-probs are the
  sampler's own when given, else the old ones. TRL's ``off_policy_mask_threshold``.

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
- ``entropy_coef`` c > 0: an entropy bonus on the tokens the policy term acts on, aggregated
  (``entropy_aggregation``) as ``"loss"``: loss_t -= c * H_t, then the loss type's own
  aggregation (for bnpo c times the mean token entropy, for luspo c times each answer's sum);
  or as ``"token_mean"``, TRL 1.16's for every loss type: loss -= c * mean(H) over this call's
  acting tokens, divided by ``entropy_parts`` (the calls one optimizer step adds up unscaled),
  so that the bonus is the mean of the micro-batches' token means whatever the policy normaliser.
  The loss without the bonus is then ``stats["policy_loss"]`` (TRL logs it as ``policy_loss``).

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
- CISPO's cap is ``eps_high`` itself, as TRL 1.16 (ScaleRL's eps_max, recommended 5.0),
  not the MiniMax-M1 paper's 1 + eps_high: a config moved from TRL means the same. (The
  config reads an ``epsilon_high`` below 1 the earlier way, as 1 + value: config/algorithm.py.)
  Like TRL, no lower cap.
- Clip metrics use the sequence ratio broadcast over tokens for GSPO, so they
  are token means everywhere (TRL takes a mean over sequences in that case).
- Padding positions never reach the loss: log-ratios and the KL argument are
  zeroed there before ``exp``, and the per-token loss is selected by the mask
  (``where``), so a sentinel or -inf at padding cannot produce NaN.

Pure torch; no function modifies its inputs. The names it implements (loss types, with the per-token term
and aggregation of each, importance-sampling levels, entropy aggregations) are the config's own, torch-free
lists (config/variants.py): each one is checked here on import to have exactly one implementation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpokit.config.variants import ENTROPY_AGGREGATIONS, LOSS_KINDS
from grpokit.config.variants import IMPORTANCE_SAMPLING_LEVELS as LEVEL_NAMES
from grpokit.errors import keywords_moved_into


def _one_each(names, impls: dict[str, Callable], what: str) -> dict[str, Callable]:
    """`impls` keyed by exactly `names` (config/variants.py's, which the config accepts), in their order."""
    if set(impls) != set(names):
        raise ImportError(f"algorithms/objectives.py implements the {what} {sorted(impls)}, but config/variants.py "
                          f"names {sorted(set(names))}: implement each name it lists, and only those")
    return {name: impls[name] for name in dict.fromkeys(names)}


def _token_log_ratio(log_ratio: Tensor, maskf: Tensor) -> Tensor:
    return log_ratio  # [N, T]


def _sequence_log_ratio(log_ratio: Tensor, maskf: Tensor) -> Tensor:
    # GSPO: length-normalised, i.e. the log of the geometric mean of token ratios.
    return (log_ratio * maskf).sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp(min=1.0)  # [N, 1]


IMPORTANCE_SAMPLING_LEVELS: dict[str, Callable[[Tensor, Tensor], Tensor]] = _one_each(
    LEVEL_NAMES, {"token": _token_log_ratio, "sequence": _sequence_log_ratio},
    "importance-sampling levels")


def importance_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, *, level: str = "token") -> Tensor:
    """log rho: ``[N, T]`` per token (level="token") or ``[N, 1]`` per answer (level="sequence", GSPO)."""
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        levels = sorted(IMPORTANCE_SAMPLING_LEVELS)
        raise ValueError(f"importance_sampling_level must be one of {levels}, got {level!r}")
    valid = mask != 0  # [N, T]
    log_ratio = torch.where(valid, logp - old_logp, 0.0)  # [N, T]
    return IMPORTANCE_SAMPLING_LEVELS[level](log_ratio, valid.to(log_ratio.dtype))


def sequence_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """pi_theta(y|x) / pi_old(y|x) ``[N]``: the product of the masked token ratios."""
    log_ratio = torch.where(mask != 0, logp - old_logp, 0.0)  # [N, T]
    return log_ratio.sum(-1).exp()  # [N]


@dataclass(frozen=True)
class LossSpec:
    """Everything about the loss that a run fixes once (from its `[algorithm]` config: training/update.py's
    `loss_spec`), apart from the tensors of each call; the defaults are plain DAPO with no options."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon; CISPO's cap itself
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None  # dr_grpo's normaliser
    kl_bias_correction: bool = False
    entropy_coef: float = 0.0  # the adaptive controller's steps replace it (dataclasses.replace)
    entropy_aggregation: str = "loss"
    top_entropy_quantile: float = 1.0
    delta: float | None = None  # two-sided clipping
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def _clipped_surrogate(ratio: Tensor, adv: Tensor, logp: Tensor, spec: LossSpec) -> Tensor:
    clipped = ratio.clamp(1.0 - spec.epsilon, 1.0 + spec.eps_high)  # [N, T] or [N, 1]
    if spec.delta is not None:  # two-sided clipping: the unclipped term's ratio is capped too
        ratio = ratio.clamp(max=spec.delta)
    return -torch.min(ratio * adv, clipped * adv)


def _cispo_surrogate(ratio: Tensor, adv: Tensor, logp: Tensor, spec: LossSpec) -> Tensor:
    weight = ratio.clamp(max=spec.eps_high).detach()  # [N, T] or [N, 1]
    return -weight * adv * logp  # [N, T]


def _sapo_surrogate(ratio: Tensor, adv: Tensor, logp: Tensor, spec: LossSpec) -> Tensor:
    tau = torch.where(adv > 0, ratio.new_tensor(spec.sapo_temperature_pos), ratio.new_tensor(spec.sapo_temperature_neg))
    return -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv  # tau [N, 1]; [N, T] or [N, 1]


def _vespo_surrogate(ratio: Tensor, adv: Tensor, logp: Tensor, spec: LossSpec) -> Tensor:
    return -adv * logp  # [N, T]; policy_loss multiplies by the sequence weight phi


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


def _agg_luspo(loss: Tensor, maskf: Tensor, max_len: int | None, n_items) -> Tensor:
    return loss.sum(-1).mean()  # each answer's sum over its tokens, mean over answers


# each loss type's two parts (config/variants.py LOSS_KINDS): the per-token term, and the aggregation of the
# masked per-token loss [N, T] to a scalar
SURROGATES = _one_each([kind.surrogate for kind in LOSS_KINDS.values()], {
    "clip": _clipped_surrogate, "cispo": _cispo_surrogate, "sapo": _sapo_surrogate, "vespo": _vespo_surrogate,
}, "per-token terms")
AGGREGATIONS = _one_each([kind.aggregation for kind in LOSS_KINDS.values()], {
    "grpo": _agg_grpo, "bnpo": _agg_bnpo, "dr_grpo": _agg_dr_grpo, "dapo": _agg_dapo, "luspo": _agg_luspo,
}, "aggregations")
# loss_type -> (per-token surrogate, aggregation)
LOSS_TYPES: dict[str, tuple[Callable, Callable]] = {
    name: (SURROGATES[kind.surrogate], AGGREGATIONS[kind.aggregation]) for name, kind in LOSS_KINDS.items()}


@torch.no_grad()
def vespo_weights(adv: Tensor, token_log_ratio: Tensor, maskf: Tensor, token_weights: Tensor | None = None, *,
                  k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0
                  ) -> Tensor:
    """VESPO's sequence weight phi(w) = e^lam * w^k * e^(-lam * w) ``[N, 1]`` (no gradient), in log space.

    w is the answer's whole ratio exp(sum_t log rho_t) (a sum, not GSPO's mean), times the product of the
    sampler-mismatch weights when given (``token_weights``: they are folded in here, not multiplied into
    the loss). Log-ratios are clamped to [-20, 20] and log w to [log 1e-8, 20], as the reference code."""
    floor = math.log(1e-8)
    log_w = (token_log_ratio.clamp(-20.0, 20.0) * maskf).sum(-1, keepdim=True)  # [N, 1]
    if token_weights is not None:
        log_w = log_w + (token_weights.log().clamp(floor, 20.0) * maskf).sum(-1, keepdim=True)
    log_w = log_w.clamp(floor, 20.0)
    nonneg = adv >= 0  # [N, 1]
    k = torch.where(nonneg, log_w.new_tensor(k_pos), log_w.new_tensor(k_neg))  # [N, 1]
    lam = torch.where(nonneg, log_w.new_tensor(lambda_pos), log_w.new_tensor(lambda_neg)).clamp(min=1e-4)
    return (lam + k * log_w - lam * log_w.exp()).exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # [N, 1]


def off_policy_mask(adv: Tensor, logp: Tensor, sampling_logp: Tensor, maskf: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask ``[N, 1]`` (1 keep, 0 drop): keep an answer when A >= 0 or
    its mean token KL from the sampling policy, mean_t(sampling_logp - logp), is at most `threshold`.
    A token whose sampling log-prob is NaN (unscored) counts as no evidence (0)."""
    kl = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)  # [N, T]
    mean_kl = (kl * maskf).sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp(min=1.0)  # [N, 1]
    return ((adv >= 0) | (mean_kl <= threshold)).to(maskf.dtype)  # [N, 1]


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


def mean_token_entropy(entropy: Tensor, acting: Tensor) -> Tensor:
    """TRL 1.16's entropy bonus before its coefficient: the plain mean of H over the acting tokens (``acting``
    [N, T], 0/1: the mask, or the high-entropy tokens), not rescaled by any loss type's normaliser, so
    that entropy_coef means the same for each. Padding never reaches the sum (its entropy may be NaN)."""
    return torch.where(acting != 0, entropy, 0.0).sum() / acting.sum().clamp(min=1.0)


def _check_entropy_args(logp, entropy, entropy_coef, top_entropy_quantile, aggregation, parts) -> None:
    if entropy_coef < 0:
        raise ValueError(f"entropy_coef must be >= 0, got {entropy_coef!r}")
    if aggregation not in ENTROPY_AGGREGATIONS or not parts >= 1:
        raise ValueError(f"entropy_aggregation must be one of {ENTROPY_AGGREGATIONS} and entropy_parts >= 1, got "
                         f"{aggregation!r} and {parts!r}")
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
    if tuple(advantages.shape) not in (shape[:1], shape):
        got = tuple(advantages.shape)
        raise ValueError(f"advantages must have shape [N] = {shape[:1]} (one per answer) or [N, T] = {shape} (one "
                         f"per token: per-turn credit), got {got}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {sorted(LOSS_TYPES)}, got {loss_type!r}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    if beta > 0 and ref_logp is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logp (the reference model's token log-probs, [N, T])")


def _masked_mean(x: Tensor, maskf: Tensor) -> Tensor:
    return ((x * maskf).sum() / maskf.sum().clamp(min=1.0)).detach()


def _clip_stats(ratio: Tensor, adv: Tensor, maskf: Tensor, spec: LossSpec) -> dict[str, Tensor]:
    ratio = ratio.detach().expand_as(maskf)  # [N, T] (GSPO's [N, 1] broadcast)
    if spec.loss_type == "cispo":  # the share of tokens whose weight the cap lowered (TRL's cispo_clip_ratio)
        return {"clip_ratio/high_mean": _masked_mean(((ratio > spec.eps_high) & (adv > 0)).to(maskf.dtype), maskf)}
    if not LOSS_KINDS[spec.loss_type].clipped:
        return {}
    low = (ratio < 1.0 - spec.epsilon) & (adv < 0)  # [N, T]
    high = (ratio > 1.0 + spec.eps_high) & (adv > 0)  # [N, T]
    return {
        "clip_ratio/low_mean": _masked_mean(low.to(maskf.dtype), maskf),
        "clip_ratio/high_mean": _masked_mean(high.to(maskf.dtype), maskf),
        "clip_ratio/region_mean": _masked_mean((low | high).to(maskf.dtype), maskf),
    }


@dataclass(frozen=True)
class Accumulation:
    """Where one `policy_loss` call stands in its optimizer step (gradient accumulation): the two normalisers
    that span the step's calls instead of one call. The defaults: the call is the whole step."""

    num_items_in_batch: int | Tensor | None = None  # dapo's token count of the whole minibatch (None: this call's)
    entropy_parts: int = 1  # the calls one optimizer step adds up unscaled: the token_mean entropy bonus's divisor


@keywords_moved_into("spec", LossSpec, "grpokit")  # policy_loss(..., loss_type="grpo"): the README's form
@keywords_moved_into("accumulation", Accumulation, "grpokit.algorithms")
def policy_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    spec: LossSpec = LossSpec(),
    *,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    token_weights: Tensor | None = None,
    sampling_logp: Tensor | None = None,
    accumulation: Accumulation = Accumulation(),
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar policy loss and detached stats: the module docstring's math, with the options `spec` fixes.

    logp, old_logp, ref_logp, mask, entropy, sampling_logp: ``[N, T]``; advantages: ``[N]``, or ``[N, T]``
    when each turn of a multi-turn answer has its own (``algorithm.turn_advantage``): every per-answer rule
    that reads the advantage's sign (SAPO's and VESPO's gates, the off-policy mask) then reads it per token.
    ``old_logp=None`` means on-policy (``logp.detach()``: ratio 1, gradient still flows). ``ref_logp`` is
    needed when ``spec.beta > 0``; ``entropy`` (with its gradient, for the bonus) only when
    ``spec.entropy_coef > 0`` or ``spec.top_entropy_quantile < 1``. ``token_weights`` ``[N, T]`` or ``[N, 1]``
    (no gradient) multiply each token's policy term: the correction for a sampler other than the trainer
    (``algorithms/mismatch.py``); vespo folds them into its sequence weight instead, as TRL.
    ``sampling_logp``: the sampler's log-probs for the off-policy mask (default: ``old_logp``).
    ``accumulation``: the call's place in its optimizer step (`Accumulation`): dapo's token count of the whole
    minibatch (``num_items_in_batch``, default: this call's) and the calls the step adds up unscaled
    (``entropy_parts``, the token_mean entropy bonus's divisor). The earlier keywords ``num_items_in_batch=`` and
    ``entropy_parts=`` still work, with a DeprecationWarning.
    """
    num_items_in_batch, entropy_parts = accumulation.num_items_in_batch, accumulation.entropy_parts
    _check_policy_args(logp, old_logp, advantages, mask, ref_logp, spec.beta, spec.loss_type)
    _check_entropy_args(logp, entropy, spec.entropy_coef, spec.top_entropy_quantile, spec.entropy_aggregation,
                        entropy_parts)
    surrogate, aggregate = LOSS_TYPES[spec.loss_type]
    old_logp = logp.detach() if old_logp is None else old_logp
    valid = mask != 0  # [N, T]
    maskf = valid.to(logp.dtype)  # [N, T]
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # [N, 1], or [N, T] per token (per-turn credit)

    ratio = importance_log_ratio(logp, old_logp, mask, level=spec.importance_sampling_level).exp()  # [N, T] | [N, 1]
    per_token = surrogate(ratio, adv, logp, spec).expand_as(logp)  # [N, T]
    stats = _clip_stats(ratio, adv, maskf, spec)
    if LOSS_KINDS[spec.loss_type].sequence_weight:  # VESPO's smooth sequence gate, the sampler correction folded in
        phi = vespo_weights(adv, torch.where(valid, logp - old_logp, 0.0), maskf, token_weights, k_pos=spec.vespo_k_pos,
                            lambda_pos=spec.vespo_lambda_pos, k_neg=spec.vespo_k_neg, lambda_neg=spec.vespo_lambda_neg)
        per_token = per_token * phi
        moving = adv.squeeze(-1) != 0  # answers the trainer may have skipped (zero advantage) hold no log-probs
        stats["vespo/phi_seq_mean"] = (phi[moving] if moving.any() else phi).mean().detach()
    elif token_weights is not None:  # constant per-answer or per-token weights of the policy term, before KL (TRL)
        per_token = per_token * token_weights.detach().to(logp.dtype)
    if spec.off_policy_mask_threshold is not None:
        sampled = old_logp if sampling_logp is None else sampling_logp
        keep = off_policy_mask(adv, logp, sampled, maskf, spec.off_policy_mask_threshold)  # [N, 1]
        per_token = per_token * keep
        stats["off_policy/masked_share"] = _masked_mean((1.0 - keep).expand_as(maskf), maskf)
    if spec.top_entropy_quantile < 1.0:  # the policy term only on the high-entropy tokens
        acting = high_entropy_mask(entropy, mask, spec.top_entropy_quantile).to(logp.dtype)  # [N, T]
        per_token = per_token * acting
    else:
        acting = maskf
    bonus = spec.entropy_coef * torch.where(valid, entropy, 0.0).to(logp.dtype) * acting \
        if spec.entropy_coef > 0 and spec.entropy_aggregation == "loss" else None  # [N, T]
    per_token = per_token if bonus is None else per_token - bonus
    if spec.beta > 0:
        log_ratio_ref = torch.where(valid, ref_logp - logp, 0.0)  # [N, T]
        kl = log_ratio_ref.exp() - log_ratio_ref - 1.0  # [N, T], k3 >= 0
        if spec.kl_bias_correction:  # DeepSeek-V3.2: KL_t * rho_t (rho not detached), as TRL
            kl = kl * ratio
        per_token = per_token + spec.beta * kl
        stats["kl"] = _masked_mean(kl, maskf)
    per_token = torch.where(valid, per_token, 0.0)  # [N, T]
    loss = aggregate(per_token, maskf, spec.max_completion_length, num_items_in_batch)
    if bonus is not None:  # policy_loss: the loss without its entropy bonus (TRL's logged policy_loss)
        stats["policy_loss"] = (loss + aggregate(bonus, maskf, spec.max_completion_length, num_items_in_batch)).detach()
    if spec.entropy_coef > 0 and spec.entropy_aggregation == "token_mean":  # TRL's: outside the normaliser
        stats["policy_loss"] = loss.detach()
        loss = loss - spec.entropy_coef * mean_token_entropy(entropy.to(logp.dtype), acting) / entropy_parts
    return loss, stats


def adapt_entropy_coef(coef: float, entropy: float, *, target: float, delta: float, low: float, high: float
                       ) -> float:
    """One step of the adaptive entropy coefficient (TRL's use_adaptive_entropy): up by `delta` while the
    measured token entropy is at or below `target`, down by `delta` above it, kept within [low, high]."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)
