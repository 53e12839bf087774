"""`GRPOTrainer`: TRL 1.16's trainer object, its methods and what they return, running grpokit's loop.

    from grpokit.trl import GRPOConfig, GRPOTrainer      # instead of: from trl import ...
    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=my_reward,
                          args=GRPOConfig(output_dir="out", max_steps=100), train_dataset=dataset)
    trainer.train()
    trainer.save_model()

As in TRL, the constructor loads the model and tokenizer (trl/models.py): `trainer.model` is the module
(with `peft_config`, the PeftModel), `trainer.processing_class` the tokenizer, and `train()` trains that
object in place with grpokit's loop (`training.loop.train(model=...)`): a reference the user holds sees
the new weights; `trainer.model = other` before `train()` trains the other one. With
`load_best_model_at_end`, the best checkpoint's weights are loaded into it at the end, as transformers does.

- `reward_funcs`: a callable, a reward model (a folder, a Hub id or a sequence-classification
  `PreTrainedModel`, trl/rewards.py), or a list of them, as in TRL; `trainer.reward_func_names` and
  `trainer.reward_processing_classes` as TRL sets them.
- `train_dataset` / `eval_dataset`: Dataset, IterableDataset, a list of dicts; eval also a dict of them;
  no train_dataset with an `environment_factory` (trl/datasets.py).
- `peft_config`: a peft `LoraConfig` -> `model.lora` (trl/mapping.py `lora_options`); TRL's refusals of an
  adapter on `lm_head` and of prompt-learning configs (trl/models.py).
- `tools`, `environment_factory`: passed to grpokit's `train` unchanged (docs/TOOLS.md); a chat template that
  rewrites earlier turns once tool messages follow (Qwen3's) trains on `tools.history = "split"`, chosen here
  with one note line (TRL swaps in a prefix-preserving template; docs/TRL.md says why grpokit does not).
- `callbacks`, `optimizers`, `quantization_config`, `rollout_func`: refused when given.

`train()` returns transformers' `TrainOutput` with TRL's metrics (`train_loss`, `train_runtime`, ...);
`trainer.state` is transformers' `TrainerState` with TRL's `log_history` rows (trl/results.py);
`evaluate()` returns TRL's `eval_loss` and eval metrics (trl/evaluation.py); `trainer.accelerator` and
`is_world_process_zero()` are what TRL's scripts call; `get_train_dataloader()` / `get_eval_dataloader()` and
TRL's rewrite of `args` for iterable datasets are trl/loaders.py's; `trainer.run_dir` is grpokit's run folder.
The reward functions get TRL's `trainer_state` (training/generate.py `reward_trainer_state`; in `evaluate()`,
`trainer.state`).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

from grpokit.errors import ConfigError
from grpokit.rewards.reward_model import is_model_object
from grpokit.trl import datasets, loaders, models, results
from grpokit.trl.accepted import notes
from grpokit.trl.config import GRPOConfig
from grpokit.trl.evaluation import best_checkpoint, run_evaluation
from grpokit.trl.mapping import grpokit_config, optimizer_steps_per_generation
from grpokit.trl.rewards import (
    environment_reward_names,
    processing_classes,
    reward_callables,
    reward_list,
    training_device,
)

MODEL_FOLDER = models.MODEL_FOLDER


class GRPOTrainer:
    """TRL 1.16's GRPOTrainer, run by grpokit (see the module docstring)."""

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None):
        given = {"callbacks": callbacks, "quantization_config": quantization_config, "rollout_func": rollout_func}
        refused = [name for name, value in given.items() if value is not None]
        refused += ["optimizers"] if tuple(optimizers or (None, None)) != (None, None) else []
        if refused:
            raise ConfigError(f"{type(self).__name__}: grpokit does not support {', '.join(refused)} (docs/TRL.md); "
                              f"leave {'it' if len(refused) == 1 else 'them'} unset")
        if args is None:
            args = GRPOConfig(output_dir=f"{_model_name(model).split('/')[-1]}-GRPO")  # TRL's default
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a grpokit.trl.GRPOConfig (same arguments as TRL's), got "
                            f"{type(args).__module__}.{type(args).__name__}")
        self.args = self._grpo_args = args  # AsyncGRPOTrainer: args is its own config, _grpo_args the translation
        environment_rewards = environment_reward_names(environment_factory)
        funcs = reward_list(reward_funcs, environment_rewards)
        reward_classes = processing_classes(reward_processing_classes, len(funcs))
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.rows = datasets.train_rows(train_dataset, args, environment_factory)  # None: an IterableDataset
        self.eval_rows = datasets.eval_sets(eval_dataset, args)
        self.tools, self.environment_factory = tools, environment_factory
        module, tokenizer, path, dtype, lora = models.load(model, processing_class, args, peft_config)
        self.config = self._config_for(args, model_path=path, dtype=dtype, lora=lora,
                                       num_rows=len(self.rows) if self.rows is not None else None,
                                       num_eval_rows=len(self.eval_rows) if isinstance(self.eval_rows, list) else None)
        if self.rows is None:  # streaming: as many prompts as the run uses
            needed = self.config.train.steps * self.config.train.prompts_per_step
            self.rows = datasets.stream_rows(train_dataset, needed, args.remove_unused_columns)
        if args.reward_weights is not None:
            self.config = _with_weights(self.config, args.reward_weights, len(funcs))
        self.config = _history_for(self.config, tokenizer, tools, environment_factory, self.rows)
        device = training_device(self.config.model.device)
        # Models load last, once every check has passed (TRL loads them in its constructor too).
        self.reward_funcs = reward_callables(funcs, reward_classes, dtype=_reward_dtype(args), device=device) or None
        if module is None:
            from grpokit.models.loading import load_model

            module = load_model(path, dtype=dtype, device=device, field="model")
        self.model = models.with_lora(module, lora, args.seed)  # with peft_config: the PeftModel, as TRL's
        self.ref_model = self._reference() if self.config.algorithm.beta > 0 and not lora else None  # TRL's
        self.entropy_coef = args.entropy_coef  # TRL's; with use_adaptive_entropy, the controller's after train()
        self.processing_class = tokenizer
        # TRL's names and classes: reward_funcs', then the rewards the environments own (no processing class)
        self.reward_func_names = [getattr(f, "__name__", type(f).__name__) for f in self.reward_funcs or []] + \
            environment_rewards
        self.reward_processing_classes = [getattr(f, "tokenizer", None) if isinstance(g, str) or is_model_object(g)
                                          else None for f, g in zip(self.reward_funcs or [], funcs)] + \
            [None] * len(environment_rewards)
        self.accelerator = results.Accelerator(device)
        self.run_dir: Path | None = None
        self.state = results.new_state(args)
        if self.accelerator.is_main_process:
            for note in notes(args):
                print(note, flush=True)
        loaders.adjust_args(args, train_dataset, eval_dataset)  # TRL's rewrite of args for iterable datasets

    # ---- TRL's methods -------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: bool | str | None = None, trial=None, ignore_keys_for_eval=None):
        """Train `trainer.model` in place with grpokit's loop; returns transformers' TrainOutput with TRL's
        metrics. `resume_from_checkpoint=True` (or the newest checkpoint's path) continues from the newest
        checkpoint in output_dir."""
        import torch
        from transformers.trainer_utils import TrainOutput

        from grpokit.observe.tracking import read_metrics
        from grpokit.training.loop import train

        if trial is not None or ignore_keys_for_eval is not None:
            raise ConfigError("GRPOTrainer.train: trial and ignore_keys_for_eval are not supported (grpokit has no "
                              "hyper-parameter search); leave them unset")
        if not isinstance(self.model, torch.nn.Module):
            raise ConfigError(f"trainer.model: a {type(self.model).__name__} was assigned; train() trains a torch "
                              "module (a transformers PreTrainedModel or a peft PeftModel of model's architecture): "
                              "assign one, or pass the model to GRPOTrainer(model=...)")
        resume = self._resume(resume_from_checkpoint)
        start = _newest_step(self._grpo_args.output_dir) if resume else 0  # TRL's train metrics: this call's steps
        policy = models.policy_module(self.model)
        policy.to(self.accelerator.device if not self.config.model.fsdp else "cpu")
        started = time.time()
        if self.ref_model is not None:
            self.ref_model.to(self.accelerator.device if not self.config.model.fsdp else "cpu")
        self.run_dir = train(self.config, reward_functions=self.reward_funcs, rows=self.rows, resume=resume,
                             tools=self.tools, environment_factory=self.environment_factory,
                             eval_rows=self.eval_rows if self.config.eval.every else None, model=policy,
                             ref_model=self.ref_model)
        runtime = time.time() - started
        rows = read_metrics(self.run_dir)
        per_step = optimizer_steps_per_generation(self._grpo_args)
        best = best_checkpoint(self.run_dir) if self.config.output.keep_best else None
        self.state = results.new_state(self._grpo_args, max_steps=self.config.train.steps * per_step)
        self.state.global_step = self.config.train.steps * per_step
        self.state.epoch = results.epoch_at(self.config, self.config.train.steps, len(self.rows))
        self.state.log_history = results.log_rows(rows, self._grpo_args, self.config, len(self.rows))
        self.state.num_input_tokens_seen = results.tokens_seen(rows)
        self.entropy_coef = next((r["entropy_coef"] for r in reversed(rows) if "entropy_coef" in r), self.entropy_coef)
        metrics = results.summary([r for r in rows if r.get("step", 0) > start], self._grpo_args, self.config,
                                  len(self.rows), runtime, self.config.train.steps - start)
        gathered = results.since_last_log([r for r in self.state.log_history if r["step"] > start * per_step],
                                          self._grpo_args, self.state.global_step)
        self.state.log_history.append({**{k: v for k, v in metrics.items() if k != "epoch"}, "total_flos": 0.0,
                                       "epoch": metrics["epoch"], **gathered, "step": self.state.global_step})
        if best is not None:
            checkpoint, record = best
            self.state.best_metric, self.state.best_model_checkpoint = record.get("value"), str(checkpoint)
            self.state.best_global_step = record["step"] * per_step
            if self._grpo_args.load_best_model_at_end:  # transformers' _load_best_model: into the model, in place
                from grpokit.training.checkpoint import load_checkpoint_weights

                load_checkpoint_weights(checkpoint, policy)
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Score `trainer.model` on eval_dataset (default: the trainer's; a dict: each, its metrics prefixed
        `<prefix>_<name>_`) with TRL's metric names: `eval_loss`, `eval_reward`, ... (trl/evaluation.py)."""
        if ignore_keys is not None:
            raise ConfigError("GRPOTrainer.evaluate(ignore_keys=...): not supported (grpokit returns no model "
                              "outputs); leave it unset")
        given = SimpleNamespace(eval_strategy="no", remove_unused_columns=self._grpo_args.remove_unused_columns)
        sets = self.eval_rows if eval_dataset is None else datasets.eval_sets(eval_dataset, given)
        if sets is None:
            raise ConfigError("GRPOTrainer.evaluate: no eval_dataset; pass one here or to "
                              "GRPOTrainer(eval_dataset=...)")
        named = sets if isinstance(sets, dict) else {None: sets}
        policy = models.policy_module(self.model)
        out = {}
        for name, rows in named.items():
            prefix = metric_key_prefix if name is None else f"{metric_key_prefix}_{name}"
            metrics = {**run_evaluation(self, policy, rows, prefix), "epoch": self.state.epoch}
            self.state.log_history.append({**metrics, "step": self.state.global_step})
            out.update(metrics)
        return out

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write `trainer.model` and its tokenizer to output_dir (default: args.output_dir), as TRL does: a
        PeftModel writes its adapter. Under FSDP the final checkpoint's files (gathered when it was saved)."""
        target = Path(output_dir or self._grpo_args.output_dir)
        if not self.is_world_process_zero():
            return
        target.mkdir(parents=True, exist_ok=True)
        if self.config.model.fsdp and self.run_dir is not None:
            return self._copy_final(target)
        from grpokit.models.loading import no_progress_bars

        with no_progress_bars():  # transformers' "Writing model shards", off as in grpokit's own saves
            self.model.save_pretrained(str(target))
            self.processing_class.save_pretrained(str(target))

    def get_train_dataloader(self):
        """TRL's: a DataLoader over the training rows in the order grpokit samples them, each prompt
        num_generations times, one generation batch per batch (trl/loaders.py; grpokit's loop does not read it)."""
        return loaders.train_loader(self)

    def get_eval_dataloader(self, eval_dataset=None):
        """TRL's: the eval rows, each num_generations_eval times, in batches of per_device_eval_batch_size; an
        iterable eval set with one worker (trl/loaders.py)."""
        return loaders.eval_loader(self, eval_dataset)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, token=None,
                    revision=None, **kwargs):
        raise ConfigError("GRPOTrainer.push_to_hub: grpokit does not upload to the Hugging Face Hub; save with "
                          "trainer.save_model(folder) and upload it with `hf upload <repo-id> <folder>`")

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process

    # ---- helpers -------------------------------------------------------------------------------

    def _config_for(self, args, **given):
        """grpokit's Config for `args` (AsyncGRPOTrainer adds its asynchronous rollout here, before any load)."""
        return grpokit_config(args, **given)

    def _reference(self):
        """TRL's `trainer.ref_model` (beta > 0, no LoRA): a second copy of the initial weights, loaded as grpokit's
        loop would load its reference, which the loop then uses (moved by `sync_ref_model`, as TRL's is)."""
        from grpokit.models.loading import load_model
        from grpokit.training import vision_setup

        return vision_setup.load_policy_model(self.config, load_model)

    def _resume(self, resume_from_checkpoint) -> bool:
        if not isinstance(resume_from_checkpoint, str):
            return bool(resume_from_checkpoint)
        from grpokit.training.checkpoint import list_checkpoints

        newest = list_checkpoints(self._grpo_args.output_dir)
        if newest and Path(resume_from_checkpoint).resolve() == newest[-1].resolve():
            return True
        raise ConfigError(f"GRPOTrainer.train(resume_from_checkpoint={resume_from_checkpoint!r}): grpokit resumes from "
                          f"the newest checkpoint in output_dir ({newest[-1] if newest else 'none yet'}); pass True")

    def _copy_final(self, target: Path) -> None:
        from grpokit.training.checkpoint import list_checkpoints

        final = list_checkpoints(self.run_dir)[-1]
        if self.config.model.lora:
            files = [*(final / "adapter").iterdir(), *(p for p in final.iterdir() if p.name in models.TOKENIZER_FILES)]
        else:
            files = [p for p in final.iterdir() if p.is_file() and p.name not in ("trainer_state.pt",
                                                                                    "grpokit_config.toml")]
        for p in files:
            if p.is_file():
                shutil.copy2(p, target / p.name)


def _newest_step(output_dir) -> int:
    from grpokit.training.checkpoint import list_checkpoints

    newest = list_checkpoints(output_dir)
    return int(newest[-1].name.rsplit("-", 1)[-1]) if newest else 0


def _model_name(model) -> str:
    if isinstance(model, str):
        return model
    return getattr(getattr(model, "config", None), "_name_or_path", "") or "model"


def _history_for(config, tokenizer, tools, environment_factory, rows):
    """With tools, a chat template that rewrites earlier turns once tool messages follow them (Qwen3's) trains on
    `tools.history = "split"`, chosen here with one note line (TRL swaps in a prefix-preserving template instead:
    docs/TRL.md says why grpokit does not)."""
    from grpokit.models.parallel import rank, world_size
    from grpokit.training.tool_setup import choose_history

    if not tools and environment_factory is None:
        return config
    name = getattr(tools[0], "__name__", "dummy") if tools else "dummy"
    images = bool(rows) and any(k in rows[0] for k in ("image", "images"))  # only "append" takes image rows
    return choose_history(config, tokenizer, name, images=images, world=world_size(), say=rank() == 0)


def _reward_dtype(args) -> str | None:
    """The dtype reward models given by name load in: model_init_kwargs' (TRL loads them with it too), None
    (the checkpoint's own: transformers' "auto") when it names none."""
    wanted = models.wanted_dtype(args)
    return None if str(wanted) == "auto" else models.dtype_name(wanted)


def _with_weights(config, weights, n_functions: int):
    """reward_weights, one per reward function (TRL's rule). grpokit's RewardConfig checks its weights
    against its named functions; here the functions are Python callables, so the weights are set after."""
    weights = tuple(float(w) for w in weights)
    if len(weights) != n_functions:
        raise ConfigError(f"reward_weights has {len(weights)} values for {n_functions} reward functions; give one "
                          "weight per function")
    rewards = dataclasses.replace(config.rewards)
    object.__setattr__(rewards, "weights", weights)  # frozen: the same check, done above against the callables
    return dataclasses.replace(config, rewards=rewards)
