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
        def get_turn_reward(self) -> float | None:  # optional (grpokit): the step reward of the turn just run
            return 0.1
        def get_state(self):                    # optional (grpokit): what the next turn starts from (GiGPO)
            return self.count

    grpokit.train(config, environment_factory=Counter)       # or [tools] environment = "envs.py:Counter"
    grpokit.train(config, environment_factory={"count": Counter, "game": Game})  # rows name theirs: "environment"

One instance per rollout, so that the G answers to a prompt never see each other's state:
instances are pooled and `reset` before every batch (created only when a batch needs more than
exist, as TRL does). With several named environments each row selects one by its "environment"
column (not passed to `reset`), and only that environment's tools are shown in its prompt. Reward
functions receive the batch's instances as the keyword `environments` (one per answer, group by
group).

Per-turn credit (`algorithm.turn_advantage`, docs/AGENTS.md) reads two optional methods, not in TRL's
contract (TRL has no step rewards), so a TRL environment runs unchanged: `get_turn_reward()` is called
after each assistant turn whose tool calls ran and returns that turn's step reward (a finite number, or
None for none); `get_state()` is called after `reset` and after each such turn, and returns the state the
next turn starts from (anything hashable once lists become tuples: equal values are identical states,
GiGPO's anchor states). Both get `tools.timeout_s`; what they raise or a value of the wrong type is one
error naming the environment.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Callable, Mapping, Sequence

import torch

from grpokit.data.prompts import render_prompt
from grpokit.errors import EnvironmentFault, RewardTimeoutError
from grpokit.rewards.core import RewardSpec
from grpokit.rollout.adapters import why_not_adapted
from grpokit.rollout.batch import Turns
from grpokit.rollout.tools import HOOKS, ResultTooLong, ToolBox, ToolResult, as_text, call_within, is_finite_number


def _public_methods(cls) -> list[str]:
    """The tool methods of an environment class: public functions other than the contract's own (HOOKS)."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in HOOKS and not name.startswith("_")]


class _Kind:
    """One environment: its factory, tool methods, shared tool box (schemas) and pool of instances."""

    def __init__(self, factory: Callable[[], object], tools: Sequence[Callable], timeout_s: float,
                 max_result_chars: int):
        try:
            probe = factory()
        except Exception as e:  # noqa: BLE001 - the user's code: one error line, not a traceback
            raise ValueError(f"environment factory {getattr(factory, '__name__', factory)!r} raised "
                             f"{type(e).__name__}: {e}") from None
        self.cls = type(probe)
        if not callable(getattr(probe, "reset", None)):
            raise ValueError(why_not_adapted(factory, probe) or f"environment {self.cls.__name__}: it needs a "
                             "reset(**row) method (TRL's environment contract): it returns None or text appended "
                             "to the last user message")
        if inspect.iscoroutinefunction(getattr(self.cls, "reset", None)):
            raise ValueError(f"environment {self.cls.__name__}: reset is `async def`, and TRL calls reset without "
                             "awaiting it; make it a plain `def` (get_reward and tools may be async)")
        self.factory, self.methods = factory, _public_methods(self.cls)
        self.toolbox = ToolBox(list(tools) + [getattr(probe, m) for m in self.methods], timeout_s=timeout_s,
                               max_result_chars=max_result_chars)
        self.pool = [probe]


class Environments:
    """The environments of a run (one factory, or several by name) and this batch's instances."""

    def __init__(self, factory: Callable[[], object] | Mapping[str, Callable[[], object]],
                 tools: Sequence[Callable] = (), *, timeout_s: float = 30.0, max_result_chars: int = 100_000):
        self.named = isinstance(factory, Mapping)
        factories = dict(factory) if self.named else {None: factory}
        if not factories:
            raise ValueError("environment_factory is an empty mapping; give at least one environment")
        self.kinds = {name: _Kind(f, tools, timeout_s, max_result_chars) for name, f in factories.items()}
        self.toolbox = next(iter(self.kinds.values())).toolbox  # for checks that need one
        self.active: list = []  # this batch's instances, one per answer
        self.max_positions: int | None = None  # the model's context, set at start-up: reset's text is checked
        self.workers = None  # tools.isolation = "process": tool_workers.ToolWorkers holding the instances
        self.answer_prompts: list = []  # this batch's prompt of each answer, as messages (`prompts`)

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
        if self.workers is not None:
            return self._start_remote(rows)
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
                observations.append(_observation(kind, call_within(lambda: env.reset(**arguments),
                                                                   kind.toolbox.timeout_s, "grpokit-reset")))
            except TimeoutError:
                raise EnvironmentFault(f"environment {kind.cls.__name__}: reset did not return within "
                                       f"{kind.toolbox.timeout_s:g} s (tools.timeout_s; row {_show(row)}); make it "
                                       "return sooner or raise tools.timeout_s") from None
            except (EnvironmentFault, KeyboardInterrupt):
                raise
            except BaseException as e:  # noqa: BLE001 - the user's code (even SystemExit): one line naming it and the row
                raise EnvironmentFault(f"environment {kind.cls.__name__}: reset raised {type(e).__name__}: {e} "
                                       f"(row {_show(row)}); fix the environment or the row") from e
            boxes.append(kind.toolbox.rebound([getattr(env, m) for m in kind.methods]))
            boxes[-1].environment = env  # its get_turn_reward / get_state, read after each turn (multiturn.py)
            self.active.append(env)
        return boxes, observations

    def _start_remote(self, rows: Sequence[dict]) -> tuple[list[ToolBox], list[str | None]]:
        """`start` with the instances in the workers (answer i in worker i % workers)."""
        from grpokit.rollout.tool_workers import RemoteEnvironment

        items = [(i, self.name_of(row), {k: v for k, v in row.items() if k != "environment"} if self.named else row)
                 for i, row in enumerate(rows)]
        boxes, observations, self.active = [], [], []
        for (i, name, _), row, reply in zip(items, rows, self.workers.reset(items)):
            kind = self.kinds[name]
            where = f"environment {kind.cls.__name__}: reset"
            if reply[0] == "timeout":
                raise EnvironmentFault(f"{where} did not return within {kind.toolbox.timeout_s:g} s (tools.timeout_s; "
                                       f"row {_show(row)}); make it return sooner or raise tools.timeout_s")
            if reply[0] in ("raise", "died"):
                what = "raised" if reply[0] == "raise" else "ended its worker process:"
                raise EnvironmentFault(f"{where} {what} {reply[1]} (row {_show(row)}); fix the environment or the row")
            if reply[0] == "type":
                raise EnvironmentFault(f"{where} returned {reply[2]} ({reply[1]}); it must return None or a string "
                                       "(appended to the last user message), as in TRL")
            observations.append(_observation(kind, reply[1]))
            box = kind.toolbox.rebound([])
            box.workers, box.answer = self.workers, i
            boxes.append(box)
            self.active.append(RemoteEnvironment(kind.cls, i))
        return boxes, observations

    def prompts(self, tokenizer, rows: Sequence[dict], ids: list[list[int]], G: int, max_new_tokens: int,
                budget_field: str = "rollout.max_new_tokens") -> tuple[list[list[int]], int, list[ToolBox]]:
        """Reset one instance per answer (G per row): the prompts to sample from, the answers per prompt and
        each answer's tool box. When a `reset` returned text, every answer gets its own prompt (the G answers
        to a row no longer share one): N prompts, 1 answer each, each checked against the context."""
        per_answer = [row for row in rows for _ in range(G)]
        boxes, observations = self.start(per_answer)
        # each answer's prompt as messages, reset's text included (tools.history = "split" renders it again)
        self.answer_prompts = [with_observation(row["prompt"], o) for row, o in zip(per_answer, observations)]
        if all(o is None for o in observations):
            return ids, G, boxes
        own = []
        for row, observation in zip(per_answer, observations):
            text = render_prompt(tokenizer, with_observation(row["prompt"], observation), tools=self.schemas_for(row))
            own.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            if self.max_positions and len(own[-1]) + max_new_tokens > self.max_positions:
                raise EnvironmentFault(
                    f"environment {self.kinds[self.name_of(row)].cls.__name__}: with the text reset returned the "
                    f"prompt has {len(own[-1])} tokens (row {_show(row)}); with {budget_field} = {max_new_tokens} "
                    f"it exceeds the model's context of {self.max_positions}; return shorter text from reset or "
                    f"lower {budget_field}")
        return own, 1, boxes

    def reward_specs(self) -> list[RewardSpec]:
        """Each environment class with `get_reward()` as one more reward function, weight 1, named after
        the class; an answer from another environment gets None (no score) there."""
        specs = []
        for cls in dict.fromkeys(k.cls for k in self.kinds.values() if callable(getattr(k.cls, "get_reward", None))):
            def environment_reward(completions, environments=None, _cls=cls, **kwargs) -> list[float | None]:
                if environments is None:  # not from a batch that ran environments
                    return [None] * len(completions)
                if self.workers is not None:
                    return self._remote_rewards(environments, _cls)
                return [self._reward(env) if type(env) is _cls else None for env in environments]

            environment_reward.__name__ = cls.__name__
            specs.append(RewardSpec(cls.__name__, environment_reward, 1.0))
        for cls in dict.fromkeys(k.cls for k in self.kinds.values()):  # an adapted library's rubric (adapters.py)
            specs += list(getattr(cls, "grpokit_reward_specs", ()))
        return specs


    def _reward(self, env) -> float | None:
        """`env.get_reward()` (awaited when async), within `tools.timeout_s`."""
        def score():
            value = env.get_reward()
            return asyncio.run(value) if inspect.iscoroutine(value) else value

        timeout = self.toolbox.timeout_s
        try:
            return call_within(score, timeout, "grpokit-get-reward")
        except TimeoutError:
            raise RewardTimeoutError(f"environment {type(env).__name__}: get_reward did not return within "
                                     f"{timeout:g} s (tools.timeout_s); make it return sooner or raise "
                                     "tools.timeout_s") from None
        except (Exception, KeyboardInterrupt):
            raise  # named by compute_rewards (the function, the sample)
        except BaseException as e:  # noqa: BLE001 - SystemExit, an exit the guard caught: a line, not the end
            raise EnvironmentFault(f"environment {type(env).__name__}: get_reward raised {type(e).__name__}: {e}; "
                                   "fix the environment") from None


    def _remote_rewards(self, environments: Sequence, cls: type) -> list[float | None]:
        mine = [env.answer for env in environments if env.cls is cls]
        scores = dict(zip(mine, self.workers.reward(mine)))
        out = []
        for env in environments:
            reply = scores.get(env.answer) if env.cls is cls else ("ok", None)
            if reply[0] != "ok":
                why = {"timeout": f"did not return within {self.toolbox.timeout_s:g} s (tools.timeout_s)",
                       "lost": "has no instance: its worker process died during the answer"}.get(reply[0])
                fault = RewardTimeoutError if reply[0] == "timeout" else EnvironmentFault
                raise fault(f"environment {cls.__name__}: get_reward {why or f'failed: {reply[-1]}'}; make it "
                            "return sooner, fix it, or raise tools.timeout_s")
            out.append(reply[1])
        return out


def _observation(kind: _Kind, value) -> str | None:
    """What `reset` returned, as TRL takes it: None, a string, or a list of text parts ({"type": "text",
    "text": ...}); shown as text a tokenizer accepts, at most tools.max_result_chars characters."""
    where = f"environment {kind.cls.__name__}: reset"
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        value = "".join(str(p.get("text", "")) for p in value)
    if value is not None and not isinstance(value, str):
        raise EnvironmentFault(f"{where} returned {_show(value)} ({type(value).__name__}); it must return None or a "
                               "string (appended to the last user message), as in TRL")
    try:
        return None if value is None else as_text(value, kind.toolbox.max_result_chars, what=f"{where}'s text")
    except ResultTooLong as e:
        raise EnvironmentFault(str(e)) from None


def with_observation(prompt, observation: str | None) -> list[dict]:
    """The prompt as messages, `observation` appended to the last user message (TRL's reset contract)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if observation is None:
        return messages
    return messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + observation}]


def _show(row) -> str:
    text = repr(row)
    return text if len(text) <= 120 else text[:117] + "..."


def turn_reward(env, timeout_s: float) -> float | None:
    """`env.get_turn_reward()` after a turn (None when the environment has none): a finite number or None."""
    value = _hook(env, "get_turn_reward", timeout_s)
    if value is not None and not is_finite_number(value):
        raise EnvironmentFault(f"environment {type(env).__name__}: get_turn_reward returned {_show(value)} "
                               f"({type(value).__name__}); it must return the turn's step reward as a finite number, "
                               "or None for none")
    return None if value is None else float(value)


def state_key(env, timeout_s: float):
    """`env.get_state()` as a hashable key (lists become tuples, dicts sorted items); None when it has none."""
    value = _hook(env, "get_state", timeout_s)
    try:
        key = _hashable(value)
        hash(key)
    except TypeError:
        raise EnvironmentFault(f"environment {type(env).__name__}: get_state returned {_show(value)} "
                               f"({type(value).__name__}), which cannot be compared as a state; return a string, "
                               "a number or a tuple (equal states must be equal values)") from None
    return key


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _hashable(v)) for k, v in value.items()))
    if isinstance(value, set):
        return frozenset(_hashable(v) for v in value)
    return value


def _hook(env, name: str, timeout_s: float):
    """An optional method of the environment, within `timeout_s` (awaited when async); None when absent."""
    method = getattr(env, name, None)
    if env is None or not callable(method):
        return None

    def run():
        value = method()
        return asyncio.run(value) if inspect.iscoroutine(value) else value

    try:
        return call_within(run, timeout_s, f"grpokit-{name}")
    except TimeoutError:
        raise EnvironmentFault(f"environment {type(env).__name__}: {name} did not return within {timeout_s:g} s "
                               "(tools.timeout_s); make it return sooner or raise tools.timeout_s") from None
    except BaseException as e:  # noqa: BLE001 - the user's code (even SystemExit): one line naming it
        raise EnvironmentFault(f"environment {type(env).__name__}: {name} raised {type(e).__name__}: {e}; fix the "
                               "environment") from None


class TurnLog:
    """Per answer: the turn of each completion token, each turn's step reward (its tools' `WithReward`
    rewards plus its environment's `get_turn_reward()`, read once its calls ran; None when neither
    reported one) and the state it started from (the environment's `get_state()` after `reset` and after
    each turn, as an id: equal states, equal ids)."""

    def __init__(self, boxes: list[ToolBox]):
        self.boxes = boxes
        self.token_turn: list[list[int]] = [[] for _ in boxes]
        self.rewards: list[list[float | None]] = [[] for _ in boxes]
        self.ids: dict = {}
        self.states: list[list[int]] = [[] for _ in boxes]
        for i in range(len(boxes)):
            self.starts(i)

    def _env(self, i: int):
        return getattr(self.boxes[i], "environment", None)

    def ran(self, i: int, results: list[ToolResult]) -> None:
        own = [r.reward for r in results if r.reward is not None]
        env = turn_reward(self._env(i), self.boxes[i].timeout_s)
        parts = own + ([] if env is None else [env])
        self.rewards[i].append(sum(parts) if parts else None)

    def starts(self, i: int) -> None:
        key = state_key(self._env(i), self.boxes[i].timeout_s)
        self.states[i].append(-1 if key is None else self.ids.setdefault(key, len(self.ids)))

    def tensors(self, counts: list[int], T: int, device) -> Turns:
        K = max(counts)
        token_turn = torch.full((len(counts), T), -1, dtype=torch.long)  # [N, T]
        rewards = torch.full((len(counts), K), float("nan"))  # [N, K]
        states = torch.full((len(counts), K), -1, dtype=torch.long)  # [N, K]
        for i, n in enumerate(counts):
            token_turn[i, :len(self.token_turn[i])] = torch.tensor(self.token_turn[i], dtype=torch.long)
            rewards[i, :n] = torch.tensor([float("nan") if r is None else r for r in self.rewards[i][:n]] +
                                          [float("nan")] * (n - len(self.rewards[i][:n])))
            states[i, :n] = torch.tensor(self.states[i][:n], dtype=torch.long)
        return Turns(token_turn.to(device), rewards.to(device), states.to(device),
                     torch.tensor(counts, dtype=torch.long, device=device))
