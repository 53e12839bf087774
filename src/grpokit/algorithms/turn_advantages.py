"""Per-turn advantages for multi-turn answers: credit for the turn, not only for the conversation.

A multi-turn answer i has n_i assistant turns t = 0 .. n_i - 1. Besides its outcome reward R_i (the
reward functions' total) a turn may earn a step reward r_it (an environment's `get_turn_reward`, a
tool's `WithReward`; NaN where none was reported), and may start from an environment state s_it
(`get_state`; an integer id here, -1 where none). Both estimators return advantages per turn
[N, K] (K the most turns of any answer); `token_advantages` spreads them over each turn's tokens, so
the loss applies each turn's advantage to that turn's tokens only.

``"gigpo"`` (GiGPO, Feng et al. 2025, arXiv 2505.10978). The step reward sequence of an answer is its
turn rewards (none = 0) with the outcome added to its last turn's, as in the paper's environments
(the success reward arrives with the last step). Then

    episode return     R^E_i  = sum_t r_it                  (= R_i + the turn rewards)
    episode advantage  A^E_i  = group-relative R^E_i        (the run's estimator: mean, std or none)
    step return        R_it   = sum_{k >= t} gamma^(k - t) r_ik
    step groups        the turns of one prompt's G answers that start from the same state s
                       (at any turn index: the paper's anchor states)
    step advantage     A^S_it = (R_it - mean_S) / (std_S + eps)  over the turn's step group S
    advantage          A_it   = A^E_i + omega * A^S_it           (the paper: omega = 1, gamma = 0.95)

``"mt_grpo"`` (MT-GRPO, Zeng et al. 2025, arXiv 2505.11821). The turn rewards of turn index t are
normalised among the group's answers that reported one for their turn t; that turn advantage is
added to the answer's outcome advantage A^O_i (the run's own advantage, as computed without turns):

    A_it = A^O_i + lambda * (r_it - mean_{j: r_jt} r_jt) / (std + eps)     (the paper: lambda = 1)

A turn without a reported reward (the final answer turn, in the paper's two-turn setting) gets A^O_i.
The weight lambda is on the turn term, as in the authors' code (turn_advantage_coef).

Shared rules (as group_advantages): a step or turn group whose values are all equal, or that has a
single member, adds exactly 0 (a state only one answer reached says nothing relative); ``scale``
False divides by nothing (Dr. GRPO's choice, GiGPO's F_norm = 1); ``ddof`` 0 population, 1 sample
std; an answer whose outcome is NaN (unscored) gets no step or turn advantage.

Deviations: the papers define one trajectory per episode of an environment whose steps are
separate prompts; here a turn is a span of tokens in one sequence, which changes nothing in the
formulas. GiGPO groups identical states only (its similarity-based grouping is not built).

Pure torch; never modifies its inputs.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from grpokit.algorithms.advantages import group_advantages
from grpokit.errors import keywords_moved_into

__all__ = ["TURN_ADVANTAGES", "GroupNormalization", "discounted_returns", "gigpo_advantages", "mt_grpo_advantages",
           "normalize_within", "token_advantages"]


def normalize_within(values: Tensor, keys: Tensor, *, scale: bool = True, ddof: int = 0, eps: float = 1e-4
                     ) -> Tensor:
    """Each value minus the mean of its group, over the group's std (+ eps) when ``scale``; groups are
    the equal rows of ``keys`` ([M] or [M, k] integers). A group with one member, or whose values are all
    equal, gets exactly 0. values [M] -> [M]."""
    if values.numel() == 0:
        return values.clone()
    _, group = torch.unique(keys, dim=0, return_inverse=True)  # [M] group index of each value
    n = int(group.max()) + 1
    zeros = values.new_zeros(n)
    count = zeros.scatter_add(0, group, torch.ones_like(values))  # [n]
    mean = zeros.scatter_add(0, group, values) / count  # [n]
    dev = values - mean[group]  # [M]
    var = zeros.scatter_add(0, group, dev ** 2) / (count - ddof).clamp(min=1)  # [n]
    std = torch.where(count > ddof, var.sqrt(), 0.0)  # [n]
    lo = zeros.scatter_reduce(0, group, values, "amin", include_self=False)  # [n]
    hi = zeros.scatter_reduce(0, group, values, "amax", include_self=False)  # [n]
    adv = dev / (std[group] + eps) if scale else dev  # [M]
    return torch.where((hi > lo)[group], adv, 0.0)  # [M]: one member or all equal -> 0


def discounted_returns(rewards: Tensor, gamma: float) -> Tensor:
    """R_t = sum_{k >= t} gamma^(k - t) r_k along dim 1; rewards [N, K] with 0 past an answer's last turn."""
    returns = torch.zeros_like(rewards)  # [N, K]
    running = torch.zeros_like(rewards[:, 0])  # [N]
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns


def _turn_grid(turns: Tensor, K: int) -> Tensor:
    return torch.arange(K, device=turns.device)[None, :] < turns[:, None]  # [N, K] the turns that exist


def _check(outcome: Tensor, turn_rewards: Tensor, turns: Tensor, group_size: int) -> None:
    N = outcome.shape[0]
    if outcome.dim() != 1 or turn_rewards.dim() != 2 or turn_rewards.shape[0] != N or tuple(turns.shape) != (N,):
        raise ValueError(f"outcome must be [N], turn_rewards [N, K] and turns [N]; got {tuple(outcome.shape)}, "
                         f"{tuple(turn_rewards.shape)}, {tuple(turns.shape)}")
    if N % group_size:
        raise ValueError(f"{N} answers are not whole groups of {group_size}")
    if turns.numel() and (int(turns.min()) < 1 or int(turns.max()) > turn_rewards.shape[1]):
        raise ValueError(f"turns must be in [1, K = {turn_rewards.shape[1]}], got {turns.tolist()}")


@dataclasses.dataclass(frozen=True)
class GroupNormalization:
    """How a group's values become advantages: a run's `algorithm.scale_rewards`, `algorithm.std` and
    `algorithm.advantage_estimator`, as `group_advantages` takes them, and the `eps` added to a std. GiGPO's
    episode advantage uses all four; its step groups are centred on their mean and divided by their std (+ eps)
    unless `scale_rewards` is "none" (the estimator's baselines are for answers, not turns)."""

    scale_rewards: str = "group"
    std: str = "population"
    estimator: str = "grpo"
    eps: float = 1e-4


@keywords_moved_into("normalization", GroupNormalization, "grpokit.algorithms.turn_advantages")
def gigpo_advantages(outcome: Tensor, turn_rewards: Tensor, states: Tensor, turns: Tensor, group_size: int, *,
                     gamma: float = 0.95, omega: float = 1.0, normalization: GroupNormalization | None = None
                     ) -> Tensor:
    """GiGPO's advantage per turn [N, K] (module docstring). outcome [N] (NaN = unscored), turn_rewards
    [N, K] (NaN = none), states [N, K] integer ids (-1 = none: that turn joins no step group), turns [N].
    `normalization` (`GroupNormalization`, its defaults when None): the run's group-relative settings."""
    norm = normalization or GroupNormalization()
    scale_rewards, std, estimator, eps = norm.scale_rewards, norm.std, norm.estimator, norm.eps
    _check(outcome, turn_rewards, turns, group_size)
    if tuple(states.shape) != tuple(turn_rewards.shape):
        raise ValueError(f"states must be [N, K] = {tuple(turn_rewards.shape)}, got {tuple(states.shape)}")
    N, K = turn_rewards.shape
    exists = _turn_grid(turns, K)  # [N, K]
    step = torch.where(exists, torch.nan_to_num(turn_rewards.to(outcome.dtype), nan=0.0), 0.0)  # [N, K]
    last = torch.nn.functional.one_hot(turns - 1, K).to(step.dtype)  # [N, K]
    step = step + last * torch.nan_to_num(outcome, nan=0.0)[:, None]  # the outcome arrives with the last step
    episode = torch.where(torch.isnan(outcome), outcome, step.sum(1))  # [N]
    a_episode = group_advantages(episode, group_size, scale_rewards=scale_rewards, std=std, eps=eps,
                                 estimator=estimator)  # [N]
    returns = discounted_returns(step, gamma)  # [N, K]
    grouped = exists & (states >= 0) & ~torch.isnan(outcome)[:, None]  # [N, K] turns in some step group
    rows = torch.arange(N, device=outcome.device)[:, None].expand(N, K)
    keys = torch.stack([rows[grouped] // group_size, states[grouped]], dim=1)  # [M, 2] (prompt, state)
    a_step = torch.zeros_like(returns)  # [N, K]
    a_step[grouped] = normalize_within(returns[grouped], keys, scale=scale_rewards != "none",
                                       ddof=1 if std == "sample" else 0, eps=eps)
    return torch.where(exists, a_episode[:, None] + omega * a_step, 0.0)  # [N, K]


def mt_grpo_advantages(outcome_advantages: Tensor, turn_rewards: Tensor, turns: Tensor, group_size: int, *,
                       weight: float = 1.0, scale: bool = True, std: str = "population", eps: float = 1e-4
                       ) -> Tensor:
    """MT-GRPO's advantage per turn [N, K] (module docstring): the outcome advantage [N] plus `weight` times
    each turn's reward normalised among the group's answers that reported one at that turn index."""
    _check(outcome_advantages, turn_rewards, turns, group_size)
    N, K = turn_rewards.shape
    exists = _turn_grid(turns, K)  # [N, K]
    reported = exists & ~torch.isnan(turn_rewards)  # [N, K]
    rows = torch.arange(N, device=turns.device)[:, None].expand(N, K)
    index = torch.arange(K, device=turns.device)[None, :].expand(N, K)
    keys = torch.stack([rows[reported] // group_size, index[reported]], dim=1)  # [M, 2] (prompt, turn index)
    a_turn = torch.zeros(N, K, dtype=outcome_advantages.dtype, device=turns.device)  # [N, K]
    a_turn[reported] = normalize_within(turn_rewards[reported].to(a_turn.dtype), keys, scale=scale,
                                        ddof=1 if std == "sample" else 0, eps=eps)
    return torch.where(exists, outcome_advantages[:, None] + weight * a_turn, 0.0)  # [N, K]


def token_advantages(turn_advantages: Tensor, token_turn: Tensor) -> Tensor:
    """Each token gets its turn's advantage: turn_advantages [N, K], token_turn [N, T] (the turn of each
    token, -1 where none: tool results, padding, which get 0) -> [N, T]."""
    picked = turn_advantages.gather(1, token_turn.clamp(min=0).long())  # [N, T]
    return torch.where(token_turn >= 0, picked, 0.0)  # [N, T]


TURN_ADVANTAGES = ("none", "gigpo", "mt_grpo")  # algorithm.turn_advantage (config/algorithm.py names the same)
