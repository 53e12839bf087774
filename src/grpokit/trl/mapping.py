"""TRL's GRPOConfig -> grpokit's Config, field by field, with the same meaning.

Batch. TRL's `per_device_train_batch_size` counts answers (completions), not prompts. One generation
batch holds `generation_batch_size = per_device_train_batch_size * world * steps_per_generation` answers
(`steps_per_generation` defaults to `gradient_accumulation_steps`), that is `generation_batch_size /
num_generations` prompts; one optimizer step takes `per_device_train_batch_size * world *
gradient_accumulation_steps` of them, in micro-batches of `per_device_train_batch_size` per process;
the batch is reused `num_iterations` times. grpokit's step is one generation batch, so:

    rollout.group_size     = num_generations
    train.prompts_per_step = generation_batch_size / num_generations
    train.minibatch_size   = per_device_train_batch_size * world * gradient_accumulation_steps (0 when it is
                             the whole generation batch)
    train.micro_batch_size = per_device_train_batch_size (0 when gradient_accumulation_steps = 1)
    train.steps            = max_steps / (num_iterations * steps_per_generation / gradient_accumulation_steps)

TRL's `max_steps`, `save_steps`, `eval_steps`, `warmup_steps` and `logging_steps` count optimizer
steps; they are converted, and a count that is not a whole number of generation batches is refused:

    eval.every = eval_steps / (num_iterations * steps_per_generation / gradient_accumulation_steps) With `max_steps`
unset, `num_train_epochs` over the dataset gives the count, as TRL's Trainer computes it (TRL's sampler
drops the last incomplete batch of prompts of each pass).

Semantics TRL fixes and grpokit leaves open are set to TRL's: the group std is Bessel-corrected
(`algorithm.std = "sample"`; grpokit's own default is the population std), the KL term is multiplied by
the ratio (`use_bias_correction_kl`, on by default in TRL, `algorithm.kl_bias_correction`; off by default
in grpokit), and the model loads in the dtype its config.json names (TRL's `dtype="auto"`; grpokit's own
default is float32). Adam's betas are TRL's (0.9, 0.999); grpokit's own default is (0.9, 0.99).
"""

from __future__ import annotations

import math

from grpokit.config.evaluation import EvalConfig
from grpokit.config.schema import (
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    OutputConfig,
    RewardConfig,
    RolloutConfig,
    ToolsConfig,
    TrainConfig,
)
from grpokit.errors import ConfigError
from grpokit.trl.config import best_metric, report_to_list

DATA_PATH = "train_dataset"  # what the run's config.toml names as the data source (the rows come from Python)
KEEP_ALL = 1_000_000  # save_total_limit = None: keep every checkpoint


def optimizer_steps_per_generation(args) -> int:
    """TRL optimizer steps per grpokit step (one generation batch, used num_iterations times)."""
    spg, ga = args.steps_per_generation, args.gradient_accumulation_steps
    if spg % ga:
        raise ConfigError(f"steps_per_generation ({spg}) must be a multiple of gradient_accumulation_steps ({ga}) "
                          "in grpokit: one optimizer step never spans two generation batches")
    return args.num_iterations * spg // ga


def total_optimizer_steps(args, num_rows: int | None) -> int:
    """TRL's max_steps: given, or num_train_epochs over the dataset as TRL's Trainer computes it."""
    if args.max_steps > 0:
        return args.max_steps
    if num_rows is None:
        raise ConfigError("max_steps: train_dataset has no length (an iterable dataset), so num_train_epochs cannot "
                          "give the number of steps; set max_steps")
    prompts = args.generation_batch_size // args.num_generations
    batches = num_rows // prompts  # TRL's RepeatSampler drops the last incomplete batch of prompts
    if batches < 1:
        raise ConfigError(f"train_dataset has {num_rows} prompts, fewer than one generation batch of {prompts} "
                          "(generation_batch_size / num_generations); add prompts or lower the batch")
    return math.ceil(args.num_train_epochs * batches * optimizer_steps_per_generation(args))


def _in_steps(name: str, value: int, per_step: int) -> int:
    if value % per_step:
        raise ConfigError(f"{name}={value} optimizer steps is not a whole number of generation batches "
                          f"({per_step} optimizer steps each: num_iterations * steps_per_generation / "
                          f"gradient_accumulation_steps); use a multiple of {per_step}")
    return value // per_step


def _absolute(value: float, total: int) -> int:
    """A TrainingArguments step count: a ratio of the total below 1 (transformers' rule)."""
    return math.ceil(value * total) if 0 < value < 1 else int(value)


def grpokit_config(args, *, model_path: str, dtype: str, lora: dict | None = None,
                   num_rows: int | None = None, num_eval_rows: int | None = None) -> Config:
    """The grpokit Config that runs what `args` (a grpokit.trl.GRPOConfig) describes. `dtype` is the
    dtype the model loads in (trainer.py resolves TRL's rules), `lora` the mapped peft_config,
    `num_rows` / `num_eval_rows` the lengths of train_dataset / eval_dataset."""
    _check_precision(args, dtype)
    per_step = optimizer_steps_per_generation(args)
    total = total_optimizer_steps(args, num_rows)
    steps = _in_steps("max_steps", total, per_step)
    world, ga = args.world_size, args.gradient_accumulation_steps
    generation = args.generation_batch_size
    minibatch = args.per_device_train_batch_size * world * ga
    schedule = "cosine" if args.lr_scheduler_type == "cosine" else "constant"  # both count optimizer steps
    warmup = 0 if args.lr_scheduler_type == "constant" else _absolute(args.warmup_steps, total)  # TRL: none
    save = 0 if args.save_strategy == "no" else _in_steps("save_steps", _absolute(args.save_steps, total), per_step)
    report = report_to_list(args.report_to)
    return Config(
        model=ModelConfig(path=model_path, dtype=dtype, device="cpu" if args.use_cpu else "auto", lora=lora or {}),
        data=DataConfig(path=DATA_PATH, seed=args.seed, shuffle=args.shuffle_dataset),
        rewards=RewardConfig(aggregation=args.multi_objective_aggregation),  # weights: set by trainer.py
        rollout=RolloutConfig(
            group_size=args.num_generations, max_new_tokens=args.max_completion_length,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, stop_strings=stop_strings(args),
            engine="vllm" if args.use_vllm else "hf", vllm=_vllm_options(args) if args.use_vllm else {}),
        algorithm=AlgorithmConfig(
            loss_type=args.loss_type, beta=args.beta, epsilon=args.epsilon, epsilon_high=args.epsilon_high or 0.0,
            delta=args.delta or 0.0, scale_rewards=args.scale_rewards, std="sample",
            importance_sampling_level=args.importance_sampling_level, num_iterations=args.num_iterations,
            mask_truncated_completions=args.mask_truncated_completions, top_entropy_quantile=args.top_entropy_quantile,
            kl_bias_correction=args.use_bias_correction_kl, sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg, vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg, off_policy_mask_threshold=args.off_policy_mask_threshold or 0.0,
            **_entropy(args), **_mismatch(args),
            ref_sync_every=_in_steps("ref_model_sync_steps", args.ref_model_sync_steps, per_step)
            if args.sync_ref_model else 0, ref_mixup_alpha=args.ref_model_mixup_alpha),
        train=TrainConfig(
            steps=steps, prompts_per_step=generation // args.num_generations,
            minibatch_size=0 if minibatch == generation else minibatch,
            micro_batch_size=0 if ga == 1 else args.per_device_train_batch_size,
            learning_rate=args.learning_rate, weight_decay=0.0, adam_betas=(args.adam_beta1, args.adam_beta2),
            warmup_steps=warmup, lr_schedule=schedule, max_grad_norm=args.max_grad_norm, seed=args.seed,
            gradient_checkpointing=args.gradient_checkpointing),
        output=OutputConfig(
            dir=args.output_dir, save_every=save,
            keep_last=KEEP_ALL if args.save_total_limit is None else args.save_total_limit,
            overwrite=True,  # TRL writes into an existing output_dir; grpokit removes only what it wrote there
            completions_every=max(1, round(_absolute(args.logging_steps, total) / per_step))
            if args.log_completions else 0,
            console=not args.disable_tqdm, tensorboard="tensorboard" in report, wandb="wandb" in report,
            keep_best=best_metric(args) if args.load_best_model_at_end and args.eval_strategy == "steps" else ""),
        eval=eval_config(args, total, per_step, num_eval_rows),
        tools=ToolsConfig(max_calls=args.max_tool_calling_iterations or args.max_completion_length),
    )


def eval_config(args, total: int, per_step: int, num_eval_rows: int | None) -> EvalConfig:
    """TRL's evaluation during training as grpokit's [eval]: every eval_steps optimizer steps (converted to
    generation batches like save_steps), each prompt of eval_dataset answered num_generations_eval times at
    the training temperature. grpokit also evaluates after the last step."""
    if args.eval_strategy != "steps":
        return EvalConfig()
    if not num_eval_rows:
        raise ConfigError("eval_strategy='steps': evaluation needs held-out prompts; pass eval_dataset (rows with "
                          "a 'prompt' column), or set eval_strategy='no'")
    return EvalConfig(every=_in_steps("eval_steps", _absolute(args.eval_steps, total), per_step),
                      num_prompts=num_eval_rows, samples_per_prompt=args.num_generations_eval or args.num_generations,
                      temperature=args.temperature, seed=args.seed)


def stop_strings(args) -> tuple[str, ...]:
    """generation_kwargs' stop strings (`stop_strings`, transformers' name, or `stop`, vLLM's); config.py
    refuses every other key."""
    kwargs = args.generation_kwargs or {}
    value = kwargs.get("stop_strings", kwargs.get("stop")) or ()
    return (value,) if isinstance(value, str) else tuple(value)


def _entropy(args) -> dict:
    """TRL's entropy bonus and its adaptive controller (`use_adaptive_entropy`): the same fields, with TRL's
    aggregation of the bonus (the plain token mean, for every loss type)."""
    fields = {"entropy_coef": args.entropy_coef}
    if args.entropy_coef or args.use_adaptive_entropy:
        fields["entropy_aggregation"] = "token_mean"
    if args.use_adaptive_entropy:
        fields.update(adaptive_entropy=True, entropy_target=args.entropy_target, entropy_coef_min=args.entropy_coef_min,
                      entropy_coef_max=args.entropy_coef_max, entropy_coef_delta=args.entropy_coef_delta)
    return fields


def _mismatch(args) -> dict:
    """TRL corrects the vLLM sampler's log-probs (`vllm_importance_sampling_*`) only with use_vllm; None bounds
    are grpokit's 0 (no bound on that side)."""
    if not (args.use_vllm and args.vllm_importance_sampling_correction):
        return {"is_correction": "none"}
    return {"is_correction": args.vllm_importance_sampling_mode,
            "is_cap_max": args.vllm_importance_sampling_clip_max or 0.0,
            "is_cap_min": args.vllm_importance_sampling_clip_min or 0.0}


def _vllm_options(args) -> dict:
    if args.vllm_mode == "server":  # vLLM's own server (grpokit serve): its settings are given where it starts
        host = "localhost" if args.vllm_server_host in ("0.0.0.0", "::") else args.vllm_server_host
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        return {"server": args.vllm_server_base_url or f"http://{host}:{args.vllm_server_port}",
                "server_timeout_s": float(args.vllm_server_timeout)}
    options = {"gpu_memory_utilization": args.vllm_gpu_memory_utilization,
               "enable_sleep_mode": args.vllm_enable_sleep_mode}
    if args.vllm_max_model_length is not None:
        options["max_model_len"] = args.vllm_max_model_length
    return options


def _check_precision(args, dtype: str) -> None:
    """TRL's bf16/fp16 are mixed precision (autocast over the loaded weights); grpokit computes in the
    weights' own dtype, so they mean the same only when the weights already are in that dtype."""
    for flag, wanted in (("bf16", "bfloat16"), ("fp16", "float16")):
        if getattr(args, flag) and dtype != wanted:
            raise ConfigError(f"{flag}=True: grpokit has no mixed precision, it computes in the dtype the weights "
                              f"load in ({dtype} here); load them in {wanted} with model_init_kwargs={{'dtype': "
                              f"'{wanted}'}} (no float32 master weights then), or leave {flag} unset")


def lora_options(peft_config, model_type: str | None, *, field: str = "peft_config", allowed: tuple = ()) -> dict:
    """A peft LoraConfig as grpokit's model.lora ({r, alpha, target_modules}); any other LoraConfig field
    set away from peft's default is refused (but those in `allowed`: a given PeftModel's lora_dropout, off in
    grpokit's eval-mode training as all dropout is). target_modules=None means peft's default for the
    architecture (what `get_peft_model` picks), not grpokit's "all-linear"."""
    from peft import LoraConfig
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT_TARGETS

    if not isinstance(peft_config, LoraConfig):
        raise ConfigError(f"{field}: grpokit trains LoRA adapters only, got {type(peft_config).__name__}")
    mapped = {"r", "lora_alpha", "target_modules", "task_type", "base_model_name_or_path", "revision",
              "inference_mode", "peft_type", "auto_mapping", *allowed}
    default = LoraConfig()
    other = [f"{name}={getattr(peft_config, name)!r}" for name in vars(default)
             if name not in mapped and not name.startswith("_")
             and getattr(peft_config, name, None) != getattr(default, name)]
    if peft_config.task_type not in (None, "CAUSAL_LM"):
        other.append(f"task_type={peft_config.task_type!r}")
    if other:
        raise ConfigError(f"{field}: grpokit's LoRA takes r, lora_alpha and target_modules only (no dropout, "
                          f"bias or variants); leave these at peft's default: {', '.join(other)}")
    targets = peft_config.target_modules
    if targets is None:
        if model_type not in DEFAULT_TARGETS:
            raise ConfigError(f"{field}.target_modules: peft has no default for model type {model_type!r}; "
                              "name the modules")
        targets = DEFAULT_TARGETS[model_type]
    targets = targets if isinstance(targets, str) else sorted(targets)
    return {"r": int(peft_config.r), "alpha": float(peft_config.lora_alpha), "target_modules": targets}
