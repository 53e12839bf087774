"""Named GRPO variants: `algorithm.preset = "NAME"` sets a few fields, and any field you set wins.

Each preset writes every field on the axes the variants differ on (loss aggregation, KL, clip
range, advantage scaling, ratio level, dynamic sampling, advantage estimator), so a preset means
the same thing whatever the defaults are, and two presets differ exactly where the papers do.
Everything else (learning rate, group size, μ, entropy options, ...) stays yours.

| field                     | grpo   | dr_grpo | dapo   | gspo     | cispo  | sapo   | luspo    | vespo  |
|---------------------------|--------|---------|--------|----------|--------|--------|----------|--------|
| loss_type                 | grpo   | dr_grpo | dapo   | grpo     | cispo  | sapo   | luspo    | vespo  |
| beta                      | 0.04   | 0.0     | 0.0    | 0.0      | 0.0    | 0.0    | 0.0      | 0.0    |
| epsilon                   | 0.2    | 0.2     | 0.2    | 3e-4     | 0.2    | 0.2    | 3e-4     | 0.2    |
| epsilon_high (0 = eps)    | 0.0    | 0.0     | 0.28   | 4e-4     | 5.0    | 0.0    | 4e-4     | 0.0    |
| scale_rewards             | group  | none    | group  | group    | group  | group  | group    | group  |
| importance_sampling_level | token  | token   | token  | sequence | token  | token  | sequence | token  |
| dynamic_sampling          | false  | false   | true   | false    | false  | false  | false    | false  |
| advantage_estimator       | grpo   | grpo    | grpo   | grpo     | grpo   | grpo   | grpo     | grpo   |
| rewards                   |        |         | + soft_overlong_penalty |  |  |  |  |  |

``sapo`` also writes ``sapo_temperature_pos = 1.0`` and ``sapo_temperature_neg = 1.05``; ``vespo`` writes
``vespo_k_pos = 2``, ``vespo_lambda_pos = 3``, ``vespo_k_neg = 3``, ``vespo_lambda_neg = 2``.

- ``grpo`` — DeepSeekMath (Shao et al. 2024): per-answer token mean, then mean over answers;
  k3 KL to the reference with β = 0.04; A = (r − mean) / std per group.
- ``dr_grpo`` — Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): no division
  by the group std, and a constant normaliser (N · max_new_tokens) instead of each answer's own
  length, removing GRPO's bias towards long wrong answers and short right ones. β = 0.
- ``dapo`` — DAPO (Yu et al. 2025): clip-higher (ε_high = 0.28), dynamic sampling (groups whose
  rewards are all equal are dropped and more prompts drawn), token-level loss over the whole
  generation batch, no KL, and the soft overlong punishment: ``soft_overlong_penalty`` is added to
  ``rewards.functions`` (after your functions, or after the built-in task's verifier when you list
  none) with ``max_completion_length = rollout.max_new_tokens`` and ``overlong_buffer`` = 20% of it
  (at least 1; the paper's 4096 of 20480). A ``soft_overlong_penalty`` you list yourself is kept
  as you wrote it.
- ``gspo`` — GSPO (Zheng et al. 2025): one length-normalised ratio per answer, clipped to the
  paper's small range [1 − 3e-4, 1 + 4e-4], the per-answer mean as the loss (``grpo``
  aggregation: the sequence term is the same on every token), no KL. The clip range acts only
  off-policy: with μ = 1 and one minibatch per generation batch every ratio is 1 and GSPO's update
  equals GRPO's without KL; split the batch (``train.minibatch_size``) or set μ > 1 to see it.
- ``cispo`` — CISPO (MiniMax-M1, 2025): REINFORCE with the importance weight clipped and detached,
  so no token's gradient is dropped; token-level aggregation, no KL. ``epsilon_high`` is the cap on
  the weight itself, as in TRL; MiniMax-M1 does not publish its tuned ε_high^IS, so the preset takes
  ScaleRL's ε_max = 5 (Khatri et al. 2025; TRL's recommended ``epsilon_high=5.0``). No lower cap.
- ``sapo`` — SAPO (Gao et al. 2025, Qwen): the hard clip becomes a smooth gate,
  sigmoid(τ(r − 1)) · 4/τ, so a token far off-policy fades out instead of being cut; a slightly higher
  τ for negative advantages (1.05) damps them faster, as the paper sets it. Per-answer token mean.
- ``luspo`` — LUSPO (2026, "Length-Unbiased Sequence Policy Optimization"): GSPO's sequence ratio and
  clip range, but each answer's term is summed over its tokens (scaled by its length) instead of
  averaged, which removes GSPO's bias towards short answers.
- ``vespo`` — VESPO (2026, "Variational Sequence-Level Soft Policy Optimization"): REINFORCE weighted by
  a smooth gamma-shaped function of the answer's whole sequence ratio, φ(w) = e^λ · w^k · e^(−λw)
  (φ(1) = 1), with TRL's (k, λ) = (2, 3) for non-negative and (3, 2) for negative advantages.

Presets are resolved when a config is built from a dict or TOML (``load_config``,
``config_from_dict``, ``grpokit train --set algorithm.preset=dapo``), under the values you give,
and the resolved fields are what ``config.toml`` in the run folder records. Building
``AlgorithmConfig(preset=...)`` directly in Python only records the name: there, start from
``preset_fields(name)`` (``AlgorithmConfig(**{**preset_fields("dapo")["algorithm"], ...})``).

Pure data and dict merging; no torch.
"""

from __future__ import annotations

from typing import Callable

from grpokit.config.schema import RolloutConfig
from grpokit.config.variants import ENVIRONMENT_TASKS
from grpokit.errors import PresetError

OVERLONG_BUFFER_FRACTION = 0.2  # DAPO: L_cache = 4096 of L_max = 20480


def _fields(loss_type, beta, epsilon, epsilon_high, scale_rewards, level, dynamic_sampling, **extra) -> dict:
    return {"loss_type": loss_type, "beta": beta, "epsilon": epsilon, "epsilon_high": epsilon_high,
            "scale_rewards": scale_rewards, "importance_sampling_level": level,
            "dynamic_sampling": dynamic_sampling, "advantage_estimator": "grpo", **extra}


# name -> {"algorithm": fields, "rewards": a function of the raw config -> its [rewards] table (optional)}
PRESETS: dict[str, dict] = {
    "grpo": {"algorithm": _fields("grpo", 0.04, 0.2, 0.0, "group", "token", False)},
    "dr_grpo": {"algorithm": _fields("dr_grpo", 0.0, 0.2, 0.0, "none", "token", False)},
    "dapo": {"algorithm": _fields("dapo", 0.0, 0.2, 0.28, "group", "token", True),
             "rewards": "soft_overlong_penalty"},
    "gspo": {"algorithm": _fields("grpo", 0.0, 3e-4, 4e-4, "group", "sequence", False)},
    "cispo": {"algorithm": _fields("cispo", 0.0, 0.2, 5.0, "group", "token", False)},
    "sapo": {"algorithm": _fields("sapo", 0.0, 0.2, 0.0, "group", "token", False,
                                  sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)},
    "luspo": {"algorithm": _fields("luspo", 0.0, 3e-4, 4e-4, "group", "sequence", False)},
    "vespo": {"algorithm": _fields("vespo", 0.0, 0.2, 0.0, "group", "token", False, vespo_k_pos=2.0,
                                   vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)},
}


# Arguments of a built-in task's verifier that are also arguments of the task (they must travel
# along when the verifier is named in rewards.functions instead of being implied by data.task).
_TASK_VERIFIER_ARGS = {"addition": (), "countdown": ("format_score",)}


def _with_soft_overlong_penalty(raw: dict, name: str) -> dict:
    if not isinstance(raw.get("rewards") or {}, dict):
        return raw["rewards"]  # config_from_dict reports it
    rewards = dict(raw.get("rewards") or {})
    functions = list(rewards.get("functions") or ())
    if "soft_overlong_penalty" in functions:
        return rewards
    args = {k: dict(v) if isinstance(v, dict) else v for k, v in (rewards.get("args") or {}).items()}
    if not functions:  # the task's verifier is implied: name it, so the penalty adds to it
        data = raw.get("data") or {}
        task = data.get("task")
        if not task:
            raise PresetError(f"algorithm.preset = {name!r} adds soft_overlong_penalty to rewards.functions, "
                              "which is empty and there is no data.task: list your reward functions in "
                              "rewards.functions")
        functions = [] if task in ENVIRONMENT_TASKS else [task]  # gridworld: the environment's reward, beside
        task_args = data.get("task_args") or {}
        passed = {k: task_args[k] for k in _TASK_VERIFIER_ARGS.get(task, ()) if k in task_args}
        if passed:
            args.setdefault(task, passed)
    weights = list(rewards.get("weights") or ())
    if weights:
        weights.append(1.0)
    max_len = (raw.get("rollout") or {}).get("max_new_tokens", RolloutConfig.max_new_tokens)
    if isinstance(max_len, int) and not isinstance(max_len, bool) and max_len >= 1:  # else RolloutConfig says why
        args.setdefault("soft_overlong_penalty", {
            "max_completion_length": max_len,
            "overlong_buffer": max(1, round(OVERLONG_BUFFER_FRACTION * max_len))})
    return {**rewards, "functions": functions + ["soft_overlong_penalty"], "weights": weights, "args": args}


_REWARD_HOOKS: dict[str, Callable[[dict, str], dict]] = {"soft_overlong_penalty": _with_soft_overlong_penalty}


def preset_fields(name: str) -> dict:
    """The preset's algorithm fields (a copy) under "algorithm", and the reward it adds, if any."""
    preset = PRESETS[name]
    out = {"algorithm": dict(preset["algorithm"])}
    if "rewards" in preset:
        out["adds_reward"] = preset["rewards"]
    return out


def apply_preset(raw: dict) -> dict:
    """A copy of the raw config dict with ``algorithm.preset``'s fields filled in under the user's.

    Unknown names raise ``KeyError`` (the config layer turns it into a ConfigError with a
    suggestion); a preset that cannot apply raises ``PresetError``.
    """
    algorithm = raw.get("algorithm")
    name = algorithm.get("preset", "") if isinstance(algorithm, dict) else ""
    if not name:
        return raw
    preset = PRESETS[name]
    out = dict(raw)
    out["algorithm"] = {**preset["algorithm"], **algorithm}
    if "rewards" in preset:
        out["rewards"] = _REWARD_HOOKS[preset["rewards"]](raw, name)
    return out
