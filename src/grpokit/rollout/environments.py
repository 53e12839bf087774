"""Environments, as TRL's `environment_factory` defines them.

    class Counter:                         # a TRL environment runs unchanged
        def reset(self, **row) -> str | None:   # the data row; a string is appended to the last user message
            self.count = 0
        def increment(self, step: int) -> int:  # every public method is a tool
            \"\"\"Add `step` to the counter. Args: step: how much.\"\"\"
            self.count += step
            return self.count
        def get_reward(self) -> float:          # optional: one more reward source, named after the class
            return float(self.count == 3)

    grpokit.train(config, environment_factory=Counter)       # or [tools] environment = "envs.py:Counter"

One instance per rollout, so that the G answers to a prompt never see each other's state:
instances are pooled and `reset` before every batch (created only when a batch needs more than
exist, as TRL does). Reward functions receive the batch's instances as the keyword `environments`
(one per answer, group by group).
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

from grpokit.rewards.core import RewardSpec
from grpokit.rollout.tools import ToolBox


def _public_methods(cls) -> list[str]:
    """The tool methods of an environment class: public functions other than reset and get_reward."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class Environments:
    """A pool of environment instances behind one factory, and the tools they share by name."""

    def __init__(self, factory: Callable[[], object], tools: Sequence[Callable] = (), *, timeout_s: float = 30.0):
        probe = factory()
        cls = type(probe)
        if not callable(getattr(probe, "reset", None)):
            raise ValueError(f"environment {cls.__name__}: it needs a reset(**row) method (TRL's environment "
                             "contract): it returns None or text appended to the last user message")
        self.factory, self.name, self.tools = factory, cls.__name__, list(tools)
        self.methods = _public_methods(cls)
        self.toolbox = ToolBox(self.tools + [getattr(probe, m) for m in self.methods], timeout_s=timeout_s)
        self.has_reward = callable(getattr(probe, "get_reward", None))
        self.pool = [probe]
        self.active: list = []  # this batch's instances, one per answer

    def start(self, rows: Sequence[dict]) -> tuple[list[ToolBox], list[str | None]]:
        """Reset one instance per answer with its row; their tool boxes and what each `reset` returned."""
        while len(self.pool) < len(rows):
            self.pool.append(self.factory())
        self.active = self.pool[:len(rows)]
        observations = [env.reset(**row) for env, row in zip(self.active, rows)]
        boxes = [self.toolbox.rebound([getattr(env, m) for m in self.methods]) for env in self.active]
        return boxes, observations

    def reward_spec(self) -> RewardSpec | None:
        """`get_reward()` of each answer's instance as one more reward function, weight 1, named after the class."""
        if not self.has_reward:
            return None

        def environment_reward(completions, environments, **kwargs) -> list[float | None]:
            return [env.get_reward() for env in environments]

        environment_reward.__name__ = self.name
        return RewardSpec(self.name, environment_reward, 1.0)


def with_observation(prompt, observation: str | None) -> list[dict]:
    """The prompt as messages, `observation` appended to the last user message (TRL's reset contract)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if observation is None:
        return messages
    return messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + observation}]
