"""The ways a tool could end the trainer's own process, turned into a failed call.

Tools and environments run in the trainer's process by default (`tools.isolation = "none"`), in threads
(`tools.call_within`). `sys.exit` there is only an exception; `os._exit`, `os.abort` and a signal sent
to the trainer's own process (`os.kill(os.getpid(), SIGKILL)`, `os.killpg`, `signal.pthread_kill`,
`signal.raise_signal`) would end the run at once, with no message and no checkpoint of the finished
steps. While a thread runs a tool (`guarded`), and in every thread that tool starts, those raise
`ToolExit` instead; the call then fails with a result naming what it tried (also when the attempt was
in a thread the tool started and the tool itself returned), and the run goes on. Everywhere else
(other threads, a process the tool forked) they do what they always do.

How, and the limit that follows:

- `os.kill`, `os.killpg` and `signal.pthread_kill` are stopped by an audit hook (`sys.addaudithook`),
  which sees the call however the tool got hold of the function (`from os import kill` included).
- `os._exit`, `os.abort` and `signal.raise_signal` raise no audit event, so they are replaced in `os`
  and `signal`, once, when this module is imported (grpokit's tool loading imports it first): a tool
  module loaded after that which binds `from os import _exit` gets the guarded one. A reference taken
  before grpokit was imported (a script that does `from os import _exit` before `import grpokit`) is
  the real function, which nothing in-process can intercept: that exit ends the trainer.
- Threads the tool starts inherit the guard through `threading`'s thread start (`threading.Thread`,
  `concurrent.futures`, `_thread.start_new_thread`); a thread started through a `_thread` function
  bound before this module was imported does not.

Those, and the ways out that no guard sees (a crash in native code, `ctypes`, a signal from another
process, the OOM killer), are what `tools.isolation = "process"` is for: tools run in a worker
process, where they cost the worker instead (rollout/tool_workers.py). The guard is at work there too
(an exit would end the worker and the environment instances it holds); `in_tool_worker()` makes its
messages say so, instead of advising the isolation that is already set.
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
_pid = [0]  # the trainer's process: a child the tool forked may exit as it likes
ISOLATE = 'tools.isolation = "process" runs tools where that ends a worker, not the trainer'
_host = {"own": "the trainer's own process", "process": "the trainer's process", "group": "the trainer's process group",
         "ends": "the trainer", "advice": f"; {ISOLATE}"}  # what an exit would end here, what to do about it


def in_tool_worker() -> None:
    """This process is a `tools.isolation = "process"` worker: an exit would end it, not the trainer."""
    _host.update(own="its tool worker's own process", process="its tool worker's process",
                 group="its tool worker's process group",
                 ends="its tool worker process (tools.isolation = \"process\") and the environment instances in it",
                 advice="")


class ToolExit(SystemExit):
    """A tool tried to end the trainer's process (a SystemExit, so that `except Exception` in the tool does not
    swallow it and a thread the tool started ends quietly)."""


class _Call:
    """One guarded call: the first exit any of its threads tried."""

    def __init__(self):
        self.exit: str | None = None


def guarded(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` to be run in a thread of its own, in which (and in whose threads) the exits above raise `ToolExit`."""
    install()

    @functools.wraps(fn)
    def run():
        call = _local.call = _Call()
        try:
            value = fn()
        finally:
            _local.call = None
        if call.exit:  # a thread the tool started tried to end the trainer: the call fails all the same
            raise ToolExit(call.exit)
        return value

    return run


def _current() -> _Call | None:
    call = getattr(_local, "call", None)
    return call if call is not None and os.getpid() == _pid[0] else None


def _stop(message: str) -> None:
    """In a guarded call: record the attempt and raise ToolExit; elsewhere nothing."""
    call = _current()
    if call is not None:
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
    if event not in ("os.kill", "os.killpg", "signal.pthread_kill") or _current() is None:
        return
    target, sig = args
    if sig == 0:
        return
    if event == "os.kill" and _at_trainer(target):
        _stop(f"the tool sent {_signal_name(sig)} to {_host['own']}{_host['advice']}")
    elif event == "os.killpg" and target in (0, os.getpgrp()):
        _stop(f"the tool sent {_signal_name(sig)} to {_host['group']}{_host['advice']}")
    elif event == "signal.pthread_kill":  # every thread it can reach is one of this process's
        _stop(f"the tool sent {_signal_name(sig)} to a thread of {_host['process']}{_host['advice']}")


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
        _stop(f"the tool called os._exit({code}), which would end {_host['ends']}{_host['advice']}")
        _real["_exit"](code)

    @functools.wraps(_real["abort"])
    def abort():
        _stop(f"the tool called os.abort(), which would end {_host['ends']}{_host['advice']}")
        _real["abort"]()

    @functools.wraps(_real["raise_signal"])
    def raise_signal(sig):
        _stop(f"the tool raised {_signal_name(sig)} in {_host['process']}{_host['advice']}")
        _real["raise_signal"](sig)

    os._exit, os.abort, signal.raise_signal = _exit, abort, raise_signal
    for name in ("_start_new_thread", "_start_joinable_thread"):  # what Thread.start calls (3.13: the second)
        if hasattr(threading, name):
            setattr(threading, name, _inheriting(getattr(threading, name)))
    _thread.start_new_thread = _inheriting(_thread.start_new_thread)
    sys.addaudithook(_audit)


install()  # at import, before tool modules load: their `from os import _exit` then binds the guarded one
