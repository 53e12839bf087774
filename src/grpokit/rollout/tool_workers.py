"""Tools and environments in worker processes (`tools.isolation = "process"`).

The workers are the isolated rewards' (`rewards.worker_pool.RewardPool`, a use of `grpokit.processes`: fresh
interpreters in their own session, dying with the trainer, killed and replaced past a deadline or when they
die); this module sends them a `ToolHost` through the pool's public `sendable` / `run`. What runs in
them is one `ToolHost`: the run's tools and, for each answer, its environment instance. Answer i lives
in worker i % workers, so its calls, `reset` and `get_reward` always reach its own instance; the
workers' answers run side by side, one worker's in turn. In a worker each call still has
`tools.timeout_s` (and the exit guard), so a slow or exiting call is a failed call as in-process; what
the process isolation adds is what a thread cannot survive: a crash in native code, `ctypes` exits,
the OOM killer, a call that holds the interpreter. Then the worker is replaced, the calls of its
answers in that step fail (`{"error": "the tool's worker process died (...)"}`), and its environment
instances are gone: their later calls fail, and their `reset` / `get_reward` stop the run with one
line. Reward functions receive `environments` as `RemoteEnvironment` stand-ins (the class and the answer), not
the instances, which live in the workers.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from grpokit.rollout.tools import HOOKS, ToolBox, ToolCall, ToolResult, call_within, run_one_call, tool_error

SLACK_S = 30.0  # beyond the calls' own deadlines, before a worker that does not answer is killed
LOST = "the environment's worker process died earlier in this answer, and its state with it"


@dataclass(frozen=True)
class RemoteEnvironment:
    """An answer's environment instance, living in a worker: what reward functions receive as `environments`."""

    cls: type
    answer: int


class ToolHost:
    """What a worker runs: the tools (references or picklable callables), the environment factories by name,
    and this worker's instances by answer. Pickled without what it built."""

    def __init__(self, tools: Sequence[str | Callable], environments: Mapping[Any, str | Callable],
                 timeout_s: float, max_result_chars: int):
        self.tools, self.environments = list(tools), dict(environments)
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars
        self._built: dict | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_built": None}

    def __call__(self, op: str, items: list) -> list:
        if self._built is None:
            from grpokit.exit_guard import in_tool_worker
            from grpokit.rewards.registry import load_reward
            from grpokit.rewards.worker_pool import WORKER_ENV

            if os.environ.get(WORKER_ENV):  # a worker process (not a host called in-process)
                in_tool_worker()  # the exit guard's messages: an exit here ends this worker, not the trainer
            load = lambda ref, kind: load_reward(ref, kind=kind) if isinstance(ref, str) else ref  # noqa: E731
            box = ToolBox.__new__(ToolBox)
            box.functions = {fn.__name__: fn for fn in (load(t, "tool") for t in self.tools)}
            box.schemas, box.timeout_s, box.max_result_chars = [], self.timeout_s, self.max_result_chars
            self._built = {"box": box, "factories": {k: load(v, "environment") for k, v in self.environments.items()},
                           "instances": {}}
        return [getattr(self, f"_{op}")(*item) for item in items]

    def _reset(self, answer: int, name, row: dict) -> tuple:
        instances, factory = self._built["instances"], self._built["factories"][name]
        try:
            env = instances.get(answer)
            if env is None or instances.get(("kind", answer)) != name:
                env = instances[answer] = factory()
                instances[("kind", answer)] = name
            value = call_within(lambda: env.reset(**row), self.timeout_s, "grpokit-reset")
        except TimeoutError:
            return ("timeout",)
        except BaseException as e:  # noqa: BLE001 - reported in the trainer, naming the environment and the row
            return ("raise", f"{type(e).__name__}: {e}")
        if value is None or isinstance(value, str) or (
                isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value)):
            return ("ok", value if not isinstance(value, list) else [{"type": "text", "text": str(p.get("text", ""))}
                                                                     for p in value])
        return ("type", type(value).__name__, repr(value)[:120])

    def _call(self, answer: int, calls: list[tuple]) -> list[tuple]:
        box, env = self._built["box"], self._built["instances"].get(answer)
        if self._built["factories"]:
            if env is None:
                return [(name or "unknown", tool_error(LOST), True) for name, _, _ in calls]
            box = box.rebound([getattr(env, m) for m in dir(type(env)) if not m.startswith("_")
                               and m not in HOOKS and inspect.isfunction(getattr(type(env), m))])
        results = [run_one_call(box, ToolCall(*call)) for call in calls]
        return [(r.name, r.content, r.failed, r.reward, r.parts) for r in results]  # a step reward, images too

    def _reward(self, answer: int) -> tuple:
        env = self._built["instances"].get(answer)
        if env is None:
            return ("lost",)

        def score():
            value = env.get_reward()
            return asyncio.run(value) if inspect.iscoroutine(value) else value

        try:
            return ("ok", call_within(score, self.timeout_s, "grpokit-get-reward"))
        except TimeoutError:
            return ("timeout",)
        except BaseException as e:  # noqa: BLE001 - reported in the trainer
            return ("raise", f"{type(e).__name__}: {e}")


class ToolWorkers:
    """The trainer's side: a pool of `workers` processes running one `ToolHost`; `close()` stops them."""

    def __init__(self, host: ToolHost, workers: int = 2):
        from grpokit.rewards.worker_pool import RewardPool, sendable

        self.source = sendable("tools", host)  # checked to pickle and import now, at start-up
        self.pool, self.workers, self.timeout_s = RewardPool(workers), workers, host.timeout_s

    def close(self) -> None:
        self.pool.close()

    def _run(self, op: str, items: list[tuple], calls_each: int = 1) -> list[tuple]:
        """`items` (each starting with its answer) in their workers; per item its reply, or ("died", how)."""
        jobs = [[item for item in items if item[0] % self.workers == w] for w in range(self.workers)]
        used = max((w for w in range(self.workers) if jobs[w]), default=-1) + 1
        limit = (self.timeout_s or 600.0) * max(1, calls_each * max(map(len, jobs))) + SLACK_S
        replies = self.pool.run(self.source, [{"op": op, "items": job} for job in jobs[:used]], (), limit)
        out: dict[int, tuple] = {}
        for job, reply in zip(jobs, replies):
            for k, item in enumerate(job):
                if reply[0] == "ok":
                    out[id(item)] = reply[1][k]
                elif reply[0] == "died":
                    out[id(item)] = ("died", reply[2])
                elif reply[0] == "timeout":
                    out[id(item)] = ("died", f"stopped after {limit:g} s without an answer")
                else:  # the host could not be built (a tool file that does not load there) or raised
                    kind, message = (reply[2], reply[3]) if reply[0] == "raise" else (reply[1], reply[2])
                    out[id(item)] = ("died", f"{kind}: {message}")
        return [out[id(item)] for item in items]

    def call(self, answers: list[tuple[int, list[ToolCall]]]) -> list[list[ToolResult]]:
        items = [(answer, [(c.name, c.arguments, c.error) for c in calls]) for answer, calls in answers]
        most = max((len(calls) for _, calls in answers), default=1)
        results = []
        for (_, calls), reply in zip(answers, self._run("call", items, most)):
            if isinstance(reply, tuple) and reply and reply[0] == "died":
                died = tool_error(f"the tool's worker process died ({reply[1]})")
                results.append([ToolResult(c.name or "unknown", died, True) for c in calls])
            else:
                results.append([ToolResult(*r) for r in reply])
        return results

    def reset(self, items: list[tuple[int, Any, dict]]) -> list[tuple]:
        return self._run("reset", items)

    def reward(self, answers: list[int]) -> list[tuple]:
        return self._run("reward", [(a,) for a in answers])


def attach_workers(box: ToolBox, environments, tools_config, functions: Sequence[Callable] | None,
                   environment_factory) -> ToolWorkers:
    """Run `box`'s tools (and `environments`' instances) in `tools_config.workers` processes, which find them
    by the config's references (`functions` None: `tools.functions`; resolved against this working directory
    now), else by pickle (callables given to `train()`). ValueError (one line) for what cannot run there."""
    from pathlib import Path

    from grpokit.errors import RewardLoadError
    from grpokit.rewards.worker_pool import sendable

    def absolute(ref):
        """A reference resolved now; a callable as a worker finds it (a script's function: by its file)."""
        if not isinstance(ref, str):
            sent = sendable(getattr(ref, "__name__", "tool"), ref)  # RewardLoadError: what cannot be sent, and why
            return sent.label if sent.kind == "ref" else ref
        module, _, attr = ref.rpartition(":")
        return f"{Path(module).resolve()}:{attr}" if module.endswith(".py") or "/" in module else ref

    t = tools_config
    tools = t.functions if functions is None else functions
    factory = environment_factory or t.environment
    factories = dict(factory) if isinstance(factory, Mapping) else {None: factory} if factory else {}
    try:
        host = ToolHost([absolute(f) for f in tools], {k: absolute(v) for k, v in factories.items()}, box.timeout_s,
                        box.max_result_chars)
        pool = ToolWorkers(host, t.workers)
    except RewardLoadError as e:
        raise ValueError(f"tools.isolation = \"process\": {str(e).replace('reward function ', '', 1)}") from None
    box.workers = pool
    if environments is not None:
        environments.workers = pool
    return pool
