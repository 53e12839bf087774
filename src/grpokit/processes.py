"""Every child process a run starts is started, watched and stopped here, one way.

The kinds, each a small use of this module:

- rollout workers (`training/rollout_workers.py`): multiprocessing spawn, since they share torch tensors,
  a lock and a gloo channel with the trainer; they beat a heartbeat and answer orders.
- reward and tool workers (`rewards/worker_pool.py`, `rollout/tool_workers.py`): fresh interpreters started
  by exec (no torch, no copy of the trainer's locks), one call at a time over a pipe.
- the sandbox's judge (`rewards/sandbox.py`): an isolated interpreter per answer, fed on stdin.

What each one gets from here:

- **start** (`popen`): a session of its own for each child (`start_new_session`, or `own_session()` in a
  spawned one), so that one `killpg` stops it together with whatever it started. Children that must die
  with the trainer start from a `Launcher`, one thread that lives as long as their pool: the kernel's
  parent-death signal fires when the *thread* that started a child ends, not the process.
- **death with the parent** (`die_with_parent`, called first thing in the child): SIGKILL (or the signal
  given) when the trainer dies, however it dies; a child whose parent died before the call gets it at once.
  The sandbox's judge is the exception: bubblewrap's `--die-with-parent` covers it; without bubblewrap a
  judge that waits on a sleeping answer outlives a SIGKILLed trainer (its uid switch would clear the signal).
- **heartbeat** (`start_heartbeat` in the child, `beat_age` in the parent): a thread of the child writes
  `time.monotonic()` into a shared slot every `HEARTBEAT_S`; a frozen child (SIGSTOP, a debugger, a
  stuck interpreter) stops beating.
- **deadline** (`Inbox`, `receive`): every blocking receive from a child runs on a thread of this module,
  never on the caller's, who waits with a deadline and looks at its children (exited? beating?) between
  waits. A child frozen halfway through a message, or after queuing a batch whose shared tensors the
  receiver still has to fetch from it over a local socket, cannot hold the trainer past its deadline.
- **stop** (`stop`): ask (the caller closes the pipe or sends its last order), wait `grace` seconds, then
  SIGKILL the child's process group and reap it: nothing it started is left behind.

Why here, beside `errors.py` in the lowest layer: reward workers and the sandbox's judge start in
`rewards` (layer 2), tool workers in `rollout` (4), rollout workers in `training` (5); what they share
must sit below all three. It needs nothing but the standard library, so a reward worker (which imports
no torch) and a spawned rollout worker import it for free.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

HEARTBEAT_S = 0.5  # a child's beat; a parent calls it hung after max(its timeout, 4 beats) without one
_PR_SET_PDEATHSIG = 1


# ---- the child's side ----------------------------------------------------------------------------------


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """Have the kernel send `signum` to this process when its parent dies (Linux prctl PR_SET_PDEATHSIG),
    however it dies; if `parent` died before that took effect, the signal comes now. Elsewhere, only the
    check now (a heartbeat also checks its parent). A child with a handler for `signum` (a guard that kills
    its group) gets its handler run either way."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)


def own_session() -> None:
    """Make this (spawned) child the leader of a session of its own, so that `stop` kills what it started."""
    with contextlib.suppress(OSError):  # already a group leader
        os.setsid()


def ignore_stop_signals() -> None:
    """Ignore Ctrl-C and SIGTERM: the parent stops this child, after it has saved. They were held (blocked)
    by the parent while it started this process (`stop_signals_held`), and are released now, ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def start_heartbeat(beats, index: int, parent: int) -> threading.Thread:
    """Write `time.monotonic()` into the shared array `beats[index]` every HEARTBEAT_S from a thread of its
    own (a slow step of the main thread does not stop it); exit when the parent is gone."""

    def beat() -> None:
        while True:
            beats[index] = time.monotonic()
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(HEARTBEAT_S)

    thread = threading.Thread(target=beat, daemon=True, name="heartbeat")
    thread.start()
    return thread


# ---- the parent's side ---------------------------------------------------------------------------------


@contextlib.contextmanager
def stop_signals_held():
    """Start children inside this: a Ctrl-C while one starts must not kill it, and it can only ignore SIGINT /
    SIGTERM (`ignore_stop_signals`) once it has imported what it needs, seconds later. Held (blocked) here,
    the signals stay blocked in the child (the mask is inherited through fork and exec) until it ignores
    them; the parent gets its own when they are released."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held) if hasattr(signal, "pthread_sigmask") else None
    try:
        yield
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def beat_age(beats, index: int) -> float:
    """Seconds since child `index` last beat."""
    return time.monotonic() - beats[index]


def is_hung(beats, index: int, timeout_s: float) -> bool:
    """Whether child `index` has not beaten for `timeout_s` (at least four beats, so a busy second is not one)."""
    return beat_age(beats, index) > max(timeout_s, 4 * HEARTBEAT_S)


def popen(argv: list[str], **kwargs) -> subprocess.Popen:
    """Start `argv` in a session of its own: one `stop` takes it and whatever it starts."""
    return subprocess.Popen(argv, start_new_session=True, **kwargs)


class Launcher:
    """The thread children are started from, kept for as long as they may live (the parent-death signal
    fires when the starting thread ends). `popen` starts a fresh interpreter in a session of its own."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return self._pool.submit(popen, argv, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _kill_group(child) -> None:
    """SIGKILL the process group `child` leads (it, and what it started), or, while it leads none (a spawned
    child before `own_session`), the child alone; never a pid already reaped, which may be another's now."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        if _code(child) is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child.pid, signal.SIGKILL)


def _code(child) -> int | None:
    return child.poll() if isinstance(child, subprocess.Popen) else child.exitcode


def stop(children: list, grace: float = 0.0) -> list[int | None]:
    """Stop `children` (subprocess.Popen or multiprocessing.Process), already asked to end (their pipe closed,
    their last order sent): wait up to `grace` seconds in all, then SIGKILL each one's process group, and
    reap. Their exit codes (negative: the signal); None for one that could not be reaped (it never is:
    SIGKILL ends a stopped process too)."""
    deadline, codes = time.monotonic() + grace, []
    for child in children:
        if grace:  # none: nothing is reaped before the kill, so the leader's pid still names its group
            _wait(child, max(0.0, deadline - time.monotonic()))
        if child.pid is not None:
            _kill_group(child)
        codes.append(_wait(child, 10.0))
    return codes


def _wait(child, timeout: float) -> int | None:
    if isinstance(child, subprocess.Popen):
        with contextlib.suppress(subprocess.TimeoutExpired):
            return child.wait(timeout)
        return None
    if child.pid is None:  # a multiprocessing.Process never started
        return None
    child.join(timeout)
    return child.exitcode


class Inbox:
    """Messages from children, received on a thread of their own: a receive that blocks (a child frozen in
    the middle of a message, or holding the shared memory of one) blocks that thread, never the caller,
    who waits here with a deadline. `receive(timeout)` returns one message or raises queue.Empty; an error
    it raises is handed to the caller in the message's place (the sender of that message died), and the
    thread goes on until `close()`."""

    def __init__(self, receive: Callable[[float], Any], name: str):
        self._receive, self._messages = receive, queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._pump, daemon=True, name=name)
        self._thread.start()

    def _pump(self) -> None:
        while not self._closed.is_set():
            try:
                self._messages.put((True, self._receive(0.2)))
            except queue.Empty:
                continue
            except Exception as e:  # noqa: BLE001 - e.g. this message's sender died before it was read: the
                self._messages.put((False, e))  # caller hears it, in its place; the others may still come

    def get(self, timeout: float) -> Any:
        """The next message within `timeout` seconds (queue.Empty if none), or the error receiving it raised."""
        ok, value = self._messages.get(timeout=max(0.0, timeout))
        if not ok:
            raise value
        return value

    def close(self, within_s: float = 5.0) -> None:
        """Stop receiving; call it once the children are stopped, before closing the channel."""
        self._closed.set()
        self._thread.join(within_s)


def receive(recv: Callable[[], Any], within_s: float) -> Any:
    """`recv()` (one blocking receive from a child) on a thread of its own: its result, its error, or
    TimeoutError after `within_s` seconds. After a TimeoutError the caller must stop the child: that ends
    the receive, which still holds the channel."""
    done, box = threading.Event(), []

    def run() -> None:
        try:
            box.append((True, recv()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append((False, e))
        done.set()

    threading.Thread(target=run, daemon=True, name="receive").start()
    if not done.wait(None if within_s == math.inf else max(0.0, within_s)):
        raise TimeoutError(f"no message within {within_s:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value
