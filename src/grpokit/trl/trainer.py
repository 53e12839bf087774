"""`GRPOTrainer`: TRL 1.16's constructor and `train()` / `save_model()`, running grpokit's loop.

    from grpokit.trl import GRPOConfig, GRPOTrainer      # instead of: from trl import ...
    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=my_reward,
                          args=GRPOConfig(output_dir="out", max_steps=100), train_dataset=dataset)
    trainer.train()
    trainer.save_model()

- `model`: a local folder or a Hub id (grpokit's own loading: `models/loading.py`), or an already
  loaded `PreTrainedModel`. grpokit trains from a folder, so an object is written (`save_pretrained`,
  with its tokenizer) to `<output_dir>/trl-model/` and loaded from there; so is a folder given with
  another `processing_class` (its other files are linked, not copied). A peft model object is refused:
  pass the base model and `peft_config`.
- `reward_funcs`: a callable, a reward model (a folder, a Hub id or a sequence-classification
  `PreTrainedModel`, trl/rewards.py), or a list of them, as in TRL. Functions get `prompts`,
  `completions`, `completion_ids` and the dataset's other columns; TRL's `log_metric` values reach the
  step's metrics, `trainer_state` is None and `log_extra` does nothing. `reward_processing_classes`:
  the reward models' tokenizers, as in TRL.
- `train_dataset`: a `datasets.Dataset` or a list of dicts with a "prompt" column (text or chat
  messages); the other columns reach the reward functions.
- `eval_dataset`: the same; with `eval_strategy="steps"` grpokit's `[eval]` scores it every `eval_steps`
  (trl/mapping.py), and `trainer.evaluate()` scores it on demand (trl/evaluation.py).
- `peft_config`: a peft `LoraConfig` -> `model.lora` (trl/mapping.py `lora_options`).
- `tools`, `environment_factory`: passed to grpokit's `train` unchanged (docs/TOOLS.md).
- `callbacks`, `optimizers`, `quantization_config`, `rollout_func`: refused when given.

`train()` returns transformers' `TrainOutput` (global_step in TRL's optimizer steps, the mean loss);
`trainer.state.log_history` holds grpokit's metrics rows (evaluations: their `eval/...` columns), and
with `load_best_model_at_end` `trainer.state.best_metric` / `best_global_step` / `best_model_checkpoint`
come from best.json and `trainer.model` / `save_model()` are the best checkpoint's; `trainer.run_dir` is
the run folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

from grpokit.errors import ConfigError
from grpokit.trl.config import GRPOConfig
from grpokit.trl.evaluation import best_checkpoint, run_evaluation
from grpokit.trl.mapping import grpokit_config, lora_options, optimizer_steps_per_generation
from grpokit.trl.rewards import processing_classes, reward_callables, reward_list, training_device

MODEL_FOLDER = "trl-model"  # under output_dir: a model object (or a folder with another tokenizer) saved for grpokit
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja",
                    "chat_template.json"}
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "torch.float32": "float32",
                "torch.bfloat16": "bfloat16", "torch.float16": "float16", "fp32": "float32", "bf16": "bfloat16",
                "fp16": "float16"}


class GRPOTrainer:
    """TRL 1.16's GRPOTrainer arguments, run by grpokit (see the module docstring)."""

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None):
        given = {"callbacks": callbacks, "quantization_config": quantization_config, "rollout_func": rollout_func}
        refused = [name for name, value in given.items() if value is not None]
        refused += ["optimizers"] if tuple(optimizers or (None, None)) != (None, None) else []
        if refused:
            raise ConfigError(f"GRPOTrainer: grpokit does not support {', '.join(refused)} (docs/TRL.md); leave "
                              f"{'it' if len(refused) == 1 else 'them'} unset")
        if args is None:
            args = GRPOConfig(output_dir=f"{_model_name(model).split('/')[-1]}-GRPO")  # TRL's default
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a grpokit.trl.GRPOConfig (same arguments as TRL's), got "
                            f"{type(args).__module__}.{type(args).__name__}")
        self.args = args
        funcs = reward_list(reward_funcs, environment_factory)
        reward_classes = processing_classes(reward_processing_classes, len(funcs))
        self.train_dataset, self.rows = train_dataset, _rows(train_dataset, args.remove_unused_columns)
        self.eval_dataset, self.eval_rows = eval_dataset, _eval_rows(eval_dataset, args, environment_factory)
        self.tools, self.environment_factory = tools, environment_factory
        path, dtype, model_type = _model_folder(model, processing_class, args)
        lora = lora_options(peft_config, model_type) if peft_config is not None else None
        self.config = grpokit_config(args, model_path=path, dtype=dtype, lora=lora, num_rows=len(self.rows),
                                     num_eval_rows=len(self.eval_rows) if self.eval_rows is not None else None)
        if args.reward_weights is not None:
            self.config = _with_weights(self.config, args.reward_weights, len(funcs))
        # Reward models load last, once every check has passed (TRL loads them in its constructor too).
        self.reward_funcs = reward_callables(funcs, reward_classes, dtype=_reward_dtype(args),
                                             device=training_device(self.config.model.device)) or None
        self._given_model, self._given_tokenizer = model, processing_class
        self._trained_model = None
        self.run_dir: Path | None = None
        self.state = SimpleNamespace(global_step=0, log_history=[], best_metric=None, best_global_step=None,
                                     best_model_checkpoint=None)

    # ---- TRL's methods -------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: bool | str | None = None, trial=None, ignore_keys_for_eval=None):
        """Run grpokit's loop; returns transformers' TrainOutput. `resume_from_checkpoint=True` continues
        from the newest checkpoint in output_dir (a checkpoint path is refused: grpokit resumes the newest)."""
        from transformers.trainer_utils import TrainOutput

        from grpokit.observe.tracking import read_metrics
        from grpokit.training.loop import train

        if trial is not None or ignore_keys_for_eval is not None:
            raise ConfigError("GRPOTrainer.train: trial and ignore_keys_for_eval are not supported")
        if isinstance(resume_from_checkpoint, str):
            raise ConfigError("GRPOTrainer.train(resume_from_checkpoint=...): grpokit resumes from the newest "
                              "checkpoint in output_dir; pass True")
        started = time.perf_counter()
        self.run_dir = train(self.config, reward_functions=self.reward_funcs, rows=self.rows,
                             resume=bool(resume_from_checkpoint), tools=self.tools,
                             environment_factory=self.environment_factory,
                             eval_rows=self.eval_rows if self.config.eval.every else None)
        self._trained_model = None
        rows = read_metrics(self.run_dir)
        losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
        loss = sum(losses) / len(losses) if losses else float("nan")
        per_step = optimizer_steps_per_generation(self.args)
        step = self.config.train.steps * per_step
        best = best_checkpoint(self.run_dir) if self.config.output.keep_best else None
        checkpoint, record = best or (None, {})
        self.state = SimpleNamespace(global_step=step, log_history=rows, best_metric=record.get("value"),
                                     best_global_step=record["step"] * per_step if best else None,
                                     best_model_checkpoint=str(checkpoint) if best else None)
        runtime = time.perf_counter() - started
        return TrainOutput(step, loss, {"train_runtime": runtime, "train_loss": loss, "epoch": None})

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Score the current model (the trained one after train(), else the one given) on eval_dataset (default:
        the trainer's) with grpokit's evaluation (trl/evaluation.py); returns TRL-named metrics: `eval_reward`
        (the mean total reward of num_generations_eval answers per prompt), `eval_accuracy` (answers whose
        reward reaches 1.0), `eval_pass@K`, `eval_runtime`. Every process evaluates all of the rows."""
        if ignore_keys is not None:
            raise ConfigError("GRPOTrainer.evaluate(ignore_keys=...): not supported (grpokit returns no model outputs)")
        rows = self.eval_rows if eval_dataset is None else _eval_rows(eval_dataset, self.args, None)
        if rows is None:
            raise ConfigError("GRPOTrainer.evaluate: no eval_dataset; pass one here or to "
                              "GRPOTrainer(eval_dataset=...)")
        if self.run_dir is None:
            from grpokit.models.loading import load_model

            model = load_model(self.config.model.path, dtype=self.config.model.dtype, device=self.config.model.device)
        else:
            model = self.model
        metrics = run_evaluation(self, model, rows, metric_key_prefix)
        self.state.log_history.append({**metrics, "step": self.state.global_step})
        return metrics

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the trained model (the final checkpoint's weights and tokenizer, or the best one's with
        load_best_model_at_end; with LoRA the adapter, as TRL's peft save does) to output_dir (default:
        args.output_dir)."""
        target = Path(output_dir or self.args.output_dir)
        final = self._result_checkpoint()
        target.mkdir(parents=True, exist_ok=True)
        if self.config.model.lora:
            files = [*(final / "adapter").iterdir(), *(p for p in final.iterdir() if p.name in _TOKENIZER_FILES)]
        else:
            files = [p for p in final.iterdir() if p.is_file() and p.name not in ("trainer_state.pt",
                                                                                    "grpokit_config.toml")]
        for p in files:
            if p.is_file():
                shutil.copy2(p, target / p.name)

    @property
    def model(self):
        """Before train(): the model given; after: the trained model, loaded from the final checkpoint (with
        load_best_model_at_end, the best one's, as transformers' Trainer loads it at the end)."""
        if self.run_dir is None:
            return self._given_model
        if self._trained_model is None:
            from grpokit.models.loading import load_model

            self._trained_model = load_model(self._result_checkpoint(), dtype=self.config.model.dtype,
                                             device=self.config.model.device)
        return self._trained_model

    def _result_checkpoint(self) -> Path:
        """The checkpoint train() leaves as the model: best.json's with load_best_model_at_end (when an
        evaluation scored), else the final one."""
        from grpokit.training.checkpoint import list_checkpoints

        checkpoints = list_checkpoints(self.run_dir) if self.run_dir is not None else []
        if not checkpoints:
            raise ConfigError("GRPOTrainer: nothing trained yet; call trainer.train() first")
        best = best_checkpoint(self.run_dir) if self.args.load_best_model_at_end else None
        return best[0] if best else checkpoints[-1]

    @property
    def processing_class(self):
        if self._given_tokenizer is None:
            from grpokit.models.loading import load_tokenizer

            self._given_tokenizer = load_tokenizer(self.config.model.path)
        return self._given_tokenizer


def _model_name(model) -> str:
    return model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")


def _reward_dtype(args) -> str | None:
    """The dtype reward models given by name load in: model_init_kwargs' (TRL loads them with it too), None
    (the checkpoint's own: transformers' "auto") when it names none."""
    kwargs = args.model_init_kwargs or {}
    wanted = kwargs.get("dtype", kwargs.get("torch_dtype", "auto"))
    return None if str(wanted) == "auto" else _dtype(wanted)


def _eval_rows(dataset, args, environment_factory) -> list[dict] | None:
    """eval_dataset's rows (None without one); eval_strategy='steps' needs them, as in transformers."""
    if dataset is None:
        if args.eval_strategy != "no":
            raise ConfigError(f"eval_strategy={args.eval_strategy!r} needs an eval_dataset (the held-out prompts); "
                              "pass one, or set eval_strategy='no'")
        return None
    if environment_factory is not None and args.eval_strategy != "no":
        raise ConfigError("eval_dataset: grpokit does not evaluate with environment_factory's environments yet; set "
                          "eval_strategy='no' and evaluate the saved model afterwards")
    if type(dataset) is dict:  # TRL's several named eval datasets (eval_<name>_... metrics)
        raise ConfigError("eval_dataset: grpokit evaluates one dataset, not a dict of them; pass one")
    return _rows(dataset, args.remove_unused_columns, field="eval_dataset")


def _rows(dataset, prompt_only: bool | None, field: str = "train_dataset") -> list[dict]:
    """The dataset's rows as dicts (a datasets.Dataset, or any sized iterable of dicts)."""
    if dataset is None:
        raise ConfigError("GRPOTrainer: train_dataset is required (rows with a 'prompt' column)")
    if type(dataset).__name__ in ("IterableDataset", "IterableDatasetDict", "DatasetDict", "dict") or \
            not hasattr(dataset, "__len__"):
        raise ConfigError(f"{field}: grpokit takes a datasets.Dataset or a list of dicts, not a "
                          f"{type(dataset).__name__} (for a DatasetDict pick a split: dataset['train'])")
    rows = [dict(row) for row in dataset]
    if prompt_only:  # TRL's remove_unused_columns=True: only the prompt reaches the reward functions
        rows = [{"prompt": row["prompt"]} if "prompt" in row else row for row in rows]
    return rows


def _model_folder(model, processing_class, args) -> tuple[str, str, str | None]:
    """The folder grpokit loads (model.path), the dtype it loads in, and the model type."""
    if not isinstance(model, str):
        return _saved_object(model, processing_class, args)
    from grpokit.models.loading import check_model_folder

    folder = check_model_folder(model, field="model")  # a local folder, or a Hub id's cached snapshot
    saved = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    wanted = (args.model_init_kwargs or {}).get("dtype", (args.model_init_kwargs or {}).get("torch_dtype", "auto"))
    dtype = _dtype(saved.get("dtype") or saved.get("torch_dtype") if str(wanted) == "auto" else wanted)
    if processing_class is None:
        return (str(folder) if Path(model).is_dir() else model), dtype, saved.get("model_type")
    merged = _fresh_folder(args)
    processing_class.save_pretrained(str(merged))
    for p in folder.iterdir():  # the model's own files, linked (the tokenizer is the one given)
        if p.name not in _TOKENIZER_FILES and not (merged / p.name).exists():
            _link(p, merged / p.name)
    return str(merged), dtype, saved.get("model_type")


def _saved_object(model, processing_class, args) -> tuple[str, str, str | None]:
    """A loaded PreTrainedModel, written to <output_dir>/trl-model with its tokenizer."""
    if getattr(model, "peft_config", None) is not None:
        raise ConfigError("model: a peft model object is not supported; pass the base model and peft_config")
    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise ConfigError(f"model: give a folder, a Hub id or a transformers PreTrainedModel, not a "
                          f"{type(model).__name__}")
    if args.model_init_kwargs:
        raise ConfigError("model_init_kwargs: the model is already loaded (a PreTrainedModel object); "
                          "model_init_kwargs apply only to a model given by name")
    tokenizer = processing_class
    if tokenizer is None:
        source = getattr(model, "name_or_path", "") or model.config._name_or_path
        if not source:
            raise ConfigError("processing_class: required with a model object that names no folder to load its "
                              "tokenizer from")
        from grpokit.models.loading import load_tokenizer

        tokenizer = load_tokenizer(source, field="model.name_or_path")
    merged = _fresh_folder(args)
    model.save_pretrained(str(merged))
    tokenizer.save_pretrained(str(merged))
    return str(merged), _dtype(model.dtype), getattr(model.config, "model_type", None)


def _fresh_folder(args) -> Path:
    folder = Path(args.output_dir) / MODEL_FOLDER
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder.resolve()


def _link(source: Path, target: Path) -> None:
    try:
        os.symlink(source.resolve(), target, target_is_directory=source.is_dir())
    except OSError:  # a file system without links
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, target)


def _dtype(value) -> str:
    """A dtype as grpokit's model.dtype; None (config.json without one) is transformers' float32."""
    if value is None:
        return "float32"
    name = _DTYPE_NAMES.get(str(value))
    if name is None:
        raise ConfigError(f"model dtype {value!s}: grpokit loads float32, bfloat16 or float16")
    return name


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
