"""Sandboxed code-execution reward: run the answer's Python against the row's tests.

    code_execution(completions, tests, **kwargs) -> list[float | None]

TRL's calling convention (see `rewards.core`); `tests` is a dataset column that
holds, per row, either a list of test statements (usually `assert f(2) == 4`)
or one string of test code. Registered as "code_execution"; its options are
factory arguments: `rewards.args = {code_execution = {time_limit = 5.0,
memory_mb = 512, workers = 4}}`.

What an answer runs:

- The code is the last ```python (or ```py) fenced block of the completion,
  else its last plain ``` block, else the whole text.
- Each answer runs in a fresh `python -I -B` process (isolated mode: no user
  site, no PYTHON* variables), in its own empty temporary working directory,
  with a minimal environment (no inherited variables such as API keys), stdin,
  stdout and stderr on /dev/null, and in its own session so that any process it
  forks is killed with it.
- Limits: `time_limit` seconds of CPU (RLIMIT_CPU) and the same wall-clock time
  plus a 1 s start-up allowance (the parent kills the process group);
  `memory_mb` of address space (RLIMIT_AS); 16 MiB per written file
  (RLIMIT_FSIZE); no core dumps.
- Samples run in parallel, `workers` at a time (threads that wait on processes).

Reward: the fraction of tests that passed, if the program ran to its end.
A list of N tests gives k/N; one string of test code gives 1.0 or 0.0. An answer
whose own code raises (SyntaxError included) passes no test: 0.0. An answer that
hangs, runs out of memory, crashes the interpreter or exits early (`sys.exit`,
`os._exit`, a signal), in its code or in any test, gets 0.0. A row whose `tests`
is None or empty is not graded (None). Nothing an answer does raises here; only a
failure of the machinery itself (no `python` to start) raises.

Deviations and limits, on purpose:

- The limits are set by the harness inside the child, before the answer's code
  runs, rather than with `subprocess`'s `preexec_fn`: the samples start from a
  thread pool, and Python documents `preexec_fn` as unsafe (it can deadlock the
  child) when the parent has threads. The effect is the same: the answer never
  runs without its limits.
- This is resource containment, not a security boundary. There is no network or
  file-system isolation; code running as root can raise its own hard limits; an
  answer that deliberately inspects the interpreter could find the per-run
  secret with which the harness marks its results. Against deliberately hostile
  code, run the trainer inside a container (or under nsjail / gVisor).
- RLIMIT_AS counts virtual memory: importing numpy or torch in an answer may
  need more than 512 MB; raise `memory_mb` for such tasks.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from grpokit.rewards.graders import completion_text

__all__ = ["code_execution", "code_execution_reward", "extract_code", "run_tests"]


_STARTUP_GRACE = 1.0  # seconds of wall clock for the interpreter to start, on top of time_limit


_FILE_LIMIT = 16 * 2**20  # bytes per file the answer (and the harness's result file) may write


_RESULT_FILE = ".grpokit-result"


_FENCED = re.compile(r"```(?:python|py|python3)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


_ANY_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)


# Runs in the child. Reads the job from stdin, opens the result file, puts stdin/stdout/stderr
# on /dev/null, sets the limits, then runs the answer and the tests in one namespace. Every
# result line starts with the nonce, which the answer's code is never given.
_HARNESS = r"""
import json, os, resource, sys
job = json.loads(sys.stdin.read())
out = open(job["result"], "w", encoding="utf-8")
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
def limit(kind, value):
    hard = resource.getrlimit(kind)[1]
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))
limit(resource.RLIMIT_CPU, job["cpu"])
limit(resource.RLIMIT_FSIZE, job["fsize"])
limit(resource.RLIMIT_CORE, 0)
if job["memory"]:
    limit(resource.RLIMIT_AS, job["memory"])
nonce, tests, code = job["nonce"], job["tests"], job["code"]
def report(*words):
    out.write(" ".join([nonce, *map(str, words)]) + "\n")
    out.flush()
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
del job
try:
    exec(compile(code, "<answer>", "exec"), namespace)
except BaseException:
    report("done", 0, len(tests))
    raise SystemExit(0)
passed = 0
for i, test in enumerate(tests):
    try:
        exec(compile(test, "<test %d>" % i, "exec"), namespace)
        passed += 1
    except BaseException:
        pass
report("done", passed, len(tests))
"""


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


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the answer and anything it forked
    except (ProcessLookupError, PermissionError):
        pass


def run_tests(code: str, tests: Sequence[str], *, time_limit: float = 5.0, memory_mb: int | None = 512) -> float:
    """Run `code` then each of `tests` in a fresh limited interpreter; the fraction that passed.

    0.0 when the program does not run to its end (timeout, memory, crash, early exit).
    """
    if not tests:
        raise ValueError("run_tests needs at least one test")
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="grpokit-sandbox-") as work:
        result = os.path.join(work, _RESULT_FILE)
        job = {"nonce": nonce, "code": code, "tests": list(tests), "result": result,
               "cpu": max(1, math.ceil(time_limit)),
               "fsize": _FILE_LIMIT, "memory": int(memory_mb * 2**20) if memory_mb else 0}
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"}
        proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", _HARNESS], cwd=work, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)
        try:
            proc.communicate(json.dumps(job).encode("utf-8"), timeout=time_limit + _STARTUP_GRACE)
        except subprocess.TimeoutExpired:
            return 0.0
        except (BrokenPipeError, OSError):
            pass  # the child died before reading its job: no result, 0.0 below
        finally:
            _kill_group(proc)
            proc.wait()
        if proc.returncode != 0:
            return 0.0
        try:
            with open(result, encoding="utf-8", errors="replace") as f:
                lines = f.read(1 << 16).splitlines()
        except OSError:
            return 0.0
    done = [line.split() for line in lines if line.startswith(nonce + " done ")]
    if len(done) != 1 or len(done[0]) != 4:
        return 0.0
    passed, total = int(done[0][2]), int(done[0][3])
    return passed / total if total == len(tests) else 0.0


def code_execution_reward(time_limit: float = 5.0, memory_mb: int = 512, workers: int = 4) -> Callable:
    """A `code_execution` reward function with these limits (the registry's factory)."""
    if not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise ValueError(f"code_execution: time_limit must be > 0 seconds, got {time_limit!r}")
    if not (isinstance(memory_mb, int) and memory_mb >= 32):
        raise ValueError(f"code_execution: memory_mb must be an integer >= 32, got {memory_mb!r}")
    if not (isinstance(workers, int) and workers >= 1):
        raise ValueError(f"code_execution: workers must be an integer >= 1, got {workers!r}")

    def code_execution(completions: Sequence, tests: Sequence, **kwargs) -> list[float | None]:
        jobs = [(extract_code(completion_text(c)), _as_tests(t)) for c, t in zip(completions, tests, strict=True)]

        def grade(job: tuple[str, list[str] | None]) -> float | None:
            code, row_tests = job
            if row_tests is None:
                return None
            return run_tests(code, row_tests, time_limit=time_limit, memory_mb=memory_mb)

        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(jobs)))) as pool:
            return list(pool.map(grade, jobs))

    return code_execution


code_execution = code_execution_reward()


code_execution.__doc__ = __doc__.split("\n\n", 1)[0]
