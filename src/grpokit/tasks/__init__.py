"""Built-in synthetic tasks: a prompt generator plus an exact verifier.

    task = get_task("addition", digits=2)
    train = task.generate(5000, seed=0, split="train")
    held_out = task.generate(200, seed=1, split="eval")     # disjoint from train
    specs = task.reward_functions()

Importing this package registers each task's verifier in the reward registry,
so `get_reward("addition")` / `get_reward("countdown", format_score=0.1)` work.
"""

from __future__ import annotations

import inspect

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


def get_task(name: str, **kwargs) -> Task:
    """The built-in task `name`, configured with `kwargs` (e.g. digits=3)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(available_tasks())}")
    cls = TASKS[name]
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        params = ", ".join(inspect.signature(cls).parameters)
        raise ValueError(f"task {name!r} got arguments {sorted(kwargs)}: {e}; it accepts: {params}") from None
    return cls(**kwargs)


__all__ = ["AdditionTask", "CountdownTask", "TASKS", "Task", "addition_reward", "available_tasks",
           "countdown_reward_fn", "get_task", "in_split", "parse_expression", "score_expression"]
