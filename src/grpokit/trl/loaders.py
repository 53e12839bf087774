"""TRL's data-loader side of the trainer: what it does to `args` for an iterable dataset, and
`get_train_dataloader()` / `get_eval_dataloader()`.

grpokit's loop does not read its prompts through a DataLoader (they are tokenized once at start-up and
held in memory), but TRL's trainer has these methods, its scripts and tests call them, and TRL rewrites
`args` for an iterable dataset; the drop-in does the same:

- any iterable dataset (train or eval): `args.accelerator_config` becomes transformers' `AcceleratorConfig`
  with `dispatch_batches=False` (TRL's rule; `True` given is refused earlier, trl/datasets.py);
- an iterable *train* set: `args.dataloader_num_workers` is forced to 0, with TRL's warning as one line
  (several workers would shard the stream and split the groups of num_generations); a map-style train set
  keeps its workers when only the eval set is iterable;
- `get_train_dataloader()`: a DataLoader over the training rows in the order grpokit's loop samples them
  (its seeded prompt stream, this process's share of each generation batch), each prompt `num_generations`
  times, one generation batch (`per_device_train_batch_size × steps_per_generation` rows) per batch, each
  batch `num_iterations × steps_per_generation` times, as TRL's RepeatSampler gives them; the
  `dataloader_*` arguments apply to it;
- `get_eval_dataloader(eval_dataset=None)`: the eval rows, each `num_generations_eval` times, in batches of
  `per_device_eval_batch_size`; an iterable eval set gets one worker for this loader only (`args` unchanged).

Both collate as TRL's identity collator does: a batch is the list of its rows (dicts).
"""

from __future__ import annotations

import sys

from grpokit.errors import ConfigError
from grpokit.trl.accepted import accelerator_options
from grpokit.trl.datasets import _as_rows, _check_dispatch, is_iterable


def adjust_args(args, train_dataset, eval_dataset) -> None:
    """TRL's rewrite of `args` for iterable datasets (see the module docstring), printed as TRL logs it."""
    from transformers.trainer_pt_utils import AcceleratorConfig

    evals = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
    if not any(is_iterable(d) for d in (train_dataset, *evals) if d is not None):
        return
    known = {k: v for k, v in accelerator_options(args.accelerator_config).items()
             if k in AcceleratorConfig.__dataclass_fields__}
    args.accelerator_config = AcceleratorConfig(**{**known, "dispatch_batches": False})
    if is_iterable(train_dataset) and args.dataloader_num_workers != 0:
        print(f"warning: Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding "
              f"the provided value ({args.dataloader_num_workers}) (TRL's rule)", file=sys.stderr, flush=True)
        args.dataloader_num_workers = 0


def train_loader(trainer):
    """TRL's `get_train_dataloader()` (see the module docstring)."""
    from grpokit.data.prompts import PromptStream
    from grpokit.models.parallel import rank

    args, config = trainer._grpo_args, trainer.config
    stream = PromptStream(list(range(len(trainer.rows))), config.train.prompts_per_step, seed=config.data.seed,
                          shuffle=config.data.shuffle)
    world, me, G = args.world_size, rank(), config.rollout.group_size
    repeats = args.num_iterations * args.steps_per_generation
    order = []
    for _ in range(config.train.steps):
        batch = stream.next_batch()
        share = len(batch) // world  # this process's contiguous share, as the loop's ShardedStream takes it
        order += [i for i in batch[me * share:(me + 1) * share] for _ in range(G)] * repeats
    return _loader([trainer.rows[i] for i in order], args.per_device_train_batch_size * args.steps_per_generation,
                   args, args.dataloader_num_workers)


def eval_loader(trainer, eval_dataset=None):
    """TRL's `get_eval_dataloader(eval_dataset)`: None is the trainer's eval set, a string names one of a dict."""
    args = trainer._grpo_args
    if eval_dataset is None and trainer.eval_dataset is None:
        raise ConfigError("GRPOTrainer.get_eval_dataloader: evaluation requires an eval_dataset (TRL's words); pass "
                          "one here or to GRPOTrainer(eval_dataset=...)")
    if isinstance(eval_dataset, str):
        if not isinstance(trainer.eval_dataset, dict) or eval_dataset not in trainer.eval_dataset:
            names = sorted(trainer.eval_dataset) if isinstance(trainer.eval_dataset, dict) else []
            raise ConfigError(f"GRPOTrainer.get_eval_dataloader({eval_dataset!r}): the trainer's eval_dataset has no "
                              f"set of that name (its names: {names or 'none, it is one dataset'})")
        dataset, rows = trainer.eval_dataset[eval_dataset], trainer.eval_rows[eval_dataset]
    elif eval_dataset is None:
        dataset, rows = trainer.eval_dataset, trainer.eval_rows
        if isinstance(rows, dict):
            raise ConfigError(f"GRPOTrainer.get_eval_dataloader: the trainer's eval_dataset is a dict of "
                              f"{len(rows)} sets; name one: get_eval_dataloader({next(iter(rows))!r})")
    else:
        dataset = eval_dataset
        if is_iterable(dataset):
            _check_dispatch(args)
        rows = _as_rows(dataset, args.remove_unused_columns, "eval_dataset")
    G = args.num_generations_eval or args.num_generations
    workers = 0 if is_iterable(dataset) else args.dataloader_num_workers  # for this loader only, as TRL
    return _loader([row for row in rows for _ in range(G)], args.per_device_eval_batch_size, args, workers)


def _loader(rows: list[dict], batch_size: int, args, num_workers: int):
    import torch
    from torch.utils.data import DataLoader

    return DataLoader(rows, batch_size=batch_size, shuffle=False, collate_fn=_as_list, num_workers=num_workers,
                      pin_memory=bool(args.dataloader_pin_memory) and torch.cuda.is_available(),
                      persistent_workers=bool(args.dataloader_persistent_workers) and num_workers > 0,
                      prefetch_factor=args.dataloader_prefetch_factor if num_workers > 0 else None)


def _as_list(batch: list[dict]) -> list[dict]:
    """TRL's identity collator: the batch is its rows."""
    return batch
