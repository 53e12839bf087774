"""The ways user code run in the trainer's process could end it, turned into a failed call.

Tools and environments (`tools.isolation = "none"`, the default, in threads: `rollout/tools.py call_within`)
and reward functions (`rewards.isolation = "none"`, `rewards/core.py`) run in the trainer's process. `sys.exit`
there is only an exception; `os._exit`, `os.abort` and a signal sent to the trainer's own process
(`os.kill(os.getpid(), SIGKILL)`, `os.killpg`, `signal.pthread_kill`, `signal.raise_signal`) would end the run
at once, with no message and no checkpoint of the finished steps. While a thread runs such a call
(`guarded`), and in every thread that call starts, those raise `ToolExit` instead, with a message naming what
was running (the tool, the reward function) and the isolation setting that moves it out; the call then fails
(also when the attempt was in a thread the call started and the call itself returned), and the run goes on (a
tool's failed call) or stops with that one message (a reward function's; its signals are let through: SIGINT
and SIGTERM are the trainer's graceful stop, SIGKILL is reported as a kill). Everywhere else (other threads, a
process the call forked) they do what they always do.

Why here, beside `errors.py` in the lowest layer: reward functions run in `rewards` (layer 2), tools in
`rollout` (4); both use one guard, which needs nothing but the standard library.

How, and the limit that follows:

- `os.kill`, `os.killpg` and `signal.pthread_kill` are stopped by an audit hook (`sys.addaudithook`),
  which sees the call however the code got hold of the function (`from os import kill` included).
- `os._exit`, `os.abort` and `signal.raise_signal` raise no audit event, so they are replaced in `os`
  and `signal`, once, when this module is imported (grpokit's tool and reward loading import it first): a
  user module loaded after that which binds `from os import _exit` gets the guarded one. A reference taken
  before grpokit was imported (a script that does `from os import _exit` before `import grpokit`) is
  the real function, which nothing in-process can intercept: that exit ends the trainer.
- Threads the call starts inherit the guard through `threading`'s thread start (`threading.Thread`,
  `concurrent.futures`, `_thread.start_new_thread`); a thread started through a `_thread` function
  bound before this module was imported does not.

Those, and the ways out that no guard sees (a crash in native code, `ctypes`, a signal from another
process, the OOM killer), are what `tools.isolation = "process"` and `rewards.isolation = "process"` are
for: the code runs in a worker process, where it costs the worker instead (rollout/tool_workers.py,
rewards/worker_pool.py). The guard is at work in a tool worker too (an exit would end the worker and the
environment instances it holds); `in_tool_worker()` makes its messages say so, instead of advising the
isolation that is already set.
"""

from __future__ import annotations

import _thread
import functools
import os
import signal
import sys
import threading
from typing import Any, Callable

_local = threading.local()
_real: dict[str, Callable] = {}
_lock = threading.Lock()
_pid = [0]  # the trainer's process: a child the guarded code forked may exit as it likes
TOOL = ("the tool", 'tools.isolation = "process" runs tools where that ends a worker, not the trainer')
_host = {"own": "the trainer's own process", "process": "the trainer's process", "group": "the trainer's process group",
         "ends": "the trainer", "advise": True}  # what an exit would end here; whether to name the isolation


def in_tool_worker() -> None:
    """This process is a `tools.isolation = "process"` worker: an exit would end it, not the trainer."""
    _host.update(own="its tool worker's own process", process="its tool worker's process",
                 group="its tool worker's process group",
                 ends="its tool worker process (tools.isolation = \"process\") and the environment instances in it",
                 advise=False)


def reward_function(name: str) -> tuple[str, str, bool]:
    """(who, fix, signals) for `guarded`: the reward function `name`, the setting that runs it in a worker, and
    no guard on signals: a reward's SIGINT or SIGTERM to the trainer is the trainer's graceful stop (it finishes
    the step and saves), and a SIGKILL is as if the OOM killer came, which the run reports; only the exits that
    end the run without a word (os._exit, os.abort) are stopped."""
    return (f"reward function '{name}'",
            'rewards.isolation = "process" runs it in a worker process, where that ends the worker, not the trainer',
            False)


class ToolExit(SystemExit):
    """Guarded code tried to end the trainer's process (a SystemExit, so that `except Exception` in that code
    does not swallow it and a thread it started ends quietly)."""


class _Call:
    """One guarded call: who runs (the tool, a reward function), the fix to name, the first exit any of its
    threads tried."""

    def __init__(self, who: str, fix: str, signals: bool = True):
        self.who, self.fix = who, fix
        self.signals = signals  # signals to this process stopped too (tools), or only the exits (rewards)
        self.exit: str | None = None


def guarded(fn: Callable[[], Any], runner: tuple[str, str]) -> Callable[[], Any]:
    """`fn` to be run in a thread (in which, and in whose threads, the exits above raise `ToolExit`), by
    `runner`: (who, fix), `TOOL` or `reward_function(name)`, which the messages name."""
    install()

    @functools.wraps(fn)
    def run():
        call = _local.call = _Call(*runner)
        try:
            value = fn()
        finally:
            _local.call = None
        if call.exit:  # a thread the call started tried to end the trainer: the call fails all the same
            raise ToolExit(call.exit)
        return value

    return run


def _current() -> _Call | None:
    call = getattr(_local, "call", None)
    return call if call is not None and os.getpid() == _pid[0] else None


def _stop(attempt: str) -> None:
    """In a guarded call: record the attempt ("called os._exit(3), which would end the trainer") and raise
    ToolExit naming who made it and the fix; elsewhere nothing."""
    call = _current()
    if call is not None:
        message = f"{call.who} {attempt}" + (f"; {call.fix}" if _host["advise"] else "")
        call.exit = call.exit or message
        raise ToolExit(message)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _at_trainer(pid: int) -> bool:
    """Whether a signal to `pid` (os.kill's meaning) reaches the trainer's own process."""
    return pid in (0, -1, os.getpid()) or -pid == os.getpgrp()


def _audit(event: str, args: tuple) -> None:
    """The audit hook: signals to the trainer from a guarded call, however the function was reached."""
    if event not in ("os.kill", "os.killpg", "signal.pthread_kill") or _current() is None \
            or not _current().signals:
        return
    target, sig = args
    if sig == 0:
        return
    if event == "os.kill" and _at_trainer(target):
        _stop(f"sent {_signal_name(sig)} to {_host['own']}")
    elif event == "os.killpg" and target in (0, os.getpgrp()):
        _stop(f"sent {_signal_name(sig)} to {_host['group']}")
    elif event == "signal.pthread_kill":  # every thread it can reach is one of this process's
        _stop(f"sent {_signal_name(sig)} to a thread of {_host['process']}")


def _inheriting(start: Callable) -> Callable:
    """A thread-start function whose new threads belong to the guarded call that starts them."""

    @functools.wraps(start)
    def start_thread(function, *rest, **options):
        call = _current()
        if call is None:
            return start(function, *rest, **options)

        def in_call(*a, **k):
            _local.call = call
            try:
                return function(*a, **k)
            except ToolExit:
                pass  # recorded on the call, which fails; the thread just ends

        return start(in_call, *rest, **options)

    return start_thread


def install() -> None:
    """Put the guard in place (once): the audit hook, guarded os._exit, os.abort and signal.raise_signal,
    and thread starts that pass a guarded call on."""
    with _lock:
        if _real:
            return
        _real.update(_exit=os._exit, abort=os.abort, raise_signal=signal.raise_signal)
        _pid[0] = os.getpid()

    @functools.wraps(_real["_exit"])
    def _exit(code):
        _stop(f"called os._exit({code}), which would end {_host['ends']}")
        _real["_exit"](code)

    @functools.wraps(_real["abort"])
    def abort():
        _stop(f"called os.abort(), which would end {_host['ends']}")
        _real["abort"]()

    @functools.wraps(_real["raise_signal"])
    def raise_signal(sig):
        if (call := _current()) is not None and call.signals:
            _stop(f"raised {_signal_name(sig)} in {_host['process']}")
        _real["raise_signal"](sig)

    os._exit, os.abort, signal.raise_signal = _exit, abort, raise_signal
    for name in ("_start_new_thread", "_start_joinable_thread"):  # what Thread.start calls (3.13: the second)
        if hasattr(threading, name):
            setattr(threading, name, _inheriting(getattr(threading, name)))
    _thread.start_new_thread = _inheriting(_thread.start_new_thread)
    sys.addaudithook(_audit)


install()  # at import, before tool and reward modules load: their `from os import _exit` binds the guarded one
