"""`GRPOConfig`: TRL 1.16's GRPOConfig, field for field, checked for what grpokit can run.

Every one of TRL's 191 field names is accepted with TRL's default, so a TRL script's arguments never
fail as unknown (an unknown name is a TypeError, as with any dataclass). The 95 in `SUPPORTED`: 88 map onto
grpokit's `Config` with the same meaning (trl/mapping.py), 7 are accepted as already satisfied or with
nothing to act on, with a note (`use_liger_kernel`, `dataloader_*`, `accelerator_config`; and
`generation_kwargs`, whose stop strings map: trl/accepted.py); the other 96 (`REFUSED`: the Hub,
DeepSpeed/FSDP options, torch.compile, vLLM server mode, ...)
are accepted only at TRL's default: any of them set to another value, and any supported field set to a
value grpokit has no equivalent for (`lr_scheduler_type="linear"`, `delta=1.1`), is one
ConfigError listing them all, when the config is built. Nothing is silently ignored; the few fields
that change nothing in grpokit (`logging_steps`, `pad_to_multiple_of`,
`disable_dropout`, `do_train`/`do_eval`/`do_predict`, `local_rank`, `per_device_eval_batch_size`) say
why in docs/TRL.md.

One default differs: `lr_scheduler_type` is "constant" here ("linear" in TRL), since grpokit has no
linear decay; "linear" given explicitly is refused. The batch fields are resolved as TRL's own
`__post_init__` resolves them (`steps_per_generation`, `generation_batch_size`, with TRL's errors), and
the evaluation fields as transformers' TrainingArguments resolves them (`eval_steps` from
`logging_steps`, `metric_for_best_model` "loss" with `load_best_model_at_end`, `greater_is_better`,
the save/eval step rule). grpokit's evaluation scores the held-out mean reward, so the only best-model
metric is TRL's `eval_reward` (`BEST_METRICS`).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from grpokit.config.variants import CLIPPED_LOSSES, LOSS_TYPES  # every loss type TRL 1.16 has
from grpokit.errors import ConfigError
from grpokit.trl.accepted import accepted_problems

LR_SCHEDULES = ("constant", "constant_with_warmup", "cosine")
REPORT_TO = ("none", "tensorboard", "wandb")


@dataclass
class _Supported:
    """The fields grpokit maps (trl/mapping.py), with TRL 1.16's defaults (except lr_scheduler_type)."""

    output_dir: str | None = None
    # batch: per_device_train_batch_size counts answers; prompts per generation =
    # per_device_train_batch_size * world * steps_per_generation / num_generations
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    num_generations: int | None = 8
    max_completion_length: int | None = 512
    # length and optimizer (max_steps counts optimizer steps, as in TRL)
    max_steps: int = -1
    num_train_epochs: float = 3.0
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "constant"  # TRL: "linear" (grpokit has no linear decay)
    warmup_steps: float = 0
    optim: str = "adamw_torch_fused"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    seed: int = 42
    # sampling
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    use_vllm: bool = False
    vllm_mode: str = "colocate"  # "server": vLLM's own server (grpokit serve), not `trl vllm-serve`
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0
    vllm_gpu_memory_utilization: float = 0.3
    vllm_enable_sleep_mode: bool = False
    vllm_max_model_length: int | None = None
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_cap: float | None = None  # TRL's deprecated spelling of _clip_max
    max_tool_calling_iterations: int | None = None
    # the objective
    beta: float = 0.0
    num_iterations: int = 1
    epsilon: float = 0.2
    epsilon_high: float | None = None
    importance_sampling_level: str = "token"
    reward_weights: list[float] | None = None
    scale_rewards: str = "group"
    loss_type: str = "dapo"
    shuffle_dataset: bool = True
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_bias_correction_kl: bool = True
    delta: float | None = None
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    multi_objective_aggregation: str = "sum_then_normalize"
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512  # optimizer steps, converted like save_steps
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    # model loading and precision
    model_init_kwargs: dict | None = None
    bf16: bool | None = None
    fp16: bool = False
    use_cpu: bool = False
    gradient_checkpointing: bool = True  # train.gradient_checkpointing (TRL's default: on)
    disable_dropout: bool = False  # accepted; grpokit always runs with dropout off
    # data, logging, saving
    remove_unused_columns: bool | None = False
    pad_to_multiple_of: int | str | None = "auto"  # padding only: no effect on the numbers
    logging_steps: float = 10  # grpokit logs every step; used for log_completions' interval
    log_completions: bool = False
    report_to: str | list[str] | None = "none"
    disable_tqdm: bool | None = None
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    # evaluation (trl/mapping.py: eval_steps counts optimizer steps, converted as save_steps)
    eval_strategy: str = "no"
    eval_steps: float | None = None  # None: logging_steps (transformers' rule)
    per_device_eval_batch_size: int = 8  # checked as TRL checks it; grpokit's evaluation batches its own way
    num_generations_eval: int | None = None
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None  # None with load_best_model_at_end: transformers' "loss"
    greater_is_better: bool | None = None
    do_train: bool = False  # not read by TRL's trainer either
    do_eval: bool = False
    do_predict: bool = False
    local_rank: int = -1  # set by launchers; grpokit reads the process's rank from torchrun's environment
    # accepted, and already what grpokit does or without an object to act on (docs/TRL.md; `notes` says so)
    use_liger_kernel: bool = False  # Liger's fused GRPO loss avoids the [N, T, V] logits; grpokit never builds them
    dataloader_num_workers: int = 0  # only TRL's get_*_dataloader(): grpokit's loop holds its prompts in memory
    dataloader_pin_memory: bool = True
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    accelerator_config: Any = None  # grpokit does not run on Accelerate: checked for what would change the batch
    generation_kwargs: dict | None = None  # only stop strings (`stop_strings` / vLLM's `stop`) and do_sample=True

    _label = "grpokit.trl.GRPOConfig"  # what its errors name (AsyncGRPOConfig's translation names itself)

    def __post_init__(self):
        if self.output_dir is None:
            self.output_dir = "trainer_output"  # TrainingArguments' default
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.vllm_importance_sampling_cap is not None:  # TRL's own resolution of its deprecated spelling
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        if not _type_problems(self):  # the resolutions compute with the numbers; a wrong type is listed below
            self._resolve_evaluation()
            self._resolve_batch()
        problems = [f"{name}={getattr(self, name)!r}" + (f" ({REFUSED_WHY[name]})" if name in REFUSED_WHY else "")
                    for name, default in REFUSED.items() if getattr(self, name) != default]
        problems += _value_problems(self)  # the type problems first, when there are any
        if problems:
            raise ConfigError(f"{self._label}: grpokit does not support "
                              + ("this TRL argument" if len(problems) == 1 else "these TRL arguments")
                              + " (leave them at TRL's default, or use grpokit's own Config; docs/TRL.md): "
                              + "; ".join(problems))

    @property
    def world_size(self) -> int:
        """Processes in the run (torchrun's WORLD_SIZE; 1 alone)."""
        return int(os.environ.get("WORLD_SIZE", "1"))

    def _resolve_evaluation(self) -> None:
        """transformers' own resolution of the evaluation fields (TrainingArguments.__post_init__), with its
        errors: eval_steps falls back to logging_steps, load_best_model_at_end picks "loss" when no metric is
        named, greater_is_better follows the metric's name, and save and eval steps must line up."""
        if self.eval_strategy != "no":
            self.do_eval = True
        if self.eval_strategy == "steps":
            if not self.eval_steps:
                if not self.logging_steps > 0:
                    raise ConfigError("eval_strategy='steps' requires either non-zero eval_steps or logging_steps")
                self.eval_steps = self.logging_steps
            if self.eval_steps > 1:
                if self.eval_steps != int(self.eval_steps):
                    raise ConfigError(f"eval_steps must be an integer if bigger than 1: {self.eval_steps}")
                self.eval_steps = int(self.eval_steps)
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.load_best_model_at_end:
            if self.eval_strategy != self.save_strategy:
                raise ConfigError(f"load_best_model_at_end requires the save and eval strategy to match (TRL's rule), "
                                  f"but eval_strategy={self.eval_strategy!r} and save_strategy={self.save_strategy!r}")
            if self.eval_strategy == "steps" and _not_multiple(self.save_steps, self.eval_steps):
                raise ConfigError(f"load_best_model_at_end requires save_steps to be a multiple of eval_steps (TRL's "
                                  f"rule), but save_steps={self.save_steps} and eval_steps={self.eval_steps}")

    def _resolve_batch(self) -> None:
        """TRL's own resolution of the generation batch, with its errors (ValueError, here ConfigError)."""
        per_step = self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size is None and self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
            self.generation_batch_size = per_step * self.steps_per_generation
        elif self.generation_batch_size is not None and self.steps_per_generation is None:
            if self.generation_batch_size % per_step:
                raise ConfigError(f"generation_batch_size ({self.generation_batch_size}) must be divisible by the "
                                  f"global batch size ({per_step})")
            self.steps_per_generation = self.generation_batch_size // per_step
        elif self.generation_batch_size is None:
            self.generation_batch_size = per_step * self.steps_per_generation
        else:
            raise ConfigError("'generation_batch_size' and 'steps_per_generation' can not be both configured at the "
                              "same time")
        if self.num_generations is None or self.num_generations < 2:
            raise ConfigError("GRPO requires at least 2 generations per prompt to calculate the advantages; "
                              f"num_generations = {self.num_generations}")
        if self.do_eval and self.eval_strategy != "no":
            generations = self.num_generations_eval or self.num_generations
            if (self.per_device_eval_batch_size * self.world_size) % generations:
                raise ConfigError(f"The global eval batch size ({self.per_device_eval_batch_size} * {self.world_size}) "
                                  f"must be divisible by the number of generations used for evaluation "
                                  f"({generations})")
        if self.generation_batch_size % self.num_generations:
            raise ConfigError(f"generation_batch_size ({self.generation_batch_size}) must be divisible by "
                              f"num_generations ({self.num_generations}): per_device_train_batch_size counts "
                              f"answers, so it (times processes and gradient_accumulation_steps) must hold whole "
                              f"groups of num_generations")


def _type_problems(c) -> list[str]:
    """Fields given a value of another type (TRL does not check them; the checks below would raise TypeError)."""
    out = []
    for name, hint in typing.get_type_hints(_Supported).items():
        value, kinds = getattr(c, name), set(typing.get_args(hint)) or {hint}
        if value is None and type(None) in kinds:
            continue
        numeric = kinds & {int, float} and kinds <= {int, float, type(None)}
        if numeric and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
            out.append(f"{name}={value!r} (must be a number)")
        elif numeric and float not in kinds and isinstance(value, float):  # 4.0 would reach range() and slices
            out.append(f"{name}={value!r} (must be a whole number: {int(value)})" if value.is_integer()
                       else f"{name}={value!r} (must be a whole number)")
        elif kinds in ({bool}, {str}) and not isinstance(value, next(iter(kinds))):
            out.append(f"{name}={value!r} (must be {'True or False' if bool in kinds else 'a string'})")
    return out


def _value_problems(c) -> list[str]:
    """Supported fields set to a value grpokit has no equivalent for, each with the reason."""
    typed = _type_problems(c)
    if typed:  # the value checks below compare numbers
        return typed
    checks = [
        ("loss_type", c.loss_type in LOSS_TYPES, f"grpokit has {', '.join(LOSS_TYPES)}"),
        ("epsilon_high", c.epsilon_high is None or c.epsilon_high > 0, "must be > 0 (None = epsilon)"),
        ("epsilon_high", c.loss_type != "cispo" or (c.epsilon_high or c.epsilon) >= 1,
         "cispo caps the importance weight at epsilon_high; a cap below 1 scales every token down, and grpokit "
         "reads a value below 1 the earlier way (1 + value): set epsilon_high >= 1 (ScaleRL: 5.0)"),
        ("delta", c.delta is None or c.loss_type in CLIPPED_LOSSES,
         f"TRL ignores delta for loss_type={c.loss_type!r}, grpokit refuses it: leave it None"),
        ("delta", c.delta is None or c.delta > 1 + (c.epsilon_high or c.epsilon),
         "grpokit needs delta > 1 + epsilon_high (the INTELLECT-2 setting), or None"),
        ("sync_ref_model", not c.sync_ref_model or c.beta > 0,
         "there is no reference model to sync with beta=0 (TRL refuses it too): set beta, or sync_ref_model=False"),
        ("off_policy_mask_threshold", c.off_policy_mask_threshold is None or c.off_policy_mask_threshold > 0,
         "grpokit's 0 means off: use None, or a threshold > 0"),
        ("scale_rewards", c.scale_rewards in ("group", "batch", "none"), "use 'group', 'batch' or 'none'"),
        ("importance_sampling_level", c.importance_sampling_level in ("token", "sequence"), "token or sequence"),
        ("lr_scheduler_type", c.lr_scheduler_type in LR_SCHEDULES,
         f"grpokit has {', '.join(LR_SCHEDULES)} (no linear decay)"),
        ("optim", c.optim in ("adamw_torch", "adamw_torch_fused"), "grpokit's optimizer is torch's AdamW"),
        ("adam_epsilon", c.adam_epsilon == 1e-8, "grpokit's AdamW uses 1e-8"),
        ("weight_decay", not c.weight_decay, "TRL's Trainer exempts biases and norm weights from weight decay, "
         "grpokit's AdamW decays every parameter"),
        ("fp16", not (c.bf16 and c.fp16), "bf16=True as well: choose one"),
        ("save_strategy", c.save_strategy in ("steps", "no"), "use 'steps' or 'no'"),
        ("report_to", all(r in REPORT_TO for r in report_to_list(c.report_to)),
         f"grpokit reports to {', '.join(REPORT_TO)}"),
        ("max_completion_length", isinstance(c.max_completion_length, int) and c.max_completion_length >= 1,
         "give the answer budget in tokens"),
        ("model_init_kwargs", set(c.model_init_kwargs or {}) <= {"dtype", "torch_dtype"}, "grpokit reads only dtype"),
        ("vllm_mode", c.vllm_mode in ("colocate", "server"), "use 'colocate' or 'server'"),
        ("vllm_server_base_url", c.vllm_mode != "server" or c.vllm_server_base_url is None
         or bool(str(c.vllm_server_base_url).strip()), "give the server's address, or None for host and port"),
        ("entropy_coef", c.entropy_coef >= 0, "grpokit's entropy bonus needs a coefficient >= 0; a negative one, "
         "an entropy penalty, is not supported"),
        ("vllm_importance_sampling_clip_max", c.vllm_importance_sampling_clip_max is None
         or c.vllm_importance_sampling_clip_max > 0, "must be > 0, or None (no upper bound)"),
    ]
    return [f"{name}={getattr(c, name)!r} ({why})" for name, ok, why in checks if not ok] + _eval_problems(c) + \
        accepted_problems(c)


# TRL's evaluation metrics (as metric_for_best_model names them, "eval_" optional) -> grpokit's [eval] metric of
# the same meaning: the mean total (weighted) reward of num_generations_eval answers per held-out prompt.
BEST_METRICS = {"eval_reward": "eval/mean_reward"}


def best_metric(c) -> str | None:
    """grpokit's `output.keep_best` for TRL's metric_for_best_model; None when grpokit has no such metric."""
    name = c.metric_for_best_model or ""
    return BEST_METRICS.get(name if name.startswith("eval_") else f"eval_{name}")


def _eval_problems(c) -> list[str]:
    """The evaluation fields at values grpokit cannot run as TRL does."""
    problems = []
    if c.eval_strategy not in ("no", "steps"):
        problems.append(f"eval_strategy={c.eval_strategy!r} (grpokit counts steps, not epochs: use "
                        "eval_strategy='steps' with eval_steps)")
    looked_up = c.metric_for_best_model is not None and (c.eval_strategy != "no" or c.load_best_model_at_end)
    if looked_up and best_metric(c) is None:
        default = " (transformers' default with load_best_model_at_end)" if c.metric_for_best_model == "loss" else ""
        problems.append(f"metric_for_best_model={c.metric_for_best_model!r}{default} (grpokit's evaluation scores "
                        f"the held-out mean reward: use 'reward', TRL's eval_reward = grpokit's eval/mean_reward; "
                        f"eval_loss and the per-function eval rewards are not computed during training)")
    elif c.greater_is_better is False:
        problems.append("greater_is_better=False (grpokit's evaluation metrics are higher-is-better; leave it unset)")
    if c.num_generations_eval is not None and c.num_generations_eval < 1:
        problems.append(f"num_generations_eval={c.num_generations_eval!r} (must be >= 1, or None = num_generations)")
    return problems


def _not_multiple(save_steps: float, eval_steps: float) -> bool:
    """transformers' test that save_steps is no multiple of eval_steps (ratios below 1 both, or counts both)."""
    if save_steps % eval_steps == 0:
        return False
    if save_steps < 1 and eval_steps < 1:
        return round(save_steps * 1_000_000) % round(eval_steps * 1_000_000) != 0
    return True


def report_to_list(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


# TRL 1.16 GRPOConfig fields (with TrainingArguments') grpokit has no equivalent for, with TRL's
# defaults; each is accepted at its default only.
REFUSED: dict[str, Any] = {
    "lr_scheduler_kwargs": None, "optim_args": None, "optim_target_modules": None,
    "average_tokens_across_devices": True, "label_smoothing_factor": 0.0, "bf16_full_eval": False,
    "fp16_full_eval": False, "tf32": None, "activation_checkpointing": None, "activation_checkpointing_kwargs": None,
    "gradient_checkpointing_kwargs": None, "torch_compile": False, "torch_compile_backend": None,
    "torch_compile_mode": None, "liger_kernel_config": None, "use_cache": False,
    "neftune_noise_alpha": None, "torch_empty_cache_steps": None, "auto_find_batch_size": False,
    "logging_strategy": "steps", "logging_first_step": False, "log_on_each_node": True, "logging_nan_inf_filter": True,
    "include_num_input_tokens_seen": "no", "log_level": "passive", "log_level_replica": "warning", "run_name": None,
    "project": "huggingface", "trackio_space_id": None, "trackio_bucket_id": None, "trackio_static_space_id": None,
    "eval_delay": 0, "prediction_loss_only": False, "eval_on_start": False, "eval_do_concat_batches": True,
    "eval_use_gather_object": False, "eval_accumulation_steps": None, "include_for_metrics": [],
    "batch_eval_metrics": False, "save_only_model": False, "save_on_each_node": False, "enable_jit_checkpoint": False,
    "push_to_hub": False, "hub_token": None, "hub_private_repo": None, "hub_model_id": None,
    "hub_strategy": "every_save", "hub_always_push": False, "hub_revision": None, "ignore_data_skip": False,
    "restore_callback_states_from_checkpoint": False, "full_determinism": False,
    "parallelism_config": None, "dataloader_drop_last": False,
    "dataloader_multiprocessing_context": None, "dataloader_in_order": True, "label_names": None,
    "train_sampling_strategy": "random", "length_column_name": "length", "ddp_find_unused_parameters": None,
    "ddp_bucket_cap_mb": None, "ddp_broadcast_buffers": None, "ddp_static_graph": None, "ddp_backend": None,
    "ddp_timeout": 1800, "fsdp": None, "fsdp_config": None, "deepspeed": None, "debug": "", "skip_memory_metrics": True,
    "data_seed": None, "resume_from_checkpoint": None, "trust_remote_code": False, "router_aux_loss_coef": None,
    "cast_lm_head_to_fp32": False, "ds3_gather_for_generation": True, "min_p": None,
    "chat_template_kwargs": None, "repetition_penalty": 1.0, "cache_implementation": None,
    "vllm_model_impl": "vllm", "vllm_structured_outputs_regex": None, "vllm_group_port": 51216,
    "vllm_tensor_parallel_size": 1, "log_multimodal": True,
    "num_completions_to_print": None, "log_unique_prompts": False, "log_completions_hub_repo": None,
    "use_transformers_continuous_batching": False, "transformers_continuous_batching_config": None,
    "use_transformers_paged": False,
}

# What the ConfigError says about some refused fields: the way to get what they ask for.
REFUSED_WHY = {
    "eval_on_start": "grpokit evaluates after training steps only; call trainer.evaluate() before trainer.train()",
    "eval_delay": "grpokit evaluates every eval_steps from the start",
    "bf16_full_eval": "grpokit evaluates in the dtype it trains in", "fp16_full_eval": "grpokit evaluates in the "
    "dtype it trains in",
}

SUPPORTED = tuple(f.name for f in dataclasses.fields(_Supported))


def refused_field(default):
    return field(default_factory=list) if isinstance(default, list) else field(default=default)


GRPOConfig = dataclasses.make_dataclass(
    "GRPOConfig", [(name, Any, refused_field(default)) for name, default in REFUSED.items()], bases=(_Supported,),
    namespace={"__module__": __name__, "__doc__": "TRL 1.16's GRPOConfig arguments, for grpokit.trl.GRPOTrainer: "
               "the fields in SUPPORTED map onto grpokit's Config; those in REFUSED are accepted at TRL's default "
               "only. See the module docstring and docs/TRL.md."})
