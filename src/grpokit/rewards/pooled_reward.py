"""The trainer's side of an isolated reward function: the `RewardSpec` whose `fn` sends each call to the
worker pool (`rewards/worker_pool.py`) in chunks of whole groups, and turns the workers' replies back into
scores, the function's own exception, or an error naming the function and the limit."""

from __future__ import annotations

import contextlib
import inspect
import pickle
from typing import Any, Callable

from grpokit.errors import RewardError, RewardTimeoutError
from grpokit.rewards.core import RewardSpec
from grpokit.rewards.worker_pool import BUILD_LIMIT_S, RewardPool, RewardWorkerError, Sendable, pickled, sendable


def _chunks(n: int, group_size: int | None, workers: int) -> list[tuple[int, int]]:
    """[start, end) ranges of whole groups, as even as can be, one per worker at most."""
    if not group_size or n == 0 or n % group_size:
        return [(0, n)]  # groups unknown (core re-running one sample): one chunk
    k = min(workers, n // group_size)
    return [(group_size * (n // group_size * j // k), group_size * (n // group_size * (j + 1) // k)) for j in range(k)]


def _exception(name: str, reply: tuple) -> Exception:
    """The worker's exception as itself when it unpickles, else a RewardError with its text."""
    exc = None
    with contextlib.suppress(Exception):  # e.g. an exception whose __init__ does not take its args back
        exc = pickle.loads(reply[1]) if reply[1] else None
    if not isinstance(exc, Exception):  # SystemExit and the like must not stop the trainer as such
        exc = RewardError(f"reward function '{name}' raised {reply[2]}: {reply[3]} (in its worker process)")
    exc.add_note("traceback in the reward worker process:\n" + reply[4].rstrip())
    return exc


class _IsolatedReward:
    """The `fn` of an isolated RewardSpec. Its signature is the function's (so `compute_rewards` passes the
    same arguments) plus `log_metric`, which counts the answers a skip leaves ungraded."""

    def __init__(self, name: str, pool: RewardPool, source: Sendable, timeout: float | None, on_error: str,
                 group_size: int | None, fn: Callable):
        self.name, self.pool, self.source, self.timeout = name, pool, source, timeout
        self.on_error, self.group_size, self.ungraded = on_error, group_size, 0
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # no signature: like core, pass everything
            sig = inspect.Signature([inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
        params = list(sig.parameters.values())
        self._takes = {"*"} if any(p.kind is p.VAR_KEYWORD for p in params) else {p.name for p in params}
        if not {"*", "log_metric"} & self._takes:
            params.append(inspect.Parameter("log_metric", inspect.Parameter.KEYWORD_ONLY, default=None))
        self.__signature__ = sig.replace(parameters=params)

    def __call__(self, **kwargs):
        callbacks = {k: kwargs.pop(k) for k in ("log_metric", "log_extra") if k in kwargs}
        collect = tuple(k for k in callbacks if {"*", k} & self._takes)
        n = next((len(v) for k, v in kwargs.items() if isinstance(v, (list, tuple)) and k != "trainer_state"), 0)
        sliced = {k: v for k, v in kwargs.items() if isinstance(v, (list, tuple)) and len(v) == n}
        shared = {k: v if k != "environments" and pickled(v) is not None else None  # environments: live objects
                  for k, v in kwargs.items() if k not in sliced or k == "environments"}
        ranges = _chunks(n, self.group_size, self.pool.workers)
        jobs = [dict(shared, **{k: v[a:b] for k, v in sliced.items() if k not in shared}) for a, b in ranges]
        replies = self.pool.run(self.source, jobs, collect, self.timeout)
        outs = []
        for (a, b), reply in zip(ranges, replies):
            if reply[0] == "raise":
                raise _exception(self.name, reply)
            if reply[0] == "unbuilt" or (reply[0] != "ok" and (reply[2] is True or self.on_error == "raise")):
                raise self._fault(reply, a, b, n)  # (a failed import is never skipped)
            if reply[0] == "ok" and isinstance(reply[1], (list, tuple)) and len(reply[1]) != b - a:
                from grpokit.rewards.core import wrong_count  # (torch: the trainer has it, workers need not)

                # this call's count against this call's completions, not the chunks' sums against the batch
                raise wrong_count(self.name, len(reply[1]), b - a,
                                  f" (samples {a}-{b - 1} of {n}, one worker's share)" if b - a != n else "")
            outs.append(reply[1] if reply[0] == "ok" else [None] * (b - a))
        for kind, key, value in (r for reply in replies if reply[0] == "ok" for r in reply[2]):
            callbacks[kind](key, value)  # in order: TRL's log_extra extends its column, its log_metric averages
        if skipped := sum(b - a for (a, b), reply in zip(ranges, replies) if reply[0] != "ok"):
            self.ungraded += skipped
            if callbacks.get("log_metric"):
                callbacks["log_metric"](f"rewards/{self.name}/ungraded", skipped)
        if len(outs) > 1 and all(isinstance(o, (list, tuple)) for o in outs):
            return [v for o in outs for v in o]
        return next((o for o in outs if not isinstance(o, (list, tuple))), outs[0])  # core reports a bad one

    def _fault(self, reply: tuple, a: int, b: int, n: int) -> RewardTimeoutError:
        what, load = f"reward function '{self.name}'", f"loading {self.source.label} in a worker process"
        if reply[0] == "unbuilt" or reply[2] is True:
            why = f"raised {reply[1]}: {reply[2]}" if reply[0] == "unbuilt" else f"took over {BUILD_LIMIT_S:g} s"
            return RewardWorkerError(f"{what}: {load} {why}; check that it imports, quickly, in a fresh Python")
        where, skip = f"on samples {a}-{b - 1} of {n} in worker process {reply[1]}", \
            "or set rewards.on_error = \"skip\" to score such answers None"
        if reply[0] == "timeout":
            return RewardTimeoutError(
                f"{what} took longer than {float(self.timeout):g} s (its timeout) {where}; the worker was killed "
                f"and replaced. Make the function faster, raise its timeout (rewards.timeout_s, or "
                f"rewards.args = {{{self.name} = {{timeout = ...}}}}), {skip}")
        return RewardWorkerError(f"{what} crashed its worker ({reply[2]}) {where}; the worker was replaced. "
                                 f"Fix the code it runs (try it on those samples alone), {skip}")


def isolate(spec: RewardSpec, pool: RewardPool, *, source: Any = None, on_error: str = "raise",
            group_size: int | None = None) -> RewardSpec:
    """`spec` with its function run in `pool`, `spec.timeout` the limit of each chunk (the returned spec has
    no thread timeout). `source`: (reference, kwargs) as `registry.resolve_reward` takes them, a reference,
    or a callable that pickles by reference (default `spec.fn`). `group_size` G: batches of whole groups are
    split over the workers; None runs each batch in one worker. `on_error`: "raise", or "skip" to score the
    answers of a timeout or a crash None; an exception raised by the function is re-raised as itself."""
    from grpokit.rewards.core import RewardSpec  # not at the top: workers import this module without torch

    if on_error not in ("raise", "skip"):
        raise ValueError(f"isolate: on_error must be 'raise' or 'skip', got {on_error!r}")
    if group_size is not None and (type(group_size) is not int or group_size < 1):
        raise ValueError(f"isolate: group_size must be an integer >= 1 or None, got {group_size!r}")
    fn = _IsolatedReward(spec.name, pool, sendable(spec.name, spec.fn if source is None else source),
                         spec.timeout, on_error, group_size, spec.fn)
    return RewardSpec(spec.name, fn, spec.weight, None)
