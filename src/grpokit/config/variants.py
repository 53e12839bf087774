"""The names of every variant, and the facts about them that more than one stage needs.

One home for each fact: the config validates against these names, the math
(`algorithms/`) dispatches on them, and the training loop and the multi-process
reduction ask the config's properties (`AlgorithmConfig.sums_over_global_tokens`,
`Config.skips_zero_advantage`) instead of repeating a condition. Plain data (tuples, and one
small record per loss type), no torch: the CLI reads them before torch is imported, and the
math (`algorithms/objectives.py`) reads the loss types', levels' and aggregations' names here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossKind:
    """One loss type (algorithm.loss_type) as the two parts algorithms/objectives.py puts together: its
    per-token term and its aggregation. Every other stage's fact about a loss type follows from these."""

    surrogate: str  # the per-token term: "clip" (PPO's clipped ratio), "cispo", "sapo" or "vespo"
    aggregation: str  # the masked per-token losses [N, T] -> one number: "grpo", "bnpo", "dr_grpo", "dapo", "luspo"

    @property
    def clipped(self) -> bool:
        """A clip range: its clip statistics, and two-sided clipping (algorithm.delta)."""
        return self.surrogate == "clip"

    @property
    def sums_over_global_tokens(self) -> bool:
        """Divides by the token count of the whole minibatch (all processes together), not of a micro-batch or
        an answer: the trainer all-reduces that count before the loss, gradient accumulation does not rescale
        it, and the processes' gradients simply add up."""
        return self.aggregation == "dapo"

    @property
    def sequence_weight(self) -> bool:
        """Each answer's term is weighted by a function of all its tokens' log-probs together (VESPO), so the
        fused head's one-pass backward (per-token gradients) cannot serve."""
        return self.surrogate == "vespo"

    @property
    def sums_token_terms(self) -> bool:
        """Sums per-token terms over the batch: with a sequence-level ratio each answer is then weighted by its
        length instead of optimizing the per-answer objective (TRL warns for the same loss types)."""
        return self.aggregation in ("bnpo", "dr_grpo", "dapo") and not self.sequence_weight


# algorithm.loss_type: the one list of loss types and their facts, read by the config's checks and by the math
LOSS_KINDS: dict[str, LossKind] = {
    "grpo": LossKind("clip", "grpo"),
    "bnpo": LossKind("clip", "bnpo"),
    "dr_grpo": LossKind("clip", "dr_grpo"),
    "dapo": LossKind("clip", "dapo"),
    "cispo": LossKind("cispo", "dapo"),
    "sapo": LossKind("sapo", "grpo"),
    "luspo": LossKind("clip", "luspo"),
    "vespo": LossKind("vespo", "dapo"),
}
LOSS_TYPES = tuple(LOSS_KINDS)
# views of LOSS_KINDS for the readers that list names (messages, the TRL drop-in's checks, tests)
CLIPPED_LOSSES = tuple(name for name, kind in LOSS_KINDS.items() if kind.clipped)
GLOBAL_TOKEN_LOSSES = tuple(name for name, kind in LOSS_KINDS.items() if kind.sums_over_global_tokens)
ENTROPY_AGGREGATIONS = ("loss", "token_mean")  # algorithm.entropy_aggregation (algorithms/objectives.py)
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")  # algorithms/advantages.py
SCALE_REWARDS = ("group", "batch", "none")
STD_KINDS = ("population", "sample")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # sequence = GSPO (algorithms/objectives.py)
OLD_LOGPROBS = ("recompute", "first_pass", "sampler")
# algorithm.is_correction: how a sampler's log-probs that are not the trainer's are corrected (TRL's
# vllm_importance_sampling_mode); "none" = off
IS_CORRECTIONS = ("auto", "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# config/presets.py; a test keeps them equal
PRESET_NAMES = ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "luspo", "vespo")
ENGINES = ("hf", "vllm")  # rollout/engines.py
ROLLOUT_MODES = ("sync", "async")  # training/rollout_source.py
SAMPLERS = ("inverse_cdf", "gumbel")  # rollout/sampling.py
# The built-in task names (tasks.TASKS; not imported here: that imports torch). A test keeps them equal.
# Tasks whose reward is their environment's own get_reward, with no verifier to name in rewards.functions
ENVIRONMENT_TASKS = ("gridworld",)
TASK_NAMES = ("addition", "countdown", "gridworld", "multiplication", "shapes")
REWARD_ISOLATION = ("none", "process")  # rewards/worker_pool.py
REWARD_ON_ERROR = ("raise", "skip")
TOOL_HISTORY = ("append", "split")  # tools.history: rollout/history.py
# rewards.aggregation: how several reward functions become one advantage (TRL's multi_objective_aggregation)
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
