"""Built-in synthetic tasks: a prompt generator plus the name of its exact verifier.

    task = get_task("addition", digits=2)
    train = task.generate(5000, seed=0, split="train")
    held_out = task.generate(200, seed=1, split="eval")     # disjoint from train
    specs = task.reward_functions()

The verifiers are reward functions (`rewards/verifiers.py`), so `get_reward("addition")` /
`get_reward("countdown", format_score=0.1)` work without this package.
"""

from __future__ import annotations

import difflib
import inspect

from grpokit.errors import TaskError
from grpokit.rewards.verifiers import addition_reward, countdown_reward_fn, parse_expression, score_expression
from grpokit.tasks.addition import AdditionTask
from grpokit.tasks.base import Task, in_split
from grpokit.tasks.countdown import CountdownTask
from grpokit.tasks.gridworld import GridWorld, GridWorldTask
from grpokit.tasks.multiplication import MultiplicationTask, calculator
from grpokit.tasks.shapes import ShapeCountTask

TASKS: dict[str, type] = {"addition": AdditionTask, "countdown": CountdownTask, "gridworld": GridWorldTask,
                          "multiplication": MultiplicationTask, "shapes": ShapeCountTask}  # shapes: with images


def available_tasks() -> list[str]:
    return sorted(TASKS)


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


def task_tools(task) -> list:
    """The tools a task brings (multiplication: `calculator`); none for most tasks."""
    return list(getattr(task, "tools", lambda: [])())


def task_environment(task):
    """The environment class a task brings (gridworld: `GridWorld`); None for most tasks."""
    make = getattr(task, "environment", None)
    return make() if callable(make) else None


def cli_task(task: str, task_args: dict):
    """`get_task` for the command line: its errors name the flag (--task or --task-arg)."""
    try:
        return get_task(task, **task_args)
    except TaskError as e:
        raise TaskError(f"{'--task-arg' if task in TASKS else '--task'}: {e}") from e


__all__ = ["AdditionTask", "CountdownTask", "MultiplicationTask", "TASKS", "Task", "TaskError", "addition_reward",
           "available_tasks", "calculator", "cli_task", "countdown_reward_fn", "get_task", "in_split",
           "parse_expression", "score_expression", "ShapeCountTask", "task_tools",
           "GridWorld", "GridWorldTask", "task_environment"]
