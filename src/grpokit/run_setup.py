"""Everything `train` checks and prepares before the model loads.

A run that will fail should fail in the first second, with a message naming the
field or row and the fix, and without touching what is already on disk: the
config (validated at construction), the model folder, the data, the reward
functions, the output folder, and prompts too long for the model's context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from .errors import UserError
from .config import Config
from .data import DataError, PromptStream, load_prompts, render_prompt
from .rewards import RewardSpec, reward_specs
from .tasks import get_task


class SetupError(UserError, ValueError):
    """The run cannot start as configured; the message says why and what to change."""


@dataclass
class PreparedData:
    rows: list[dict]  # "prompt" plus the columns reward functions receive
    task: object | None  # the built-in task when data.task is set

    def stream(self, batch_size: int, seed: int) -> PromptStream:
        """Batches of row indices, reshuffled every epoch, resumable."""
        return PromptStream(list(range(len(self.rows))), batch_size, seed=seed)


@dataclass
class PromptTable:
    rows: list[dict]
    ids: list[list[int]]  # the tokenized prompt of each row
    eos_token_ids: list[int]


def prepare_data(config: Config, rows: Iterable[dict] | None = None) -> PreparedData:
    """Rows from Python, a built-in task (its train split) or a file, validated."""
    d = config.data
    task = get_task(d.task, **d.task_args) if d.task else None
    if rows is not None:
        return PreparedData(load_prompts(rows), task)
    if task is not None:
        return PreparedData(task.generate(d.num_prompts, seed=d.seed, split="train"), task)
    return PreparedData(load_prompts(d.path, prompt_column=d.prompt_column), None)


def resolve_reward_specs(config: Config, task, functions: Sequence[Callable] | None = None) -> list[RewardSpec]:
    """Python callables given to `train`, else `rewards.functions`, else the task's verifier.

    A callable is named by its `__name__` (`reward_<i>` without one); callables sharing a name are
    told apart by their module (`mod_a.score`, `mod_b.score`), else numbered (`score`, `score_2`):
    see `unique_reward_names`."""
    from .rewards.registry import unique_reward_names

    r = config.rewards
    weights = list(r.weights) or [1.0] * len(functions or r.functions)
    timeout = r.timeout_s or None  # your own functions are bounded (rewards.timeout_s); built-ins bound themselves
    if functions:
        names = unique_reward_names(
            [getattr(f, "__name__", None) or f"reward_{i}" for i, f in enumerate(functions)],
            [m if (m := getattr(f, "__module__", None)) not in (None, "__main__") else None for f in functions])
        return [RewardSpec(n, f, w, timeout) for n, f, w in zip(names, functions, weights)]
    if r.functions:
        return reward_specs(list(r.functions), weights, r.args, default_timeout=timeout)
    if task is not None:
        return task.reward_functions()
    raise SetupError("no reward functions: set rewards.functions (a built-in name such as 'numeric_match', "
                     "or 'file.py:function'), or use a built-in data.task")


def tokenize_prompts(config: Config, data: PreparedData, tokenizer, max_positions: int | None) -> PromptTable:
    """Render (chat template) and tokenize every prompt; reject any too long for the context."""
    ids = [tokenizer(render_prompt(tokenizer, r["prompt"]), add_special_tokens=False)["input_ids"] for r in data.rows]
    budget = config.rollout.max_new_tokens
    for i, prompt_ids in enumerate(ids):
        if not prompt_ids:
            raise DataError(f"prompt row {i + 1} tokenizes to nothing; remove it or fix its text")
        if max_positions and len(prompt_ids) + budget > max_positions:
            raise DataError(f"prompt row {i + 1} has {len(prompt_ids)} tokens; with rollout.max_new_tokens = {budget} "
                            f"it exceeds the model's context of {max_positions}; shorten it or lower max_new_tokens")
    eos = tokenizer.eos_token_id
    return PromptTable(data.rows, ids, [eos] if isinstance(eos, int) else list(eos or []))


def max_positions_of(model_path: str) -> int | None:
    """The model's context length from its config.json (read without loading weights)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    return cfg.get("max_position_embeddings") or cfg.get("n_positions") or cfg.get("max_sequence_length")


def _cli_task(task: str, task_args: dict):
    """`get_task` for the command line: its errors name the flag (--task or --task-arg)."""
    from .tasks import TASKS, TaskError

    try:
        return get_task(task, **task_args)
    except TaskError as e:
        raise TaskError(f"{'--task-arg' if task in TASKS else '--task'}: {e}") from e


def eval_rows_and_specs(*, task, task_args, data, prompt_column, rewards, num_prompts, seed):
    """Held-out rows and reward specs for `grpokit eval` (a built-in task or a file + rewards)."""
    if bool(task) == bool(data):
        raise SetupError("give exactly one of --task NAME or --data FILE")
    if task:
        t = _cli_task(task, task_args)
        specs = reward_specs(rewards) if rewards else t.reward_functions()
        return t.generate(num_prompts, seed=seed, split="eval"), specs, "prompt"
    if not rewards:
        raise SetupError("--data needs at least one --reward NAME or --reward file.py:function")
    rows = load_prompts(data, prompt_column=prompt_column)[:num_prompts]
    return rows, reward_specs(rewards), "prompt"


def sft_pair_sampler(*, task, task_args, data, prompt_column, completion_column):
    """A `rng -> (prompt, target)` sampler for `grpokit sft` from a task or a file."""
    if bool(task) == bool(data):
        raise SetupError("give exactly one of --task NAME or --data FILE")
    if task:
        t = _cli_task(task, task_args)
        rows = t.generate(5000, seed=0, split="train")
        return lambda rng: (lambda row: (row["prompt"], t.sft_target(row, rng)))(rng.choice(rows))
    rows = load_prompts(data, prompt_column=prompt_column)
    missing = [i + 1 for i, r in enumerate(rows) if not isinstance(r.get(completion_column), str)]
    if missing:
        raise DataError(f"{data}: row {missing[0]} has no string {completion_column!r} column (the SFT target); "
                        "add it or pass --completion-column")
    if any(not isinstance(r["prompt"], str) for r in rows):
        raise DataError(f"{data}: sft takes plain-string prompts")
    return lambda rng: (lambda row: (row["prompt"], row[completion_column]))(rng.choice(rows))
