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
    grpokit.train(config, environment_factory={"count": Counter, "game": Game})  # rows name theirs: "environment"

One instance per rollout, so that the G answers to a prompt never see each other's state:
instances are pooled and `reset` before every batch (created only when a batch needs more than
exist, as TRL does). With several named environments each row selects one by its "environment"
column (not passed to `reset`), and only that environment's tools are shown in its prompt. Reward
functions receive the batch's instances as the keyword `environments` (one per answer, group by
group).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Callable, Mapping, Sequence

from grpokit.errors import EnvironmentFault
from grpokit.rewards.core import RewardSpec
from grpokit.rollout.tools import ToolBox


def _public_methods(cls) -> list[str]:
    """The tool methods of an environment class: public functions other than reset and get_reward."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class _Kind:
    """One environment: its factory, tool methods, shared tool box (schemas) and pool of instances."""

    def __init__(self, factory: Callable[[], object], tools: Sequence[Callable], timeout_s: float):
        try:
            probe = factory()
        except Exception as e:  # noqa: BLE001 - the user's code: one error line, not a traceback
            raise ValueError(f"environment factory {getattr(factory, '__name__', factory)!r} raised "
                             f"{type(e).__name__}: {e}") from None
        self.cls = type(probe)
        if not callable(getattr(probe, "reset", None)):
            raise ValueError(f"environment {self.cls.__name__}: it needs a reset(**row) method (TRL's environment "
                             "contract): it returns None or text appended to the last user message")
        self.factory, self.methods = factory, _public_methods(self.cls)
        self.toolbox = ToolBox(list(tools) + [getattr(probe, m) for m in self.methods], timeout_s=timeout_s)
        self.pool = [probe]


class Environments:
    """The environments of a run (one factory, or several by name) and this batch's instances."""

    def __init__(self, factory: Callable[[], object] | Mapping[str, Callable[[], object]],
                 tools: Sequence[Callable] = (), *, timeout_s: float = 30.0):
        self.named = isinstance(factory, Mapping)
        factories = dict(factory) if self.named else {None: factory}
        if not factories:
            raise ValueError("environment_factory is an empty mapping; give at least one environment")
        self.kinds = {name: _Kind(f, tools, timeout_s) for name, f in factories.items()}
        self.toolbox = next(iter(self.kinds.values())).toolbox  # for checks that need one
        self.active: list = []  # this batch's instances, one per answer

    def name_of(self, row: dict):
        return row.get("environment") if self.named else None

    def check_rows(self, rows: Sequence[dict]) -> None:
        """With named environments every row must name a known one in its "environment" column."""
        for i, row in enumerate(rows):
            if self.name_of(row) not in self.kinds:
                raise ValueError(f"row {i + 1}: environment {self.name_of(row)!r} is not among the environments "
                                 f"given ({', '.join(map(str, self.kinds))}); set its \"environment\" column to one")

    def schemas_for(self, row: dict) -> list[dict]:
        """The tools shown in this row's prompt: its environment's (and the standalone tools)."""
        return self.kinds[self.name_of(row)].toolbox.schemas

    def start(self, rows: Sequence[dict]) -> tuple[list[ToolBox], list[str | None]]:
        """Reset one instance per answer with its row; their tool boxes and what each `reset` returned."""
        taken: dict = {}
        boxes, observations, self.active = [], [], []
        for row in rows:
            kind = self.kinds[self.name_of(row)]
            index = taken[kind] = taken.get(kind, -1) + 1
            arguments = {k: v for k, v in row.items() if k != "environment"} if self.named else row
            try:
                if index == len(kind.pool):
                    kind.pool.append(kind.factory())
                env = kind.pool[index]
                observations.append(env.reset(**arguments))
            except Exception as e:  # noqa: BLE001 - the user's code: one error line naming it and the row
                raise EnvironmentFault(f"environment {kind.cls.__name__}: reset raised {type(e).__name__}: {e} "
                                       f"(row {_show(row)}); fix the environment or the row") from e
            boxes.append(kind.toolbox.rebound([getattr(env, m) for m in kind.methods]))
            self.active.append(env)
        return boxes, observations

    def reward_specs(self) -> list[RewardSpec]:
        """Each environment class with `get_reward()` as one more reward function, weight 1, named after
        the class; an answer from another environment gets None (no score) there."""
        specs = []
        for cls in dict.fromkeys(k.cls for k in self.kinds.values() if callable(getattr(k.cls, "get_reward", None))):
            def environment_reward(completions, environments, _cls=cls, **kwargs) -> list[float | None]:
                scores = [env.get_reward() if type(env) is _cls else None for env in environments]
                return [asyncio.run(s) if inspect.iscoroutine(s) else s for s in scores]  # async get_reward too

            environment_reward.__name__ = cls.__name__
            specs.append(RewardSpec(cls.__name__, environment_reward, 1.0))
        return specs


def with_observation(prompt, observation: str | None) -> list[dict]:
    """The prompt as messages, `observation` appended to the last user message (TRL's reset contract)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if observation is None:
        return messages
    return messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + observation}]


def _show(row: dict) -> str:
    text = repr(row)
    return text if len(text) <= 120 else text[:117] + "..."
