"""Rewards: TRL-compatible reward functions, their weighted combination, built-in graders.

    from grpokit.rewards import RewardSpec, compute_rewards, get_reward
    specs = [RewardSpec("acc", get_reward("numeric_match")), RewardSpec("fmt", get_reward("format"), 0.1)]
    per_fn, total = compute_rewards(specs, prompts, completions, completion_ids, {"answer": answers})
"""

from __future__ import annotations

from grpokit.errors import RewardError, RewardLoadError, RewardTimeoutError
from grpokit.rewards.core import RewardSpec, as_trl_completions, compute_rewards, is_conversational, reward_metrics
from grpokit.rewards.graders import (
    DEFAULT_FORMAT,
    answer_span,
    completion_text,
    final_number,
    format_reward,
    math_equivalence,
    numeric_match,
    overlong_penalty_value,
    soft_overlong_penalty,
)
from grpokit.rewards.pooled_reward import isolate
from grpokit.rewards.registry import (
    available_rewards,
    get_reward,
    load_reward,
    register_reward,
    resolve_reward,
    reward_name,
    reward_specs,
)
from grpokit.rewards.remote import RemoteGrader, is_url
from grpokit.rewards.reward_model import RewardModel, check_reward_model_folder, load_reward_model
from grpokit.rewards.sandbox import code_execution, code_execution_reward, extract_code, sandbox_isolation
from grpokit.rewards.worker_pool import RewardPool, check_isolatable

__all__ = [
    "DEFAULT_FORMAT", "RemoteGrader", "RewardError", "RewardLoadError", "RewardModel", "RewardPool", "RewardSpec",
    "RewardTimeoutError", "answer_span", "check_isolatable", "check_reward_model_folder", "is_url", "isolate",
    "load_reward_model", "sandbox_isolation",
    "as_trl_completions", "code_execution", "code_execution_reward", "extract_code",
    "available_rewards", "completion_text", "compute_rewards", "final_number", "format_reward", "get_reward",
    "is_conversational", "load_reward", "math_equivalence", "numeric_match", "overlong_penalty_value",
    "register_reward", "resolve_reward", "reward_metrics", "reward_name", "reward_specs", "soft_overlong_penalty",
]
