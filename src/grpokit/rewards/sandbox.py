"""Sandboxed code-execution reward: run the answer's Python against the row's tests.

    code_execution(completions, tests, **kwargs) -> list[float | None]
    sandbox_isolation(sandbox="auto") -> (level, one-line message)

TRL's calling convention (see `rewards.core`); `tests` is a dataset column that
holds, per row, either a list of test statements (usually `assert f(2) == 4`)
or one string of test code. Registered as "code_execution"; its options are
factory arguments: `rewards.args = {code_execution = {time_limit = 5.0,
memory_mb = 512, workers = 4, sandbox = "auto", python = "..."}}`.

During RL the model writes whatever earns reward, so each answer runs at the
strongest isolation level the machine offers (`sandbox = "auto"`; the option is not
named `isolation` because `rewards.isolation` already means where reward functions run):

- "bubblewrap" (`bwrap` on PATH and able to create namespaces): read-only
  system files, a private 64 MiB tmpfs as the only writable folder, no network,
  its own PID namespace, uid 65534; the run folder, the home directory and /tmp
  are not visible. Details in `rewards.bwrap`.
- "unprivileged-uid" (no bubblewrap, trainer running as root): the answer runs
  as uid 65534 in its own temporary folder: it cannot write or read root's
  files, signal the trainer or fork past its process limit, but it sees the
  file system as any user does (/tmp is writable) and has the network. The
  interpreter must be readable by uid 65534 (a pyenv under /root is not: set `python`).
- "rlimits-only" (no bubblewrap, not root, or `sandbox = "none"`): the
  resource limits below and nothing else; the answer has the trainer's rights.

`sandbox = "bubblewrap"` (or "uid") requires that level: the reward fails to
load, naming the fix, when the machine cannot give it. `sandbox_isolation()`
names the level in force and how to get a stronger one, in one line. docs/SANDBOX.md
has the guarantees and the limits.

What an answer runs:

- The code is the last ```python (or ```py) fenced block of the completion,
  else its last plain ``` block, else the whole text.
- Each answer runs in a fresh `python -I -B` process (isolated mode: no user
  site, no PYTHON* variables), in its own empty working directory, with a
  minimal environment (no inherited variables such as API keys; BLAS/OpenMP
  pools set to one thread), stdin, stdout and stderr on /dev/null, and in its
  own session so that any process it forks is killed with it. `python` chooses
  the interpreter (default: the trainer's own).
- Limits: `time_limit` seconds of CPU (RLIMIT_CPU) and the same wall-clock time
  plus a 1 s start-up allowance (the parent kills the process group);
  `memory_mb` of address space (RLIMIT_AS); 16 MiB per written file
  (RLIMIT_FSIZE); no core dumps; a process/thread limit (RLIMIT_NPROC) against
  fork bombs: 64 in the answer's own user namespace, 256 shared by the answers
  running at once where they share uid 65534 without one, 64 above the user's
  current count at "rlimits-only" (the kernel counts per uid; root is exempt).
- Samples run in parallel, `workers` at a time (threads that wait on processes).

Reward: the fraction of tests that passed, if the program ran to its end.
A list of N tests gives k/N; one string of test code gives 1.0 or 0.0. An answer
whose own code raises (SyntaxError and PermissionError included) passes no test:
0.0. An answer that hangs, runs out of memory, crashes the interpreter or exits
early (`sys.exit` in its own code, `os._exit`, a signal, anywhere), gets 0.0; a
`SystemExit` raised by one of its functions during a test fails that test. A
row whose `tests` is None or empty is not graded (None). Nothing an answer does
raises here; only a failure of the machinery itself (no `python` to start) raises.

Deviations and limits, on purpose:

- The limits are set by the harness inside the child, before the answer's code
  runs, rather than with `subprocess`'s `preexec_fn`: the samples start from a
  thread pool, and Python documents `preexec_fn` as unsafe (it can deadlock the
  child) when the parent has threads. The uid switch of "unprivileged-uid" uses
  Popen's `user=`/`group=`, which run in C in the child and are safe.
- Grading is lazy about the level: "auto" is probed (one test answer) at first use or
  at `sandbox_isolation()`, so that importing this module starts no process.
- The grade cannot be forged through the harness (`sandbox_harness`, `sandbox_judge`,
  `sandbox_wire`): the tests run in a judge process the answer's code never ran in, and which holds
  the only way out; the answer's process only answers requests on its own objects, and what it
  answers is data the judge compares itself. A score is passes / tests, within [0, 1]; an answer
  that breaks the protocol scores 0.0 (its reason in `code_execution.last_grades`, counted as the
  metric `code_execution/refused_reports`). Values of the answer cross by value when they are plain
  data, else as handles: a handle never equals a plain value, so an object with a lying `__eq__`
  fails `assert f() == 5`; a plain list the tests pass is a copy (changes in place come back; a
  list the answer keeps and changes later does not); the answer's globals that shadow a builtin are
  not the tests'.
- RLIMIT_AS counts virtual memory: importing numpy or torch in an answer may
  need more than 512 MB; raise `memory_mb` for such tasks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from grpokit import processes
from grpokit.errors import RewardLoadError
from grpokit.rewards import bwrap
from grpokit.rewards.graders import completion_text
from grpokit.rewards.sandbox_checks import Grade, judge

__all__ = ["code_execution", "code_execution_reward", "extract_code", "run_tests", "sandbox_isolation"]


_STARTUP_GRACE = 1.0  # seconds of wall clock for the interpreter to start, on top of time_limit


_FILE_LIMIT = 16 * 2**20  # bytes per file the answer (and the harness's result file) may write


_NPROC = 64  # processes + threads of one answer where it has a uid (namespace) of its own


_NPROC_SHARED = 256  # the same, for all answers at once where they share uid 65534 without a user namespace


_SANDBOXES = ("auto", "bubblewrap", "uid", "none")  # the `sandbox` option


_ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


_FENCED = re.compile(r"```(?:python|py|python3)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


_ANY_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last ```python block of `text`, else its last ``` block, else the whole text."""
    for pattern in (_FENCED, _ANY_FENCE):
        blocks = pattern.findall(text)
        if blocks:
            return blocks[-1]
    return text


def _as_tests(tests: Any) -> list[str] | None:
    """A row's tests as a list of code strings; None when the row has none."""
    if tests is None:
        return None
    if isinstance(tests, str):
        return [tests] if tests.strip() else None
    if isinstance(tests, (list, tuple)):
        out = [str(t) for t in tests if t is not None and str(t).strip()]
        return out or None
    if hasattr(tests, "tolist"):  # numpy arrays from Parquet / datasets
        return _as_tests(tests.tolist())
    raise TypeError(f"a 'tests' value must be a list of test statements or a string of test code, "
                    f"got {type(tests).__name__}")


# The judge's program is the modules sandbox_wire, _judge, _answer and _harness (each after what it imports),
# sent as source text: the sandbox's interpreter may not have grpokit, nor see its files (bubblewrap).
_HARNESS_MODULES = ("sandbox_wire", "sandbox_judge", "sandbox_answer", "sandbox_harness")
_BOOT = ("import sys\n"
         "for name, text in zip(sys.argv[1::2], sys.argv[2::2]):\n"
         "    module = sys.modules[name] = type(sys)(name)\n"
         "    exec(compile(text, '<' + name + '>', 'exec'), module.__dict__)\n"
         "module.main()\n")


@functools.cache
def _harness_sources() -> tuple[str, ...]:
    folder = Path(__file__).parent
    return tuple(part for name in _HARNESS_MODULES
                 for part in (f"grpokit.rewards.{name}", (folder / f"{name}.py").read_text(encoding="utf-8")))


def harness_argv(python: str) -> list[str]:
    """The judge's command line: `python` in isolated mode loads the harness's modules from their text
    (argv: name, source, name, source, ...) and runs `sandbox_harness.main()`."""
    return [python, "-I", "-B", "-c", _BOOT, *_harness_sources()]


def _run(mode: bwrap.Mode, code: str, tests: Sequence[str], time_limit: float, memory_mb: int | None,
         errors: list[str] | None = None) -> float:
    """One answer's score at `mode`'s level (see `_grade`)."""
    return _grade(mode, code, tests, time_limit, memory_mb, errors).score


def _grade(mode: bwrap.Mode, code: str, tests: Sequence[str], time_limit: float, memory_mb: int | None,
           errors: list[str] | None = None) -> Grade:
    """One answer at `mode`'s level; `errors` (the probe's) collects what the child wrote on stderr.

    The job goes in two parts: the limits and the code, then the tests, which the sandbox's judge
    reads only once the answer's process has been forked (`sandbox_harness`)."""
    job = {"code": code, "uid": None, "nproc": _NPROC, "nproc_above_mine": False,
           "cpu": max(1, math.ceil(time_limit)), "fsize": _FILE_LIMIT,
           "memory": int(memory_mb * 2**20) if memory_mb else 0}
    popen: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        result = stack.enter_context(tempfile.TemporaryFile(prefix="grpokit-result-"))
        err = stack.enter_context(tempfile.TemporaryFile()) if errors is not None else subprocess.DEVNULL
        argv = harness_argv(mode.python)
        if mode.level == "bubblewrap":  # the working folder is a tmpfs inside the sandbox
            argv = bwrap.bwrap_argv(mode.bwrap, mode.python, userns=mode.userns) + argv
            work, path = "/", "/usr/local/bin:/usr/bin:/bin"
            env = {"HOME": bwrap.WORKDIR, "TMPDIR": bwrap.WORKDIR}
            if mode.as_root and mode.userns:
                popen = {"user": bwrap.SANDBOX_UID, "group": bwrap.SANDBOX_UID, "extra_groups": []}
            elif mode.as_root:
                job.update(uid=bwrap.SANDBOX_UID, nproc=_NPROC_SHARED)
        else:
            work = stack.enter_context(tempfile.TemporaryDirectory(prefix="grpokit-sandbox-"))
            path = os.environ.get("PATH", os.defpath)
            env = {"HOME": work, "TMPDIR": work}
            if mode.level == "unprivileged-uid":
                os.chown(work, bwrap.SANDBOX_UID, bwrap.SANDBOX_UID)
                popen = {"user": bwrap.SANDBOX_UID, "group": bwrap.SANDBOX_UID, "extra_groups": []}
                job["nproc"] = _NPROC_SHARED
            else:
                job["nproc_above_mine"] = True
        env.update(PATH=path, LANG="C.UTF-8", **_ONE_THREAD)
        first = json.dumps(job).encode("utf-8", "surrogatepass")
        message = b"%016x" % len(first) + first + json.dumps(list(tests)).encode("utf-8", "surrogatepass")
        proc = processes.popen(argv, cwd=work, env=env, stdin=subprocess.PIPE, stdout=result, stderr=err,
                               close_fds=True, **popen)
        try:
            proc.communicate(message, timeout=time_limit + _STARTUP_GRACE)
        except subprocess.TimeoutExpired:
            return Grade(0.0, f"over its time limit ({time_limit:g} s)")
        except (BrokenPipeError, OSError):
            pass  # the child died before reading its job: no result, 0.0 below
        finally:  # the judge, the answer and anything it forked (bubblewrap: its whole PID namespace)
            processes.stop([proc])
            if errors is not None:
                err.seek(0)
                errors.extend(err.read(1 << 14).decode("utf-8", "replace").strip().splitlines())
        if proc.returncode != 0:  # the judge itself died: killed by the answer, or the harness could not start
            return Grade(0.0, f"the sandbox's judge process ended with status {proc.returncode}")
        result.seek(0)
        report = result.read(1 << 24).decode("utf-8", "replace")
    return judge(report, len(tests))


_PROBE_CODE = "import os, fractions, decimal\nuid = os.getuid()\n"


def _probe(mode: bwrap.Mode) -> str | None:
    """None when `mode` runs a small answer correctly here (as uid 65534 where it should); else why not."""
    tests = ["assert fractions.Fraction(1, 2) == decimal.Decimal('0.5')"]
    if mode.level != "rlimits-only":
        tests.append(f"assert uid == {bwrap.SANDBOX_UID}")
    errors: list[str] = []
    try:
        score = _run(mode, _PROBE_CODE, tests, time_limit=10.0, memory_mb=512, errors=errors)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    if score == 1.0:
        return None
    return errors[-1] if errors else f"a test answer scored {score} instead of 1.0"


_MODES: dict[tuple, bwrap.Mode | Exception] = {}


_MODES_LOCK = threading.Lock()


def _resolve(sandbox: str, python: str | None) -> bwrap.Mode:
    """The mode for option `sandbox` on this machine, probed once per process (and per bwrap, python, euid)."""
    python = python or sys.executable
    key = (sandbox, python, bwrap.find_bwrap(), os.geteuid() == 0)
    with _MODES_LOCK:
        if key not in _MODES:
            try:
                _MODES[key] = bwrap.choose_mode(sandbox, *key[1:], probe=_probe)
            except RewardLoadError as e:
                _MODES[key] = e
        mode = _MODES[key]
    if isinstance(mode, Exception):
        raise RewardLoadError(str(mode))
    return mode


def sandbox_isolation(sandbox: str = "auto", python: str | None = None) -> tuple[str, str]:
    """(level, one-line message) for `code_execution` with these options on this machine.

    level: "bubblewrap", "unprivileged-uid" or "rlimits-only"; the message says what
    that means and, below bubblewrap, how to get it. Raises RewardLoadError when
    `sandbox` requires a level the machine cannot give.
    """
    mode = _resolve(_check_sandbox(sandbox), python)
    return mode.level, mode.message


def _check_sandbox(sandbox: str) -> str:
    if sandbox not in _SANDBOXES:
        raise RewardLoadError(f"code_execution: sandbox must be one of {', '.join(map(repr, _SANDBOXES))}, "
                              f"got {sandbox!r}")
    return sandbox


def run_tests(code: str, tests: Sequence[str], *, time_limit: float = 5.0, memory_mb: int | None = 512,
              sandbox: str = "auto", python: str | None = None) -> float:
    """Run `code` then each of `tests` in a fresh limited interpreter; the fraction that passed.

    0.0 when the program does not run to its end (timeout, memory, crash, early exit).
    """
    if not tests:
        raise ValueError("run_tests needs at least one test")
    return _run(_resolve(_check_sandbox(sandbox), python), code, tests, time_limit, memory_mb)


def code_execution_reward(time_limit: float = 5.0, memory_mb: int = 512, workers: int = 4,
                          sandbox: str = "auto", python: str | None = None) -> Callable:
    """A `code_execution` reward function with these limits (the registry's factory).

    sandbox: "auto" (the strongest level available, see `sandbox_isolation`),
    "bubblewrap" or "uid" (require that level: RewardLoadError here when the machine
    cannot give it), "none" (resource limits only). python: the interpreter answers
    run under (default: the trainer's). "auto" is probed on first use, so that
    importing this module starts no process.
    """
    if not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise ValueError(f"code_execution: time_limit must be > 0 seconds, got {time_limit!r}")
    if not (isinstance(memory_mb, int) and memory_mb >= 32):
        raise ValueError(f"code_execution: memory_mb must be an integer >= 32, got {memory_mb!r}")
    if not (isinstance(workers, int) and workers >= 1):
        raise ValueError(f"code_execution: workers must be an integer >= 1, got {workers!r}")
    _check_sandbox(sandbox)
    if python is not None:
        found = shutil.which(str(python))
        if not found:
            raise ValueError(f"code_execution: python {python!r} is not an executable file; "
                             f"give the path of a Python 3 interpreter")
        python = os.path.abspath(found)
    if sandbox != "auto":
        _resolve(sandbox, python)  # a required level fails here, at start-up, not at the first batch

    def code_execution(completions: Sequence, tests: Sequence, **kwargs) -> list[float | None]:
        mode = _resolve(sandbox, python)
        jobs = [(extract_code(completion_text(c)), _as_tests(t)) for c, t in zip(completions, tests, strict=True)]

        def grade(job: tuple[str, list[str] | None]) -> Grade | None:
            code, row_tests = job
            return None if row_tests is None else _grade(mode, code, row_tests, time_limit, memory_mb)

        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(jobs)))) as pool:
            grades = list(pool.map(grade, jobs))
        code_execution.last_grades = grades  # each score's reason, for whoever looks
        refused = sum(g is not None and g.refused for g in grades)
        if refused and kwargs.get("log_metric"):  # answers that wrote into the harness's report: scored 0.0
            kwargs["log_metric"]("code_execution/refused_reports", refused)
        return [None if g is None else g.score for g in grades]

    return code_execution


code_execution = code_execution_reward()


code_execution.__doc__ = __doc__.split("\n\n", 1)[0]
