"""`AsyncGRPOConfig`: TRL 1.16's AsyncGRPOConfig (`trl.experimental.async_grpo`), field for field, on GRPOConfig's
decisions and grpokit's asynchronous rollout (`rollout.mode = "async"`).

TRL's AsyncGRPOConfig has 142 fields: 132 it shares with GRPOConfig (transformers' TrainingArguments and the
sampling ones) and 10 of its own. A shared field keeps GRPOConfig's decision (maps, accepted with a note, or
refused: trl/config.py), through a GRPOConfig built from this one (`as_grpo`), so nothing is decided twice. The
GRPOConfig fields TRL's async trainer lacks (`GRPO_ONLY`: beta, loss_type, num_iterations, the vLLM colocate
options, ...) are fixed at what that trainer does: no KL term and no reference model, one pass over each
batch, the group std without Bessel's correction, the prompts in the dataset's order, every column to the
reward functions, and its loss normaliser, the token count of each micro-batch over all processes (grpokit's
`dapo` when a step is one micro-batch, else `bnpo`, which counts each process's own).

The own fields (`OWN`): `max_staleness` -> `rollout.max_staleness`, converted (TRL counts weight versions, one
per `weight_sync_steps` steps; grpokit counts optimizer steps: the same bound is (max_staleness + 1) x
weight_sync_steps - 1 steps), `weight_sync_steps` -> `rollout.weight_sync_every`, `heartbeat_stale_after_s`
-> `rollout.worker_timeout_s`, `dtype` -> `model.dtype` (model_init_kwargs' dtype first, as in TRL),
`token_budget` <= 0 is grpokit's fixed-count micro-batches (None, TRL's default, means the vLLM server's
max_model_len: there is no server, so grpokit packs the fixed count too; > 0 is refused); the others have
nothing to act on in grpokit and are accepted with a note (`fork_threshold_tokens`, the server's timeouts,
`max_inflight_tasks`, `queue_maxsize`); `vllm_server_base_url` given (TRL's default address too, written out)
samples on that vLLM server (started with `grpokit serve`); left at its default it is not connected to (the
built-in sampler runs in grpokit's workers). docs/TRL.md lists every field with its decision.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from grpokit.errors import ConfigError
from grpokit.trl.config import GRPOConfig, refused_field

LABEL = "grpokit.trl.AsyncGRPOConfig"
# GRPOConfig's fields that TRL 1.16's AsyncGRPOConfig does not have
GRPO_ONLY = (
    "disable_dropout", "cast_lm_head_to_fp32", "num_generations_eval", "ds3_gather_for_generation", "shuffle_dataset",
    "pad_to_multiple_of", "generation_batch_size", "steps_per_generation", "generation_kwargs", "cache_implementation",
    "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
    "vllm_server_host", "vllm_server_port", "vllm_group_port", "vllm_gpu_memory_utilization", "vllm_max_model_length",
    "vllm_tensor_parallel_size", "beta", "num_iterations", "delta", "sapo_temperature_neg", "sapo_temperature_pos",
    "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "importance_sampling_level",
    "reward_weights", "multi_objective_aggregation", "scale_rewards", "loss_type", "mask_truncated_completions",
    "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "top_entropy_quantile", "entropy_coef",
    "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "off_policy_mask_threshold", "use_bias_correction_kl", "log_multimodal",
    "log_unique_prompts", "log_completions_hub_repo", "use_transformers_continuous_batching",
    "transformers_continuous_batching_config", "use_transformers_paged", "vllm_importance_sampling_cap",
)
# TRL's AsyncGRPOConfig's own fields, with its defaults
OWN: dict[str, Any] = {
    "dtype": "float32", "fork_threshold_tokens": 1024, "request_timeout": 600, "weight_sync_timeout": 1800,
    "token_budget": None, "max_inflight_tasks": -1, "max_staleness": 4, "queue_maxsize": 1024,
    "weight_sync_steps": 1, "heartbeat_stale_after_s": 300.0,
}
# shared fields whose default TRL's AsyncGRPOConfig changes (lr_scheduler_type is "constant" in both)
class _NotGiven(str):
    """TRL's default server address as the field's default: equal to the string, but not one a user typed, so
    `vllm_server_base_url="http://localhost:8000"` written out samples on that server while the default does not."""


ASYNC_DEFAULTS: dict[str, Any] = {
    "logging_steps": 1, "ignore_data_skip": True, "remove_unused_columns": True, "max_completion_length": 2048,
    "vllm_server_base_url": _NotGiven("http://localhost:8000"),
}
# shared fields GRPOConfig refuses away from its default that change nothing here (a note says so), with the
# value the GRPOConfig translation gets
NO_EFFECT_HERE = {"ignore_data_skip": False, "remove_unused_columns": False, "vllm_server_timeout": 240.0}
DTYPES = ("auto", "bfloat16", "float16", "float32")
_INTS = ("fork_threshold_tokens", "request_timeout", "weight_sync_timeout", "max_inflight_tasks", "max_staleness",
         "queue_maxsize", "weight_sync_steps")
_NUMBERS = ("heartbeat_stale_after_s", "vllm_server_timeout")
FORCED_ACCELERATOR = ("split_batches", "dispatch_batches")  # TRL's __post_init__ sets both True, whatever is given


class _GRPOForAsync(GRPOConfig):
    """The GRPOConfig an AsyncGRPOConfig runs as; its errors name AsyncGRPOConfig."""

    _label = LABEL


class _AsyncBase:
    def __post_init__(self):
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self.accelerator_config = _forced(self.accelerator_config)
        problems = own_problems(self)
        if problems:
            raise ConfigError(f"{LABEL}: grpokit does not support "
                              + ("this TRL argument" if len(problems) == 1 else "these TRL arguments")
                              + " (docs/TRL.md): " + "; ".join(problems))
        self.as_grpo()  # GRPOConfig's checks of the shared fields, now (the trainer builds it again)

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))  # as GRPOConfig's

    @property
    def samples_per_step(self) -> int:
        """Answers per optimizer step (TRL's samples_per_step): per process, micro-step and process."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    def as_grpo(self, max_steps: int | None = None) -> GRPOConfig:
        """The GRPOConfig that runs the same training, with TRL's async trainer's fixed choices (module docstring).
        `max_steps`: the steps TRL's epoch rule gives (the trainer knows the dataset's length)."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(GRPOConfig)
                  if f.init and f.name not in GRPO_ONLY}
        kwargs = dict(self.model_init_kwargs or {})
        kwargs.setdefault("dtype", self.dtype)  # TRL's rule: model_init_kwargs' dtype first
        shared.update(NO_EFFECT_HERE, vllm_server_base_url=None, model_init_kwargs=kwargs,
                      accelerator_config=_without_forced(self.accelerator_config),
                      loss_type="dapo" if self.gradient_accumulation_steps == 1 else "bnpo", scale_rewards="group",
                      shuffle_dataset=False)
        if _uses_server(self):  # the worker's requests go to that vLLM server (started with grpokit serve)
            shared.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=self.vllm_server_base_url,
                          vllm_server_timeout=max(self.vllm_server_timeout, self.request_timeout))
        if max_steps is not None:
            shared["max_steps"] = max_steps
        return _GRPOForAsync(**shared)


def own_problems(c) -> list[str]:
    """TRL's async fields (and the shared ones it reads its own way) at values grpokit cannot run."""
    typed = [f"{name}={getattr(c, name)!r} (must be an integer)" for name in _INTS
             if not isinstance(getattr(c, name), int) or isinstance(getattr(c, name), bool)]
    typed += [f"{name}={getattr(c, name)!r} (must be a number)" for name in _NUMBERS
              if not isinstance(getattr(c, name), (int, float)) or isinstance(getattr(c, name), bool)]
    if c.token_budget is not None and (not isinstance(c.token_budget, int) or isinstance(c.token_budget, bool)):
        typed.append(f"token_budget={c.token_budget!r} (must be an integer or None)")
    if typed:
        return typed
    checks = [
        ("dtype", c.dtype in DTYPES, f"one of {', '.join(DTYPES)}"),
        ("vllm_server_base_url", isinstance(c.vllm_server_base_url, str) and c.vllm_server_base_url.startswith(
            ("http://", "https://")), "the vLLM server's address, e.g. 'http://gpu-box:8000'"),
        ("token_budget", c.token_budget is None or c.token_budget <= 0,
         "grpokit's micro-batches hold a fixed count of answers (per_device_train_batch_size per process), TRL's "
         "token_budget <= 0 packing; it has no token-budgeted batching: set token_budget=0, or leave it None"),
        ("max_staleness", c.max_staleness >= 0, "must be >= 0 (0 = every answer sampled with the newest weights)"),
        ("weight_sync_steps", c.weight_sync_steps >= 1, "must be >= 1 (1 = after every optimizer step)"),
        ("heartbeat_stale_after_s", c.heartbeat_stale_after_s > 0, "must be > 0 seconds"),
        ("eval_strategy", c.eval_strategy == "no", "AsyncGRPOTrainer takes no eval_dataset (TRL's neither); use "
         "GRPOTrainer for evaluation during training, or leave eval_strategy='no'"),
    ]
    problems = [f"{name}={getattr(c, name)!r} ({why})" for name, ok, why in checks if not ok]
    G, counts = c.num_generations, (c.num_generations, c.per_device_train_batch_size, c.gradient_accumulation_steps)
    whole = all(isinstance(n, int) and not isinstance(n, bool) for n in counts)  # else GRPOConfig's type check
    if whole and G >= 1 and c.samples_per_step % G:
        problems.append(f"per_device_train_batch_size={c.per_device_train_batch_size} (times "
                        f"{c.gradient_accumulation_steps} gradient_accumulation_steps and {c.world_size} processes: "
                        f"{c.samples_per_step} answers per optimizer step, not whole groups of num_generations={G}; "
                        "grpokit's step trains whole groups, TRL's async trainer may split one across steps: make "
                        "it a multiple of num_generations)")
    return problems


def _uses_server(c) -> bool:
    """TRL's async trainer always samples on a vLLM server; grpokit uses one only when its address is given, even
    TRL's default one written out (left at the default it is not connected to: the built-in sampler runs in
    grpokit's own worker processes)."""
    return not isinstance(c.vllm_server_base_url, _NotGiven)


def async_notes(c) -> list[str]:
    """What the trainer says once about the async fields that change nothing in grpokit."""
    bounded = (f"every wait on grpokit's rollout workers is bounded by heartbeat_stale_after_s = "
               f"{c.heartbeat_stale_after_s:g} s (rollout.worker_timeout_s)")
    if _uses_server(c):
        bounded = (f"every call to the server is bounded by the larger of vllm_server_timeout and request_timeout "
                   f"({max(c.vllm_server_timeout, c.request_timeout):g} s: rollout.vllm.server_timeout_s)")
    reasons = {
        "fork_threshold_tokens": "grpokit never re-tokenizes a conversation (a tool's result is appended as tokens), "
                                 "so no turn forks a training row",
        "request_timeout": f"there is no vLLM server to send requests to; {bounded}",
        "vllm_server_timeout": f"there is no vLLM server to wait for; {bounded}",
        "weight_sync_timeout": f"the weights go to grpokit's own worker processes; {bounded}",
        "max_inflight_tasks": "each rollout worker samples one step's batch at a time, ordered max_staleness + 1 "
                              "steps ahead, so nothing is generated only to be dropped as stale",
        "queue_maxsize": "at most max_staleness + 1 steps' batches wait for the trainer; none is dropped for lack of "
                         "room",
        "ignore_data_skip": "TRL's async trainer forces it True too; grpokit's resume continues the prompt stream "
                            "from the checkpoint",
    }
    if _uses_server(c):  # these two bound the calls to the server
        reasons.pop("vllm_server_timeout"), reasons.pop("request_timeout")
        reasons["weight_sync_timeout"] = f"the weight transfer is driven by calls to the server; {bounded}"
    defaults = {**OWN, "vllm_server_timeout": 240.0, "ignore_data_skip": True}
    return [f"{name}={getattr(c, name)!r}: no effect: {why}" for name, why in reasons.items()
            if getattr(c, name) != defaults[name]]


def epoch_steps(args, train_dataset) -> int | None:
    """TRL's async stop rule when max_steps is unset: after ceil(num_train_epochs x rows) prompts' groups, in
    whole steps of samples_per_step / num_generations prompts; None when max_steps is set or the dataset has no
    length (then GRPOConfig's rules apply: an iterable dataset needs max_steps)."""
    if args.max_steps > 0 or train_dataset is None or not hasattr(train_dataset, "__len__"):
        return None
    groups = math.ceil(args.num_train_epochs * len(train_dataset))
    return max(1, math.ceil(groups / (args.samples_per_step // args.num_generations)))


def async_config(args, config):
    """grpokit's Config for the GRPOConfig translation, with TRL's asynchronous rollout: the workers, the staleness
    bound in optimizer steps, the weight sync, the deadline, and TRL's loss: clipped around the sampler
    (docs/TRL.md)."""
    rollout = dataclasses.replace(
        config.rollout, mode="async", max_staleness=(args.max_staleness + 1) * args.weight_sync_steps - 1,
        weight_sync_every=args.weight_sync_steps, worker_timeout_s=float(args.heartbeat_stale_after_s))
    # TRL's loss: the ratio to the sampler's own log-probs, clipped (PPO with the stale sampler as the old policy)
    algorithm = dataclasses.replace(config.algorithm, std="population", is_correction="none", old_logprobs="sampler")
    return dataclasses.replace(config, rollout=rollout, algorithm=algorithm)


def _forced(value):
    """TRL's AsyncGRPOConfig.__post_init__: split_batches and dispatch_batches set True on what is given."""
    if value is None:
        return {key: True for key in FORCED_ACCELERATOR}
    if isinstance(value, dict):
        return {**value, **{key: True for key in FORCED_ACCELERATOR}}
    for key in FORCED_ACCELERATOR:
        setattr(value, key, True)
    return value


def _without_forced(value):
    """accelerator_config as GRPOConfig reads it: without the two keys TRL forces (they change nothing here: each
    process's batch is per_device_train_batch_size answers, TRL's async meaning)."""
    from grpokit.trl.accepted import accelerator_options

    options = {k: v for k, v in accelerator_options(value).items() if k not in FORCED_ACCELERATOR}
    return options or None


def _own_field(name: str, default):
    return name, Any, refused_field(default)


def _fields() -> list:
    out = []
    for f in dataclasses.fields(GRPOConfig):
        if f.name in GRPO_ONLY:
            continue
        if f.name in ASYNC_DEFAULTS:
            default = ASYNC_DEFAULTS[f.name]
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append((f.name, Any, refused_field(default)))
    return out + [_own_field(name, default) for name, default in OWN.items()]


AsyncGRPOConfig = dataclasses.make_dataclass(
    "AsyncGRPOConfig", _fields(), bases=(_AsyncBase,),
    namespace={"__module__": __name__, "__doc__": "TRL 1.16's AsyncGRPOConfig arguments, for grpokit.trl."
               "AsyncGRPOTrainer: the shared fields keep GRPOConfig's decisions, the own ones map onto grpokit's "
               "asynchronous rollout. See the module docstring and docs/TRL.md."})
SHARED = tuple(f.name for f in dataclasses.fields(AsyncGRPOConfig) if f.name not in OWN)
