"""TRL's `train_dataset` / `eval_dataset` as the rows grpokit trains and evaluates on.

- `train_dataset`: a `datasets.Dataset` or a list of dicts (held in memory, as grpokit holds every prompt
  table); an `IterableDataset` (streaming): TRL then needs `max_steps`, and so does grpokit, which takes
  the first `max_steps`' worth of prompts from the stream (steps x prompts per step; a shorter stream is
  taken whole and cycled, as a data loader starts a new epoch); None with an `environment_factory`: the
  environment owns the data and its `reset()` gives each prompt, so, as TRL, the rows are one generation
  batch of empty user messages, cycled for `max_steps`.
- `eval_dataset`: the same kinds (an `IterableDataset` is read whole), or a dict of them (a
  `DatasetDict` too): `trainer.evaluate()` scores each and prefixes its metrics with its name, as
  transformers' Trainer does. Evaluation during training (`eval_strategy="steps"`) scores one dataset.
- A `DatasetDict` as `train_dataset` is refused (pick a split), as TRL refuses it.
"""

from __future__ import annotations

import itertools

from grpokit.errors import ConfigError
from grpokit.trl.accepted import accelerator_options

_NAMED = ("DatasetDict", "IterableDatasetDict")


def is_iterable(dataset) -> bool:
    return type(dataset).__name__ == "IterableDataset" or (
        dataset is not None and not hasattr(dataset, "__len__") and not isinstance(dataset, dict)
        and hasattr(dataset, "__iter__"))


def environment_rows(args, environment_factory) -> list[dict]:
    """TRL's placeholder rows when the environment owns the data (one generation batch of empty prompts)."""
    if isinstance(environment_factory, dict):
        raise ConfigError("a dict `environment_factory` (several environments) requires a `train_dataset` with an "
                          "'environment' column routing each row to its environment (TRL's rule); pass one, or a "
                          "single environment factory")
    if args.max_steps <= 0:
        raise ConfigError("max_steps: when training without a train_dataset (the environment owns the data and returns "
                          "the prompt from reset()), max_steps must be set to a positive value to define the training "
                          "length (TRL's rule); set GRPOConfig(max_steps=...)")
    return [{"prompt": [{"role": "user", "content": ""}]} for _ in range(args.generation_batch_size //
                                                                          args.num_generations)]


def train_rows(dataset, args, environment_factory) -> list[dict] | None:
    """The training rows; None for an IterableDataset (read once the run's length is known: `stream_rows`)."""
    if dataset is None:
        if environment_factory is None:
            raise ConfigError("`train_dataset` is required unless an `environment_factory` is provided (TRL's "
                              "words); pass rows with a 'prompt' column")
        return environment_rows(args, environment_factory)
    if type(dataset).__name__ in _NAMED or isinstance(dataset, dict):
        raise ConfigError(f"train_dataset: a {type(dataset).__name__} holds several splits; pick one "
                          "(dataset['train'])")
    if is_iterable(dataset):
        _check_dispatch(args)
        if args.max_steps <= 0:
            raise ConfigError("max_steps must be set to a positive value if dataloader does not have a length "
                              f"(train_dataset is a {type(dataset).__name__}); set GRPOConfig(max_steps=...)")
        return None
    return _as_rows(dataset, args.remove_unused_columns, "train_dataset")


def _check_dispatch(args) -> None:
    """TRL's first check of an iterable dataset: Accelerate's `dispatch_batches=True` would collate the string
    prompts on process 0, so TRL refuses it (and grpokit, which has no Accelerate loader, refuses it alike)."""
    if accelerator_options(getattr(args, "accelerator_config", None)).get("dispatch_batches"):
        raise ConfigError("accelerator_config: Iterable datasets require `dispatch_batches=False`, but it is set to "
                          "`True` (TRL's rule); set it to False, or leave it out")


def stream_rows(dataset, needed: int, prompt_only) -> list[dict]:
    """The first `needed` rows of an iterable dataset (fewer when it ends first)."""
    rows = _as_rows(itertools.islice(iter(dataset), needed), prompt_only, "train_dataset")
    if not rows:
        raise ConfigError("train_dataset: the IterableDataset yielded no rows; give it rows with a 'prompt' column")
    return rows


def eval_sets(dataset, args) -> list[dict] | dict[str, list[dict]] | None:
    """eval_dataset's rows, or {name: rows} for a dict of datasets; None without one. eval_strategy='steps'
    needs them, as in transformers."""
    if dataset is None:
        if args.eval_strategy != "no":
            raise ConfigError(f"eval_strategy={args.eval_strategy!r} needs an eval_dataset (the held-out prompts); "
                              "pass one, or set eval_strategy='no'")
        return None
    if any(is_iterable(d) for d in (dataset.values() if isinstance(dataset, dict) else [dataset])):
        _check_dispatch(args)
    if type(dataset).__name__ in _NAMED or isinstance(dataset, dict):
        if args.eval_strategy != "no":
            raise ConfigError(f"eval_dataset: a dict of {len(dataset)} datasets with eval_strategy="
                              f"{args.eval_strategy!r}: grpokit's evaluation during training scores one dataset; "
                              "pass one here, or set eval_strategy='no' and call trainer.evaluate(), which scores each")
        if not dataset:
            raise ConfigError("eval_dataset: an empty dict; pass a dataset, or {name: dataset, ...}")
        return {str(name): _as_rows(d, args.remove_unused_columns, f"eval_dataset[{name!r}]")
                for name, d in dataset.items()}
    return _as_rows(dataset, args.remove_unused_columns, "eval_dataset")


def _as_rows(dataset, prompt_only, field: str) -> list[dict]:
    """The dataset's rows as dicts (a datasets.Dataset, an IterableDataset, or any iterable of dicts)."""
    if isinstance(dataset, (str, bytes)) or not hasattr(dataset, "__iter__"):
        raise ConfigError(f"{field}: give a datasets.Dataset, an IterableDataset or a list of dicts, not a "
                          f"{type(dataset).__name__}")
    rows = []
    for i, row in enumerate(dataset):
        if not isinstance(row, dict) and not hasattr(row, "keys"):
            raise ConfigError(f"{field}: row {i + 1} is a {type(row).__name__}, not a dict with a 'prompt' column")
        rows.append(dict(row))
    if rows and all("prompt" not in row for row in rows):
        columns = sorted({k for row in rows for k in row})
        raise ConfigError(f"{field}: no 'prompt' column (its columns: {columns}); the trainer reads each prompt from "
                          "'prompt', as TRL's does: rename yours, e.g. dataset = dataset.rename_column(\"question\", "
                          "\"prompt\")")
    if prompt_only:  # TRL's remove_unused_columns=True: only the prompt reaches the reward functions
        rows = [{"prompt": row["prompt"]} if "prompt" in row else row for row in rows]
    return rows
