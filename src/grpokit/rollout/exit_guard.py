"""The ways a tool could end the trainer's own process, turned into a failed call.

Tools and environments run in the trainer's process by default (`tools.isolation = "none"`), in threads
(`tools.call_within`). `sys.exit` there is only an exception; `os._exit`, `os.abort` and a signal sent
to the trainer's own process (`os.kill(os.getpid(), SIGKILL)`, `os.killpg`, `signal.raise_signal`)
would end the run at once, with no message and no checkpoint of the finished steps. While a thread
runs a tool (`guarded`), those functions raise `ToolExit` in that thread instead, so the call fails
with a result naming what it tried, and the run goes on; in every other thread they do what they
always do. The functions are replaced in `os` and `signal` once, at the first guarded call.

Other ways out (a crash in native code, `ctypes`, a signal from another process, the OOM killer) cannot
be caught in-process: `tools.isolation = "process"` runs tools in a worker process, where they cost
the worker instead (rollout/tool_workers.py).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from typing import Any, Callable

_local = threading.local()
_real: dict[str, Callable] = {}
_lock = threading.Lock()
ISOLATE = 'tools.isolation = "process" runs tools where that ends a worker, not the trainer'


class ToolExit(BaseException):
    """A tool tried to end the trainer's process (a BaseException, as SystemExit: `except Exception` in the
    tool does not swallow it)."""


def guarded(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` to be run in a thread of its own, in which the exits above raise `ToolExit`."""
    install()

    @functools.wraps(fn)
    def run():
        _local.tool = True
        try:
            return fn()
        finally:
            _local.tool = False

    return run


def _in_tool() -> bool:
    return getattr(_local, "tool", False)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _at_trainer(pid: int) -> bool:
    """Whether a signal to `pid` (os.kill's meaning) reaches the trainer's own process."""
    return pid in (0, -1, os.getpid()) or -pid == os.getpgrp()


def install() -> None:
    """Replace os._exit, os.abort, os.kill, os.killpg and signal.raise_signal with their guarded forms (once)."""
    with _lock:
        if _real:
            return
        _real.update(_exit=os._exit, abort=os.abort, kill=os.kill, killpg=os.killpg, raise_signal=signal.raise_signal)

    @functools.wraps(_real["_exit"])
    def _exit(code):
        if _in_tool():
            raise ToolExit(f"the tool called os._exit({code}), which would end the trainer; {ISOLATE}")
        _real["_exit"](code)

    @functools.wraps(_real["abort"])
    def abort():
        if _in_tool():
            raise ToolExit(f"the tool called os.abort(), which would end the trainer; {ISOLATE}")
        _real["abort"]()

    @functools.wraps(_real["kill"])
    def kill(pid, sig):
        if _in_tool() and sig != 0 and _at_trainer(pid):
            raise ToolExit(f"the tool sent {_signal_name(sig)} to the trainer's own process; {ISOLATE}")
        _real["kill"](pid, sig)

    @functools.wraps(_real["killpg"])
    def killpg(pgid, sig):
        if _in_tool() and sig != 0 and pgid in (0, os.getpgrp()):
            raise ToolExit(f"the tool sent {_signal_name(sig)} to the trainer's process group; {ISOLATE}")
        _real["killpg"](pgid, sig)

    @functools.wraps(_real["raise_signal"])
    def raise_signal(sig):
        if _in_tool():
            raise ToolExit(f"the tool raised {_signal_name(sig)} in the trainer's process; {ISOLATE}")
        _real["raise_signal"](sig)

    os._exit, os.abort, os.kill, os.killpg, signal.raise_signal = _exit, abort, kill, killpg, raise_signal
