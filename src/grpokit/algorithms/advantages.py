"""Group-relative advantages: the critic-free baseline of GRPO.

For the G answers to one prompt with rewards r_1..r_G,

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)

and every token of answer i later gets A_i (see ``objectives.policy_loss``).

Choices, each one argument (defaults in brackets):

- ``scale_rewards``: ``"group"`` [default] divides by the group's std
  (DeepSeekMath); ``"batch"`` keeps the per-group mean but divides by the std of
  all rewards in the batch (more robust for small G); ``"none"`` does not divide
  at all (Dr. GRPO, which argues the division biases towards easy/hard prompts).
- ``std``: ``"population"`` [default] (ddof=0), as in the usual worked table
  (0.8 0.3 0.6 0.3 -> +1.41 -0.94 +0.47 -0.94); ``"sample"`` (Bessel, ddof=1), as
  TRL's ``nanstd``.

``estimator`` picks the baseline (a small function from ``ESTIMATORS``):

- ``"grpo"`` [default]: the group mean, then ``scale_rewards`` as above.
- ``"rloo"``: the leave-one-out baseline (Ahmadian et al. 2024, TRL's RLOOTrainer):
  A_i = r_i - mean_{j != i}(r_j) = G/(G-1) * (r_i - mean(r)), not divided by any std
  (rewards 1 0 0 1 -> +2/3 -2/3 -2/3 +2/3). Unbiased: r_i's baseline does not use r_i.
- ``"reinforce_pp"``: REINFORCE++-baseline (Hu et al. 2025): subtract the group mean,
  then divide by the std of those group-centred rewards over the whole batch. Unlike
  ``scale_rewards="batch"`` (std of the *raw* rewards, which includes how much the
  prompts' means differ), only the within-group spread sets the scale. The batch mean
  of group-centred rewards is 0 by construction, so no second mean is subtracted.
  OpenRLHF whitens over tokens (each answer weighted by its length); this is over
  answers. ``std`` picks the ddof of that batch std.

``scale_rewards`` belongs to the ``"grpo"`` estimator: the others reject anything
but its default (``"group"``), which they ignore.

Deviations from the paper's bare formula, all of which TRL also makes:

- ``eps`` (1e-4) in the denominator, so a near-constant group does not explode.
- A group whose valid rewards are all equal gets A = 0 *exactly* (we force it,
  rather than relying on ``0 / (0 + eps)``: a float mean of equal values can be
  off by one ulp, which would give a tiny non-zero advantage).
- NaN rewards (every reward function returned None) are left out of the group's
  mean and std and get A = 0; a group with a single valid reward gets A = 0.

Several reward functions are summed (with their weights) before any of this. The other way,
``decoupled_advantages`` (GDPO, ``rewards.aggregation = "normalize_then_sum"``), normalizes each
function within its group first, sums, then normalizes the sum over the batch.

Pure torch; never modifies its input.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ESTIMATORS", "decoupled_advantages", "group_advantages"]


_STD_DDOF = {"population": 0, "sample": 1}


def _masked_std(values: Tensor, valid: Tensor, ddof: int, dim: int | None) -> Tensor:
    """Std over the ``valid`` entries along ``dim`` (all dims if None); 0 when too few values."""
    dims = tuple(range(values.dim())) if dim is None else (dim,)
    count = valid.sum(dim=dims, keepdim=True)
    mean = torch.where(valid, values, 0.0).sum(dim=dims, keepdim=True) / count.clamp(min=1)
    sq_dev = torch.where(valid, (values - mean) ** 2, 0.0)
    var = sq_dev.sum(dim=dims, keepdim=True) / (count - ddof).clamp(min=1)
    return torch.where(count > ddof, var.sqrt(), 0.0)


def _group_std(grouped: Tensor, valid: Tensor, ddof: int, eps: float) -> Tensor:
    return _masked_std(grouped, valid, ddof, dim=1) + eps  # [B, 1]


def _batch_std(grouped: Tensor, valid: Tensor, ddof: int, eps: float) -> Tensor:
    # Std of all rewards around the batch mean (not around each group's mean), as TRL.
    return _masked_std(grouped, valid, ddof, dim=None) + eps  # [1, 1]


def _no_scale(grouped: Tensor, valid: Tensor, ddof: int, eps: float) -> Tensor:
    return torch.ones((), dtype=grouped.dtype, device=grouped.device)


_SCALERS = {"group": _group_std, "batch": _batch_std, "none": _no_scale}


def _group_mean(grouped: Tensor, valid: Tensor) -> Tensor:
    count = valid.sum(dim=1, keepdim=True)  # [B, 1]
    return torch.where(valid, grouped, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)  # [B, 1]


def _grpo(grouped: Tensor, valid: Tensor, scale_rewards: str, ddof: int, eps: float) -> Tensor:
    scale = _SCALERS[scale_rewards](grouped, valid, ddof, eps)  # [B, 1], [1, 1] or []
    return (grouped - _group_mean(grouped, valid)) / scale  # [B, G]


def _rloo(grouped: Tensor, valid: Tensor, scale_rewards: str, ddof: int, eps: float) -> Tensor:
    count = valid.sum(dim=1, keepdim=True)  # [B, 1]
    total = torch.where(valid, grouped, 0.0).sum(dim=1, keepdim=True)  # [B, 1]
    baseline = (total - grouped) / (count - 1).clamp(min=1)  # [B, G] mean of the other valid rewards
    return grouped - baseline  # [B, G]


def _reinforce_pp(grouped: Tensor, valid: Tensor, scale_rewards: str, ddof: int, eps: float) -> Tensor:
    centred = torch.where(valid, grouped - _group_mean(grouped, valid), 0.0)  # [B, G]
    return centred / (_masked_std(centred, valid, ddof, dim=None) + eps)  # [B, G]


# estimator -> (grouped rewards [B, G], valid [B, G], scale_rewards, ddof, eps) -> advantages [B, G]
ESTIMATORS = {"grpo": _grpo, "rloo": _rloo, "reinforce_pp": _reinforce_pp}


def _varies(grouped: Tensor, valid: Tensor) -> Tensor:
    """The valid entries of groups (dim 1) holding at least two different valid values; same shape."""
    lo = torch.where(valid, grouped, float("inf")).amin(dim=1, keepdim=True)  # [B, 1, ...]
    hi = torch.where(valid, grouped, float("-inf")).amax(dim=1, keepdim=True)  # [B, 1, ...]
    return valid & (hi > lo)


def _check_groups(n: int, group_size: int, std: str) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if n % group_size != 0:
        raise ValueError(
            f"the number of rewards ({n}) is not divisible by group_size ({group_size}): "
            "rewards must hold whole groups, laid out group by group"
        )
    if std not in _STD_DDOF:
        raise ValueError(f"std must be one of {sorted(_STD_DDOF)}, got {std!r}")


def _check(rewards: Tensor, group_size: int, scale_rewards: str, std: str, estimator: str) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [N] (N = B*G, group by group), got {tuple(rewards.shape)}")
    _check_groups(rewards.numel(), group_size, std)
    if scale_rewards not in _SCALERS:
        raise ValueError(f"scale_rewards must be one of {sorted(_SCALERS)}, got {scale_rewards!r}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {sorted(ESTIMATORS)}, got {estimator!r}")
    if estimator != "grpo" and scale_rewards != "group":
        raise ValueError(f"scale_rewards={scale_rewards!r} applies to the 'grpo' estimator only; "
                         f"{estimator!r} sets its own scale (leave scale_rewards at 'group')")


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    scale_rewards: str = "group",
    std: str = "population",
    eps: float = 1e-4,
    estimator: str = "grpo",
) -> Tensor:
    """Turn rewards ``[N]`` (laid out group by group, N = B*G) into advantages ``[N]``.

    Returns floating advantages: same dtype as ``rewards`` if floating, else float32. Computed in float64:
    the squared deviations of float32 rewards past about 1e19 overflow to inf, and the std with them, which
    would turn every advantage into a silent 0 (the ratio itself does not depend on the rewards' scale).
    """
    _check(rewards, group_size, scale_rewards, std, estimator)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    grouped = rewards.detach().to(torch.float64).reshape(-1, group_size)  # [B, G]
    valid = ~torch.isnan(grouped)  # [B, G]
    adv = ESTIMATORS[estimator](grouped, valid, scale_rewards, _STD_DDOF[std], eps)  # [B, G]
    # All valid rewards equal (or a single one): no signal, exactly 0.
    return torch.where(_varies(grouped, valid), adv, 0.0).reshape(-1).to(dtype)  # [N]


def decoupled_advantages(
    per_fn: Tensor,
    weights: Tensor | list[float],
    group_size: int,
    *,
    std: str = "population",
    eps: float = 1e-4,
) -> Tensor:
    """GDPO: normalize each reward function within its group, sum, then normalize over the batch.

    For answers i (N = B*G, group by group), reward functions k with weights w_k and
    rewards r_ik (``per_fn`` [N, F], NaN where function k returned None for answer i):

        z_ik = (r_ik - mean_g(r_.k)) / (std_g(r_.k) + eps)    per group g, per function k
        s_i  = sum_k w_k z_ik
        A_i  = (s_i - mean(s)) / (std(s) + eps)               over the whole batch

    (GDPO, Liu et al. 2026, arXiv 2601.05242; TRL's ``multi_objective_aggregation =
    "normalize_then_sum"``, grpo_trainer.py ~2790.) Why: normalizing the weighted total lets a
    function with a wide spread in a group drown one with a narrow spread (the weights would have
    to match the functions' units, and those spreads change from group to group), and distinct
    combinations of rewards that reach the same total get the same advantage. Normalized one by
    one, each function counts by its weight alone, whatever its units; the batch step gives the
    sum a scale that does not grow with the number of functions.

    Choices (the same as ``group_advantages``'s, where TRL's differ only by rounding):

    - ``std``: ``"population"`` [default] (ddof=0) or ``"sample"`` (Bessel: TRL's ``nanstd``),
      for both the per-group and the batch std; ``eps`` in both denominators.
    - No signal, per function: a function whose valid rewards in a group are all equal (or
      fewer than two) contributes exactly 0 to every answer of that group (TRL: 0 up to a ulp
      divided by eps, or NaN that its nansum skips). A group where no function varies gets
      A = 0 exactly (TRL: the batch mean of s, which is 0 up to rounding): the trainer skips
      answers whose advantage is exactly 0 (``train.skip_zero_advantage``). Equal totals do
      not mean no signal here: r_.1 = 2, 0, 1 and r_.2 = 0, 1, 0.5 with weights 1, 2 total
      2, 2, 2, yet A = -1.22, +1.22, 0 (dynamic sampling, which reads the total, drops it).
    - NaN: r_ik = NaN is left out of function k's group mean and std and adds 0 to s_i (TRL's
      nansum); an answer that every function left NaN is unscorable: it is left out of the
      batch mean and std and gets A = 0.

    With one function, z has batch mean 0 and A = sign(w) * z / (std(z) + eps / |w|): GRPO's
    advantage (``group_advantages`` with ``scale_rewards="group"``) times one positive factor
    for the whole batch, about 1 / sqrt(share of answers in groups with signal); the weight's
    size cancels, its sign stays.

    The batch is what the caller passes (in training, this process's share of the step).
    Returns floating advantages [N]: ``per_fn``'s dtype if floating, else float32 (computed in float64, as
    ``group_advantages``).
    """
    if per_fn.dim() != 2 or per_fn.shape[1] < 1:
        raise ValueError(f"per_fn must have shape [N, F] (N = B*G, F >= 1 functions), got {tuple(per_fn.shape)}")
    _check_groups(per_fn.shape[0], group_size, std)
    dtype = per_fn.dtype if per_fn.is_floating_point() else torch.float32
    w = torch.as_tensor(weights, dtype=torch.float64, device=per_fn.device)  # [F]
    if w.shape != (per_fn.shape[1],):
        raise ValueError(f"weights must have shape [F] = [{per_fn.shape[1]}] (one per function), got {tuple(w.shape)}")
    ddof = _STD_DDOF[std]
    grouped = per_fn.detach().to(torch.float64).reshape(-1, group_size, per_fn.shape[1])  # [B, G, F]
    valid = ~torch.isnan(grouped)  # [B, G, F]
    z = (grouped - _group_mean(grouped, valid)) / (_masked_std(grouped, valid, ddof, dim=1) + eps)  # [B, G, F]
    signal = _varies(grouped, valid)  # [B, G, F]
    summed = (torch.where(signal, z, 0.0) * w).sum(dim=2)  # [B, G]
    scorable = valid.any(dim=2)  # [B, G]
    mean = torch.where(scorable, summed, 0.0).sum() / scorable.sum().clamp(min=1)  # []
    adv = (summed - mean) / (_masked_std(summed, scorable, ddof, dim=None) + eps)  # [B, G]
    informative = scorable & signal.flatten(1).any(dim=1, keepdim=True)  # [B, G]
    return torch.where(informative, adv, 0.0).reshape(-1).to(dtype)  # [N]
