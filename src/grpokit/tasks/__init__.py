"""Built-in synthetic tasks: a prompt generator plus an exact verifier.

    task = get_task("addition", digits=2)
    train = task.generate(5000, seed=0, split="train")
    held_out = task.generate(200, seed=1, split="eval")     # disjoint from train
    specs = task.reward_functions()

Importing this package registers each task's verifier in the reward registry,
so `get_reward("addition")` / `get_reward("countdown", format_score=0.1)` work.
"""

from __future__ import annotations

import difflib
import inspect

from grpokit.errors import UserError
from grpokit.rewards import register_reward

from .addition import AdditionTask, addition_reward
from .base import Task, in_split
from .countdown import CountdownTask, countdown_reward_fn, parse_expression, score_expression

TASKS: dict[str, type] = {"addition": AdditionTask, "countdown": CountdownTask}


def _addition_factory():
    return addition_reward


register_reward("addition", _addition_factory, overwrite=True)
register_reward("countdown", countdown_reward_fn, overwrite=True)


def available_tasks() -> list[str]:
    return sorted(TASKS)


class TaskError(UserError, ValueError):
    """An unknown built-in task name, or arguments the task does not accept."""


def get_task(name: str, **kwargs) -> Task:
    """The built-in task `name`, configured with `kwargs` (e.g. digits=3); `TaskError` otherwise."""
    if name not in TASKS:
        close = difflib.get_close_matches(str(name), available_tasks(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TaskError(f"unknown task {name!r}{hint}; known tasks: {', '.join(available_tasks())}")
    cls = TASKS[name]
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        params = ", ".join(inspect.signature(cls).parameters)
        raise TaskError(f"task {name!r} got arguments {sorted(kwargs)}: {e}; it accepts: {params}") from None
    try:
        return cls(**kwargs)
    except ValueError as e:  # a bad argument value ("addition: digits must be ...")
        raise TaskError(str(e)) from e


__all__ = ["AdditionTask", "CountdownTask", "TASKS", "Task", "TaskError", "addition_reward", "available_tasks",
           "countdown_reward_fn", "get_task", "in_split", "parse_expression", "score_expression"]
