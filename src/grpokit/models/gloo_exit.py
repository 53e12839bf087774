"""A torchrun process's exit without gloo's worker threads aborting it (models/parallel.py joins the group)."""

from __future__ import annotations

import atexit
import os
import time


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
