"""What a TRL user reads after `train()`: `trainer.state`, its `log_history`, the returned `TrainOutput`,
and `trainer.accelerator` (the few members TRL's own scripts use).

TRL's rows, as its GRPOTrainer logs them (transformers' Trainer.log): one per logging step with `loss`,
`grad_norm`, `learning_rate`, `reward`, `reward_std`, `frac_reward_zero_std`, `rewards/<name>/mean`,
`completions/*`, `entropy`, `clip_ratio/*`, `kl` (beta > 0), `num_tokens`, `step_time`, `epoch` and `step`
(the optimizer step); one per evaluation with `eval_*`; and a last one with `train_runtime`,
`train_samples_per_second`, `train_steps_per_second`, `total_flos`, `train_loss`. grpokit's metrics rows
already use TRL's names for what both compute; here each becomes such a row: `step` in TRL's optimizer
steps (a grpokit step is one generation batch), `time/step` as `step_time`, the `eval/...` columns of a
step as its own `eval_...` row (`eval/mean_reward` is `eval_reward`, and `eval_num_tokens` the step's
`num_tokens`, as TRL logs its unchanged count there), and grpokit's other columns kept as they are.
`total_flos` is 0.0: grpokit does not count FLOPs (TRL's GRPO trainer reports 0.0 on its inputs too).
"""

from __future__ import annotations

import math
import os

from grpokit.trl.mapping import optimizer_steps_per_generation

_EXTREMES = (("clip_ratio/low_mean", "clip_ratio/low_min"), ("clip_ratio/high_mean", "clip_ratio/high_max"))
_EVAL_NAMES = {"eval/mean_reward": "eval_reward", "time/eval": "eval_runtime"}


def new_state(args, max_steps: int = 0):
    """transformers' TrainerState, as TRL's trainer holds it before training."""
    from transformers import TrainerState

    rank = int(os.environ.get("RANK", "0"))
    return TrainerState(max_steps=max_steps, logging_steps=args.logging_steps, eval_steps=args.eval_steps or 500,
                        save_steps=args.save_steps, train_batch_size=args.per_device_train_batch_size,
                        num_train_epochs=math.ceil(args.num_train_epochs), log_history=[],
                        is_local_process_zero=int(os.environ.get("LOCAL_RANK", "0")) == 0,
                        is_world_process_zero=rank == 0)


def epoch_at(config, step: int, num_rows: int) -> float:
    """The epoch after `step` grpokit steps (prompts used / rows, as TRL's Trainer counts it)."""
    return step * config.train.prompts_per_step / max(num_rows, 1)


def log_rows(rows: list[dict], args, config, num_rows: int) -> list[dict]:
    """grpokit's metrics rows as TRL's log_history rows (training rows, then each evaluation's row)."""
    per_step = optimizer_steps_per_generation(args)
    out = []
    for row in rows:
        step = int(row.get("step", 0))
        epoch = epoch_at(config, step, num_rows)
        train = {k: v for k, v in row.items() if k != "step" and not k.startswith("eval/") and k != "time/eval"}
        if "time/step" in train:
            train["step_time"] = train["time/step"]
        if args.world_size == 1:  # TRL's min / max over processes of each one's clip ratio: one process, its own
            train.update({extreme: train[mean] for mean, extreme in _EXTREMES if mean in train})
        out.append({**train, "epoch": epoch, "step": step * per_step})
        evaluated = {k: v for k, v in row.items() if k.startswith("eval/") or k == "time/eval"}
        if evaluated:
            renamed = {_EVAL_NAMES.get(k, "eval_" + k.removeprefix("eval/")): v for k, v in evaluated.items()}
            if "num_tokens" in row:
                renamed["eval_num_tokens"] = row["num_tokens"]
            out.append({**renamed, "epoch": epoch, "step": step * per_step})
    return out


def tokens_seen(rows: list[dict]) -> int:
    """TrainerState.num_input_tokens_seen after these rows: the last row's `num_tokens` (0 without one)."""
    counts = [r["num_tokens"] for r in rows if isinstance(r.get("num_tokens"), (int, float))]
    return int(counts[-1]) if counts else 0


# The keys TRL's trainer averages between two log calls (its `_metrics`): the last row gets those of the steps
# after the last logging step, as TRL's final log merges what it has gathered since
_GATHERED = ("reward", "reward_std", "frac_reward_zero_std", "entropy", "kl", "num_tokens", "policy_loss",
             "entropy_coef", "aux_loss", "step_time", "cispo_clip_ratio")
_GATHERED_PREFIXES = ("rewards/", "completions/", "clip_ratio/", "tools/", "sampling/", "vespo/")


def since_last_log(rows: list[dict], args, total_steps: int) -> dict:
    """TRL's metrics in the last log_history row: the mean of each gathered key over the training rows (`log_rows`'
    shape, `step` in optimizer steps) after the last multiple of `logging_steps` (a ratio below 1 of the total, as
    transformers reads it); none when the run ends on a logging step. NaNs are left out; None when all are."""
    every = math.ceil(args.logging_steps * total_steps) if 0 < args.logging_steps < 1 else int(args.logging_steps)
    last_logged = total_steps - total_steps % every if every > 0 else total_steps
    columns: dict[str, list[float]] = {}
    for row in rows:
        if row["step"] <= last_logged or any(k.startswith("eval_") for k in row):
            continue
        for key, value in row.items():
            if (key in _GATHERED or key.startswith(_GATHERED_PREFIXES)) and isinstance(value, (int, float)):
                columns.setdefault(key, []).append(float(value))
    means = {}
    for key, values in columns.items():
        finite = [v for v in values if not math.isnan(v)]
        means[key] = sum(finite) / len(finite) if finite else None
    return means


def summary(rows: list[dict], args, config, num_rows: int, runtime: float, steps_run: int) -> dict:
    """TRL's end-of-training metrics (the TrainOutput's; the last log_history row adds total_flos)."""
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    per_step = optimizer_steps_per_generation(args)
    optimizer_steps = steps_run * per_step
    samples = optimizer_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    speed = {} if runtime <= 0 else {"train_samples_per_second": round(samples / runtime, 3),
                                     "train_steps_per_second": round(optimizer_steps / runtime, 3)}
    return {"train_runtime": round(runtime, 4), **speed,
            "train_loss": sum(losses) / len(losses) if losses else float("nan"),
            "epoch": epoch_at(config, config.train.steps, num_rows)}


class Accelerator:
    """The members of accelerate's `Accelerator` that TRL's scripts call on `trainer.accelerator`, for the
    process grpokit runs in (torchrun's environment; alone: process 0 of 1). grpokit does not use Accelerate:
    anything else is an AttributeError naming this."""

    def __init__(self, device: str):
        import torch

        self.process_index = int(os.environ.get("RANK", "0"))
        self.local_process_index = int(os.environ.get("LOCAL_RANK", "0"))
        self.num_processes = int(os.environ.get("WORLD_SIZE", "1"))
        self.device = torch.device(device)

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    def print(self, *args, **kwargs) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True):
        return model

    def __getattr__(self, name: str):
        raise AttributeError(f"trainer.accelerator.{name}: grpokit does not run on Accelerate; its trainer.accelerator "
                             "has is_main_process, is_local_main_process, process_index, local_process_index, "
                             "num_processes, device, print, wait_for_everyone and unwrap_model")
