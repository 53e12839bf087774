"""How a torchrun process ends: without gloo's worker threads aborting it, with its launcher, and without the native
noise of a store whose machine is gone (models/parallel.py joins the group and launches the processes)."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from typing import Iterator

from grpokit import processes


def _gloo_workers() -> list[str]:
    """The task ids of this process's gloo worker threads (named `pt_gloo_runloop` by torch), Linux only."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    found = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "pt_gloo_runloop":
                    found.append(tid)
        except OSError:
            pass  # the thread ended
    return found


def _thread_state(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]  # after "(comm)": R running, S sleeping, ...
    except (OSError, IndexError):
        return "gone"


def drain_gloo_workers(limit_s: float = 2.0) -> None:
    """Let gloo's worker threads finish their last collective before the interpreter shuts down.

    A gloo worker drops its finished work, and with it the work's tensors, a moment after the caller's wait
    returned. When Python has dropped such a tensor first, the worker's drop decrefs the tensor's Python object,
    which takes the GIL; once the interpreter is finalizing, Python ends a thread that takes the GIL
    (pthread_exit), and unwinding gloo's C++ loop then calls std::terminate: "terminate called without an
    active exception", SIGABRT, after the run's last step (native stack: ProcessGroupGloo::runLoop ->
    TensorImpl::decref_pyobject -> PyEval_AcquireThread -> pthread_exit). It needs a loaded machine (the worker
    descheduled past the main thread's exit) and a group that outlives destroy_process_group (FSDP2 keeps it).
    Run at exit (atexit, before finalization): the GIL released in short sleeps until every worker has been
    seen parked twice in a row (state S while this thread holds no GIL: waiting for work, not for the GIL)."""
    deadline = time.monotonic() + limit_s
    parked_in_a_row = 0
    while parked_in_a_row < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # the GIL is free: a worker waiting for it takes it and finishes
        workers = _gloo_workers()
        parked = all(_thread_state(t) in ("S", "gone") for t in workers)
        parked_in_a_row = parked_in_a_row + 1 if parked else 0


_draining: list[bool] = []


def drain_at_exit() -> None:
    """drain_gloo_workers at this process's exit, once (registered after the group's own atexit handlers, so
    it runs before them: atexit is last in, first out)."""
    if not _draining:
        _draining.append(True)
        atexit.register(drain_gloo_workers)


def die_with_launcher() -> None:
    """Under torchrun, end this process (SIGKILL) when its launcher, torchrun's agent and its parent, dies. torchrun
    starts each process in a session of its own and sets nothing of the kind, so a launcher killed (`kill -9`, the
    OOM killer, a node's job step cancelled) left its processes running without it: the rest of the run went on with
    a node that could no longer restart, stop or report them (two `--nnodes 2` launchers on one host: the survivor
    still waited in the step's collective for the orphan after 300 s). Ended with its launcher, the process is what
    it is on a machine that went down: a lost process, which the others name (parallel.py `peer_loss`)."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        processes.die_with_parent(os.getppid())


@contextlib.contextmanager
def stderr_silenced() -> Iterator[None]:
    """This process's fd 2 to /dev/null (its Python and native writers alike) for the block. For the store's own
    report of a failed call, a C++ warning with its native stack that logging levels do not reach: after the machine
    that keeps the store is lost every call fails, which the caller expects and handles; unsilenced, some 20 lines of
    frames ("recvVector failed ... Connection was likely closed") came before the survivor's one line."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def silenced_once_said(said_file: str, done: threading.Event) -> None:
    """grpokit's launcher's own stderr (its processes have theirs) silenced from the moment one of its processes
    wrote in `said_file` that it said why the run stops, until `done`: what torchrun's agent prints then is the lost
    machine's echo (the rendezvous's store gone, its shutdown's C++ warning). A thread of the launcher."""
    while not done.wait(0.05):
        if os.path.getsize(said_file):
            with stderr_silenced():
                done.wait()
            return
