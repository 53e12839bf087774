"""The names of every variant, and the facts about them that more than one stage needs.

One home for each fact: the config validates against these names, the math
(`algorithms/`) dispatches on them, and the training loop and the multi-process
reduction ask the config's properties (`AlgorithmConfig.sums_over_global_tokens`,
`Config.skips_zero_advantage`) instead of repeating a condition. Plain tuples, no
torch: the CLI reads them before torch is imported.
"""

from __future__ import annotations

# algorithm.loss_type: how per-token losses become one number (algorithms/objectives.py)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# These divide by the token count of the whole minibatch (all processes together), not of a
# micro-batch or an answer: the trainer all-reduces that count before the loss, gradient
# accumulation does not rescale them, and the processes' gradients simply add up.
GLOBAL_TOKEN_LOSSES = ("dapo", "cispo", "vespo")
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # a clip range (and two-sided clipping, delta)
# Loss types whose terms act on a whole answer (a sequence weight or sum): each answer's loss depends on all
# its tokens' log-probs together, so the fused head's one-pass backward (per-token gradients) cannot serve.
SEQUENCE_LOSSES = ("vespo",)
# Loss types that sum per-token terms over the batch: with a sequence-level ratio they weight each answer by its
# length instead of optimizing the per-answer objective (TRL warns for the same ones).
TOKEN_SUM_LOSSES = ("bnpo", "dr_grpo", "dapo", "cispo")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")  # algorithms/advantages.py
SCALE_REWARDS = ("group", "batch", "none")
STD_KINDS = ("population", "sample")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # sequence = GSPO
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
