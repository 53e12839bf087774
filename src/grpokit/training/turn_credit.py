"""Per-turn credit in a run: `algorithm.turn_advantage` checked at start-up, and a step's advantages per token.

    check_turn_setup(config, toolbox, environments)           # before the model loads
    token_adv, metrics = turn_credit(algo, rollout, total, advantages, G)   # [N, T], after grading

The math is algorithms/turn_advantages.py; this module reads what the rollout recorded of each turn
(`Rollout.turns`: token turns, step rewards, state ids) and names the metrics.
"""

from __future__ import annotations

import torch

from grpokit.algorithms.turn_advantages import (
    GroupNormalization,
    gigpo_advantages,
    mt_grpo_advantages,
    token_advantages,
)
from grpokit.config.schema import Config
from grpokit.errors import SetupError
from grpokit.rollout.batch import Rollout

LOGGED_TURNS = 4  # per-turn metrics for the first turns only: later ones are rare and would flood the log


def check_turn_setup(config: Config, toolbox, environments) -> None:
    """Settings under which `algorithm.turn_advantage` cannot work: one error line each, before any model loads."""
    algo = config.algorithm
    if algo.turn_advantage == "none":
        return
    where = f"algorithm.turn_advantage = {algo.turn_advantage!r}"
    if toolbox is None and environments is None:
        raise SetupError(f"{where} credits the turns of multi-turn answers, and this run has no tools or environment; "
                         "give it tools ([tools] functions / environment, or train(tools=, environment_factory=)) "
                         "or set turn_advantage = \"none\"")
    if config.tools.isolation == "process":
        raise SetupError(f"{where}: step rewards and states are not read from tools in worker processes yet; set "
                         "tools.isolation = \"none\" or turn_advantage = \"none\"")
    if algo.turn_advantage != "gigpo":
        return
    if config.rewards.aggregation != "sum_then_normalize":
        raise SetupError(f"{where} normalises the episode return (the reward total plus the step rewards) itself; set "
                         "rewards.aggregation = \"sum_then_normalize\" or use turn_advantage = \"mt_grpo\"")
    stateless = [] if environments is None else \
        sorted({k.cls.__name__ for k in environments.kinds.values() if not callable(getattr(k.cls, "get_state", None))})
    if environments is None or stateless:
        what = f"environment {', '.join(stateless)} has" if stateless else "this run has no environment, so it has"
        raise SetupError(f"{where} groups turns by the environment state they start from, and {what} no get_state() "
                         "method; add get_state(self) returning the state (a string, number or tuple: equal states "
                         "equal values), or use turn_advantage = \"mt_grpo\"")


def turn_credit(algo, rollout: Rollout, total: torch.Tensor, advantages: torch.Tensor, G: int
                ) -> tuple[torch.Tensor, dict]:
    """Each token's advantage [N, T] under `algo.turn_advantage` and per-turn metrics. `total` [N] is the
    reward functions' total, `advantages` [N] the run's answer-level advantage (MT-GRPO's outcome term)."""
    turns = rollout.turns
    if turns is None:  # an engine that recorded no turns (a caller's): every turn gets the answer's advantage
        raise SetupError(f"algorithm.turn_advantage = {algo.turn_advantage!r} needs the rollout's turns, and the "
                         "engine recorded none (Rollout.turns); use grpokit's engines, or turn_advantage = \"none\"")
    device = advantages.device
    rewards, states, counts = turns.rewards.to(device), turns.states.to(device), turns.counts.to(device)
    if algo.turn_advantage == "gigpo":
        per_turn = gigpo_advantages(total.to(advantages.dtype), rewards.to(advantages.dtype), states, counts, G,
                                    gamma=algo.turn_discount, omega=algo.turn_advantage_weight,
                                    normalization=GroupNormalization(scale_rewards=algo.scale_rewards, std=algo.std,
                                                                     estimator=algo.advantage_estimator))  # [N, K]
    else:
        per_turn = mt_grpo_advantages(advantages, rewards.to(advantages.dtype), counts, G,
                                      weight=algo.turn_advantage_weight, scale=algo.scale_rewards != "none",
                                      std=algo.std)  # [N, K]
    token_turn = turns.token_turn.to(device)[:, :rollout.completion_ids.shape[1]]  # [N, T]
    return token_advantages(per_turn, token_turn), _metrics(per_turn, rewards, states, counts, G)


def _metrics(per_turn: torch.Tensor, rewards: torch.Tensor, states: torch.Tensor, counts: torch.Tensor, G: int
             ) -> dict:
    """turns/<k>/advantage_mean and turns/<k>/reward_mean (over the answers with a turn k, and those that
    reported a step reward), the share of turns that reported one, and the mean step-group size (GiGPO)."""
    K = per_turn.shape[1]
    exists = torch.arange(K, device=counts.device)[None, :] < counts[:, None]  # [N, K]
    reported = exists & ~torch.isnan(rewards)  # [N, K]
    out = {"turns/reward_share": float(reported.sum() / exists.sum().clamp(min=1))}
    for k in range(min(K, LOGGED_TURNS)):
        if exists[:, k].any():
            out[f"turns/{k}/advantage_mean"] = float(per_turn[exists[:, k], k].mean())
        if reported[:, k].any():
            out[f"turns/{k}/reward_mean"] = float(rewards[reported[:, k], k].mean())
    with_state = exists & (states >= 0)  # [N, K]
    if with_state.any():
        rows = torch.arange(len(counts), device=counts.device)[:, None].expand_as(states)
        keys = torch.stack([rows[with_state] // G, states[with_state]], dim=1)
        _, sizes = torch.unique(keys, dim=0, return_counts=True)
        out["turns/step_group_size"] = float(sizes.double().mean())  # GiGPO's: 1 = no two answers met a state
    return out
