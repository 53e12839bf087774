"""Reward functions in worker processes (`rewards.isolation = "process"`): a time limit that really stops them.

`core._call` bounds a call with a thread, which cannot be killed. Here calls run in warm worker processes
(started, watched and stopped by `grpokit.processes`, as every child of a run):
past `spec.timeout` the worker's process group is killed and the worker replaced; a crash in native code
(segfault, os._exit, the OOM killer) costs a worker, not the trainer; such answers raise, or score None with
`on_error="skip"`. Workers are fresh interpreters (fork+exec: a forked trainer would inherit locks its torch
threads hold) in their own session (one killpg stops what the function started), dying with the trainer
(PR_SET_PDEATHSIG) together with what their functions started (a guard process per worker kills the
worker's process group when the worker dies), importing `grpokit.rewards` without its `__init__` (no torch:
seconds and ~200 MB each, unless the function needs it). A batch is cut into chunks of whole groups, one per
worker, run in parallel. `log_metric`/`log_extra` calls are replayed in the trainer; `environments` (live
objects) are not sent, other arguments that do not pickle arrive as None. A crash prints nothing (no
faulthandler dump per crash): the error or the ungraded count names the function. Limits: a process the
function moves out of the worker's process group (`setsid`) outlives a SIGKILLed trainer; a function's state
is per worker; POSIX only (the module still imports elsewhere; the guard is Linux's).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
import weakref
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from grpokit import processes
from grpokit.errors import RewardError, RewardLoadError, RewardTimeoutError

if TYPE_CHECKING:
    from grpokit.rewards.core import RewardSpec

BUILD_LIMIT_S = 300.0  # for a fresh worker to import the function; not part of the call's timeout
WORKER_ENV = "GRPOKIT_REWARD_WORKER"
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", WORKER_ENV: "1"}
_BOOT = ("import importlib.util as u, sys; sys.path[:] = sys.argv[4:]; "
         "s = u.spec_from_file_location('grpokit_reward_worker', sys.argv[1]); m = u.module_from_spec(s); "
         "sys.modules[s.name] = m; s.loader.exec_module(m); m._serve(int(sys.argv[2]), int(sys.argv[3]))")


class RewardWorkerError(RewardTimeoutError):
    """A worker died (segfault, os._exit, OOM kill) or could not load the function. A RewardTimeoutError only
    so that `compute_rewards` passes it on instead of re-running one sample at a time (crashing fresh workers)."""


class Sendable(NamedTuple):
    kind: str  # "ref": the pickle of (reference, kwargs) for the registry; "pickle": of the callable
    blob: bytes  # also the key a worker caches the built function under
    label: str  # how messages name it


def pickled(value: Any) -> bytes | None:
    with contextlib.suppress(Exception):
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return None


def _importable(module: str) -> bool:
    """Whether a fresh interpreter finds `module`; a file loaded by reference is in sys.modules, not there."""
    with contextlib.suppress(Exception):
        return any(hasattr(f, "find_spec") and f.find_spec(module.partition(".")[0], None) for f in sys.meta_path)
    return False


def sendable(name: str, source: Any) -> Sendable:
    """`source` (a reference, (reference, kwargs) or a callable) checked and ready to send to a worker, named
    `name` in messages; RewardLoadError (one line, with the fix) if it cannot be."""
    source = (source, {}) if isinstance(source, str) else source
    where = f"reward function '{name}' cannot run in a worker process:"
    if isinstance(source, tuple):
        if len(source) != 2 or not isinstance(source[0], str) or not isinstance(source[1], dict):
            raise RewardLoadError(f"{where} source {source!r} must be (reference, kwargs), e.g. "
                                  f"('my_rewards.py:score', {{}}) or ('countdown', {{'format_score': 0.1}})")
        (ref, kwargs), (module, sep, attr) = source, source[0].rpartition(":")
        if sep and (module.endswith(".py") or "/" in module or "\\" in module):
            if not Path(module).is_file():
                raise RewardLoadError(f"{where} file {module!r} not found from {Path.cwd()}; fix the path")
            ref = f"{Path(module).resolve()}:{attr}"  # the trainer may chdir
        if (blob := pickled((ref, kwargs))) is None:
            raise RewardLoadError(f"{where} its arguments {kwargs!r} do not pickle; give plain values")
        return Sendable("ref", blob, ref)
    if not callable(source):
        raise RewardLoadError(f"{where} source must be a reference or a function, not {type(source).__name__}")
    label = getattr(source, "__qualname__", None) or type(source).__qualname__
    where = f"reward function '{name}' ({label}) cannot run in a worker process:"
    module = getattr(source, "__module__", None) or type(source).__module__
    try:
        blob = pickle.dumps(source, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - lambdas, local functions, objects holding them
        raise RewardLoadError(f"{where} it does not pickle ({type(e).__name__}: {e}); define it with `def` at the "
                              f"top of a .py file, or pass source=('file.py:fn', {{}}) or (built-in, kwargs)") from None
    if module == "__main__":  # a worker loads the script as a file (where its __name__ is not "__main__")
        path = getattr(sys.modules["__main__"], "__file__", None)
        if not path or not isinstance(source, types.FunctionType) or "." in label:
            raise RewardLoadError(f"{where} it is in __main__ but no function of a script; move it into a .py file")
        if not re.search(r"^if\s+__name__\s*==\s*['\"]__main__['\"]\s*:", Path(path).read_text(), re.M):
            raise RewardLoadError(f"{where} the script {path} has no `if __name__ == \"__main__\":` guard, and a "
                                  f"worker loads the script to find the function (running its code); put the "
                                  f"script's code under that guard or move the function into its own file")
        return sendable(name, (f"{path}:{label}", {}))
    if not _importable(module):
        raise RewardLoadError(f"{where} its module {module!r} is a file loaded by reference, which a worker "
                              f"cannot import by name; pass that reference 'path/to/file.py:fn' as the source")
    return Sendable("pickle", blob, label)


def check_isolatable(spec: RewardSpec, source: Any = None) -> None:
    """At start-up, RewardLoadError (one line: the function, the fix) if `spec` cannot run in a worker from
    `source` (default `spec.fn`): lambdas, nested functions, functions of a file loaded by reference (pass the
    reference), code typed into a notebook or `python -c`, a script without `if __name__ == "__main__":`."""
    sendable(spec.name, spec.fn if source is None else source)


def _stop(slots: list, grace: float = 0.0, launcher: processes.Launcher | None = None) -> list[int]:
    """Empty `slots`: with `grace`, close the pipes (an idle worker exits on EOF) and wait that long; kill the
    process groups, reap, and only then close what is still open: a receive that timed out may still be
    reading a pipe, and ends when its worker dies (closed under it, its descriptor could be reused)."""
    live, slots[:] = [w for w in slots if w is not None], [None] * len(slots)
    if grace:
        for w in live:
            w.conn.close()
    codes = processes.stop([w.proc for w in live], grace)
    for w in live:
        w.conn.close()
    if launcher is not None:
        launcher.close()
    return codes


def _how(code: int) -> str:
    name = signal.Signals(-code).name if -code in set(signal.Signals) else f"signal {-code}"
    return f"exit code {code}" if code >= 0 else name + (", out of memory?" if code == -signal.SIGKILL else "")


class RewardPool:
    """Warm worker processes for isolated rewards; a context manager, or `close()`. Workers start at first use
    (or `start()`), keep the functions they built, are replaced when killed or dead; one call at a time."""

    def __init__(self, workers: int = 2):
        if type(workers) is not int or workers < 1:
            raise ValueError(f"RewardPool: workers must be an integer >= 1, got {workers!r}")
        self.workers, self._slots, self._lock = workers, [None] * workers, threading.Lock()
        self._launcher = processes.Launcher("reward-pool")
        self._close = weakref.finalize(self, _stop, self._slots, 1.0, self._launcher)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop and reap every worker (and what its functions started); the pool cannot be used again."""
        with self._lock:
            self._close()

    def start(self) -> RewardPool:
        """Start the missing workers now rather than at first use."""
        with self._lock:
            for i in range(self.workers):
                self._worker(i)
        return self

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._slots if w is not None]

    def _worker(self, i: int) -> types.SimpleNamespace:
        if self._slots[i] is not None and self._slots[i].proc.poll() is None:
            return self._slots[i]
        if self._slots[i] is not None:  # died between batches
            self._discard(i)
        if not self._close.alive:
            raise RuntimeError("this RewardPool is closed; make a new one")
        if os.environ.get(WORKER_ENV):  # a script without a guard, loaded by a worker, would start one
            raise RewardError("a reward worker started a RewardPool: the script it loaded to find a function "
                              "trains at import; put the script's code under `if __name__ == \"__main__\":`")
        ours, theirs = socket.socketpair()
        with theirs:
            cmd = [sys.executable, "-c", _BOOT, __file__, str(theirs.fileno()), str(os.getpid()), *sys.path]
            proc = self._launcher.popen(cmd, stdin=subprocess.DEVNULL, env=dict(os.environ, **_ONE_THREAD),
                                        pass_fds=(theirs.fileno(),))
        self._slots[i] = types.SimpleNamespace(proc=proc, conn=Connection(ours.detach()), known=set())
        return self._slots[i]

    def _discard(self, i: int) -> int:
        (code,), self._slots[i] = _stop([self._slots[i]]), None
        return code

    def run(self, source: Sendable, jobs: list[dict], collect: tuple, timeout: float | None) -> list[tuple]:
        """`jobs` (one per worker) in parallel; one reply each: ("ok", out, records), ("raise", pickle, type,
        message, traceback), ("unbuilt", type, message), ("timeout", pid, building), ("died", pid, how)."""
        limit, replies = math.inf if timeout is None else float(timeout), [None] * len(jobs)
        busy: dict = {}  # conn -> [chunk, worker, deadline, building]
        with self._lock:
            try:
                for i, job in enumerate(jobs):
                    w = self._worker(i)
                    building = source.blob not in w.known
                    try:
                        w.conn.send((source.kind, source.blob, job, collect))
                    except OSError:  # it died just now
                        replies[i] = ("died", w.proc.pid, _how(self._discard(i)))
                        continue
                    busy[w.conn] = [i, w, time.monotonic() + (BUILD_LIMIT_S if building else limit), building]
                while busy:
                    soonest = min(entry[2] for entry in busy.values()) - time.monotonic()
                    for conn in wait(list(busy), None if soonest == math.inf else max(0.0, soonest)):
                        entry = busy[conn]
                        try:  # a worker frozen in the middle of its reply holds a thread, not the trainer;
                            # a reply already there is read even at its deadline
                            msg = processes.receive(conn.recv, max(entry[2] - time.monotonic(), 1.0))
                        except TimeoutError:
                            entry[2] = -math.inf  # past its deadline: stopped below
                            continue
                        except (EOFError, OSError):
                            msg = ("died", entry[1].proc.pid, _how(self._discard(entry[0])))
                        if msg[0] == "ready":  # built: the call's own limit starts now
                            entry[1].known.add(source.blob)
                            entry[2:] = [time.monotonic() + limit, False]
                            continue
                        replies[entry[0]] = msg
                        del busy[conn]
                    for conn, (i, w, deadline, building) in list(busy.items()):
                        if time.monotonic() >= deadline:
                            replies[i] = ("timeout", w.proc.pid, building)
                            self._discard(i)
                            del busy[conn]
            except BaseException:  # Ctrl-C, a failed send: no worker may keep a stale answer
                for i, *_ in busy.values():
                    self._discard(i)
                raise
        return replies


def _defer_package_init(name: str) -> None:
    """Make package `name` run its `__init__` at the first attribute it lacks, so that importing one of its
    submodules (`grpokit.rewards.verifiers`) does not import everything `__init__` does (torch)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or name in sys.modules:
        return
    module = importlib.util.module_from_spec(spec)

    def __getattr__(attr):
        if attr.startswith("__") or importlib.util.find_spec(f"{name}.{attr}") is not None:
            raise AttributeError(attr)  # a probe, or `from package import submodule`: no __init__ needed
        del module.__getattr__
        spec.loader.exec_module(module)
        return getattr(module, attr)

    module.__getattr__ = __getattr__
    sys.modules[name] = module
    setattr(sys.modules[name.rpartition(".")[0]], name.rpartition(".")[2], module)


def _guard(fd: int) -> int | None:
    """Fork the worker's guard: a process in the worker's process group that kills the whole group (what the
    reward functions started) when the worker dies, however it dies (PR_SET_PDEATHSIG: a SIGKILLed trainer
    takes the worker with it, and its children would otherwise live on under PID 1). The guard runs no reward
    code, so its Python signal handler always runs, where the worker's might wait on a native call. Its pid, or
    None off Linux. Forked first, while the worker has no threads and holds nothing but `fd`, which the guard
    closes: the trainer must see the pipe close when the worker dies."""
    if not sys.platform.startswith("linux"):
        return None
    worker = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:
        os.close(fd)
        signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
        processes.die_with_parent(worker, signal.SIGTERM)
        while True:
            signal.pause()
    finally:
        os._exit(0)


def _serve(fd: int, parent: int) -> None:
    """A worker: die with the trainer, build each function once, answer calls until the pipe closes."""
    processes.die_with_parent(parent)
    guard, me = _guard(fd), os.getpid()
    conn, functions = Connection(fd), {}
    _defer_package_init("grpokit.rewards")
    while True:
        try:
            kind, blob, kwargs, collect = conn.recv()
        except EOFError:  # the pool closed: the guard's work is the pool's now (it kills the group)
            if guard is not None:
                with contextlib.suppress(ProcessLookupError, ChildProcessError):  # it may be gone already
                    os.kill(guard, signal.SIGKILL)
                    os.waitpid(guard, 0)
            return
        if blob not in functions:
            try:
                fn = pickle.loads(blob)
                if kind == "ref":  # (reference, factory kwargs)
                    from grpokit.rewards.registry import resolve_reward
                    fn = resolve_reward(fn[0], **fn[1])
                functions[blob] = fn
                if hasattr(sys.modules.get("torch"), "set_num_threads"):
                    sys.modules["torch"].set_num_threads(1)
            except BaseException as e:  # noqa: BLE001 - reported to the trainer
                conn.send(("unbuilt", type(e).__name__, str(e)))
                continue
            conn.send(("ready",))
        records: list = []
        for name in collect:
            kwargs[name] = lambda key, value, _name=name: records.append((_name, key, value))
        try:
            out = functions[blob](**kwargs)
            _forked_child_leaves(me)
            if inspect.iscoroutine(out):
                import asyncio
                out = asyncio.run(out)
            conn.send(("ok", out.tolist() if hasattr(out, "tolist") else out, records))  # numpy, tensors
        except BaseException as e:  # noqa: BLE001 - the function's raise (or an unpicklable answer) goes back
            _forked_child_leaves(me)
            conn.send(("raise", pickled(e), type(e).__name__, str(e), traceback.format_exc()))


def _forked_child_leaves(worker: int) -> None:
    """A process the reward function forked that returned (or raised) out of it is not the worker: it leaves
    at once, silently, never answering on the worker's pipe or running its shutdown."""
    if os.getpid() != worker:
        os._exit(0)
