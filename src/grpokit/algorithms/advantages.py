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

Pure torch; never modifies its input.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ESTIMATORS", "group_advantages"]


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


def _check(rewards: Tensor, group_size: int, scale_rewards: str, std: str, estimator: str) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [N] (N = B*G, group by group), got {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"the number of rewards ({rewards.numel()}) is not divisible by group_size ({group_size}): "
            "rewards must hold whole groups, laid out group by group"
        )
    if scale_rewards not in _SCALERS:
        raise ValueError(f"scale_rewards must be one of {sorted(_SCALERS)}, got {scale_rewards!r}")
    if std not in _STD_DDOF:
        raise ValueError(f"std must be one of {sorted(_STD_DDOF)}, got {std!r}")
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

    Returns floating advantages: same dtype as ``rewards`` if floating, else float32.
    """
    _check(rewards, group_size, scale_rewards, std, estimator)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    grouped = rewards.detach().to(dtype).reshape(-1, group_size)  # [B, G]
    valid = ~torch.isnan(grouped)  # [B, G]
    adv = ESTIMATORS[estimator](grouped, valid, scale_rewards, _STD_DDOF[std], eps)  # [B, G]
    # All valid rewards equal (or a single one): no signal, exactly 0.
    lo = torch.where(valid, grouped, float("inf")).amin(dim=1, keepdim=True)  # [B, 1]
    hi = torch.where(valid, grouped, float("-inf")).amax(dim=1, keepdim=True)  # [B, 1]
    informative = valid & (hi > lo)  # [B, G]
    return torch.where(informative, adv, 0.0).reshape(-1)  # [N]
