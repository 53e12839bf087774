"""Hostile answers against the code_execution sandbox: each attack fails inside it, the answer
scores 0.0, the good answer right after it in the same batch scores 1.0, and the host shows no trace.

The bubblewrap tests skip, giving the reason, where bubblewrap is not in force; with
GRPOKIT_REQUIRE_SANDBOX=1 (scripts/test.sh sets it once bubblewrap is installed) they run and fail
instead. The fork bomb is bounded (1000 forks whose children sleep 3 s) so that the machine survives
even a broken sandbox.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpokit.errors import RewardLoadError
from grpokit.rewards import bwrap
from grpokit.rewards.registry import get_reward
from grpokit.rewards.sandbox import code_execution_reward, sandbox_isolation

LEVEL, MESSAGE = sandbox_isolation()
REQUIRED = os.environ.get("GRPOKIT_REQUIRE_SANDBOX") == "1"
ROOT = os.geteuid() == 0
needs_bwrap = pytest.mark.skipif(LEVEL != "bubblewrap" and not REQUIRED,
                                 reason=f"bubblewrap is not in force here ({MESSAGE})")

GOOD = "def f():\n    return 1\n"
TESTS = ["assert f() == 1"]
FORK_BOMB = ("import os, time\nfor i in range(1000):\n    if os.fork() == 0:\n"
             "        time.sleep(3)\n        os._exit(0)\n")


@pytest.fixture
def host(tmp_path):
    """Things the answers go after: files to write and read, a TCP server, the test's own pid."""
    marker = f"grpokit-hostile-{uuid.uuid4().hex[:12]}"
    run = tmp_path / "run"
    run.mkdir()
    secret = run / "secret.txt"
    secret.write_text("s3cret")
    home = Path.home()
    home_secret: Path | None = home / f".{marker}-secret"
    try:
        home_secret.write_text("s3cret")
    except OSError:  # a home we may not write (nobody's /nonexistent): that attack is left out
        home_secret = None
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    signals: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: signals.append(signum))
    targets = {"/tmp": Path("/tmp") / marker, "home": home / marker, "run folder": run / marker,
               "trainer's venv": Path(sys.prefix) / marker}
    try:
        yield SimpleNamespace(targets=targets, secret=secret, home_secret=home_secret, server=server,
                              port=server.getsockname()[1], signals=signals, tmp_path=tmp_path,
                              sleep=f"{uuid.uuid4().int % 10**6 / 1000 + 100:.3f}")
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close()
        for path in [*targets.values(), home_secret]:
            if path is not None:
                path.unlink(missing_ok=True)


def attacks(host, kinds: set[str]) -> dict[str, str]:
    """Hostile answers by name (each raises inside a working sandbox), limited to `kinds`."""
    out = {f"write into {where}": f"open({str(path)!r}, 'w').write('escaped')" for where, path in host.targets.items()}
    out["read the run folder"] = f"data = open({str(host.secret)!r}).read()"
    if host.home_secret is not None:
        out["read the home directory"] = f"data = open({str(host.home_secret)!r}).read()"
    out["connect to the trainer's TCP server"] = (f"import socket\n"
                                                  f"socket.create_connection(('127.0.0.1', {host.port}), 2).close()")
    out["signal the trainer"] = f"import os, signal\nos.kill({os.getpid()}, signal.SIGTERM)"
    out["fork bomb"] = FORK_BOMB
    out["fill the disk with files"] = ("n = 0\nwhile True:\n    with open('fill%d' % n, 'wb') as f:\n"
                                       "        for _ in range(8):\n            f.write(b'x' * 2**20)\n    n += 1")
    out["one huge file"] = "open('big', 'wb').write(b'x' * (64 * 2**20))"
    return {name: code for name, code in out.items() if any(name.startswith(k) for k in kinds)}


def grade_interleaved(reward, hostile: dict[str, str], extra: dict[str, tuple[str, list[str]]] | None = None):
    """Each hostile answer followed by a good one, plus `extra` answers with their own tests; by name."""
    names, answers, tests = [], [], []
    for name, code in hostile.items():
        names += [name, f"good answer after: {name}"]
        answers += [code + "\n" + GOOD, GOOD]
        tests += [TESTS, TESTS]
    for name, (code, own_tests) in (extra or {}).items():
        names.append(name)
        answers.append(code)
        tests.append(own_tests)
    return dict(zip(names, reward(answers, tests)))


def expected(hostile: dict[str, str], extra: dict | None = None) -> dict[str, float]:
    out = {}
    for name in hostile:
        out[name], out[f"good answer after: {name}"] = 0.0, 1.0
    return {**out, **dict.fromkeys(extra or {}, 1.0)}


def assert_no_trace(host, hostile: dict[str, str]) -> None:
    for where, path in host.targets.items():
        if f"write into {where}" in hostile:
            assert not path.exists(), f"an answer wrote {path} on the host"
    if "connect to the trainer's TCP server" in hostile:
        with pytest.raises(BlockingIOError):
            host.server.accept()  # nobody connected
    assert host.signals == [], "an answer signalled the trainer's process"


class DiskWatch:
    """The peak growth of the host's used disk space while in the block (temporary folders are gone after it)."""

    def __init__(self, path: Path):
        self.path, self.peak, self.done = path, 0, threading.Event()

    def _watch(self) -> None:
        while not self.done.wait(0.05):
            self.peak = max(self.peak, shutil.disk_usage(self.path).used - self.before)

    def __enter__(self) -> DiskWatch:
        self.before = shutil.disk_usage(self.path).used
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


# Leaves a process that is in no process group of the answer's: only a PID namespace ends it.
DAEMON = ("import os\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '{seconds}'])\n"
          + GOOD)


def survivors(seconds: str) -> list[int]:
    """Pids of `sleep <seconds>` processes left behind (killed on the way, so that none outlives the test)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == f"sleep\0{seconds}\0".encode():
                found.append(int(pid))
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    return found


# What the machine's own space looks like, for the disk-filling answer: it must hit its bound, not the host's.
MEASURE_FILL = ("import errno, os\nerr = None\nn = 0\ntry:\n    while True:\n"
                "        with open('fill%d' % n, 'wb') as f:\n            for _ in range(8):\n"
                "                f.write(b'x' * 2**20)\n        n += 1\nexcept OSError as e:\n    err = e.errno\n"
                "total = sum(os.path.getsize(p) for p in os.listdir('.'))\n")


@needs_bwrap
def test_hostile_answers_fail_under_bubblewrap_and_grading_goes_on(host):
    reward = code_execution_reward(time_limit=2.0, memory_mb=256, workers=4, sandbox="bubblewrap")
    hostile = attacks(host, {"write", "read", "connect", "signal", "fork", "fill", "one"})
    identity = ("import os\nids = (os.getuid(), os.getgid())\nroot = sorted(os.listdir('/'))\n"
                "home = os.environ.get('HOME')\ncwd = os.getcwd()")
    extra = {"runs as 65534 in an empty private folder that is also HOME": (identity, [
                 f"assert ids == ({bwrap.SANDBOX_UID}, {bwrap.SANDBOX_UID})",
                 f"assert cwd == home == {bwrap.WORKDIR!r}", "assert os.listdir('.') == []",
                 # the Python's own folder is mounted where it lives (a checkout under /tmp shows that path)
                 f"assert 'home' not in root and not os.path.exists({str(host.tmp_path)!r})"]),
             "filling the disk stops at the tmpfs bound": (MEASURE_FILL, [
                 "assert err in (errno.ENOSPC, errno.EFBIG)",
                 f"assert 32 * 2**20 <= total <= {bwrap.WORK_BYTES}"])}
    t0 = time.monotonic()
    with DiskWatch(host.tmp_path) as disk:
        scores = grade_interleaved(reward, hostile, extra)
        # alone: where answers share uid 65534's process limit, the fork bomb may leave it no fork
        scores["a daemon (fork + setsid) dies with the sandbox"] = reward([DAEMON.format(seconds=host.sleep)],
                                                                          [TESTS])[0]
    elapsed = time.monotonic() - t0
    assert scores == {**expected(hostile, extra), "a daemon (fork + setsid) dies with the sandbox": 1.0}
    assert_no_trace(host, hostile)
    assert disk.peak < 256 * 2**20, f"the host's disk filled by {disk.peak >> 20} MiB while grading"
    assert survivors(host.sleep) == [], "a process the answer started outlived the sandbox"
    assert elapsed < 15, f"the batch took {elapsed:.1f} s"


@needs_bwrap
def test_in_a_user_namespace_each_answer_has_its_own_process_limit_and_no_nested_namespaces():
    """Where bubblewrap gets a user namespace (always for an ordinary user; for root when uid 65534 can read the
    Python), a fork bomb cannot starve an answer that forks at the same time, and user namespaces (kernel attack
    surface) cannot be created inside."""
    pythons = dict.fromkeys(p for p in (sys.executable, shutil.which("python3"), "/usr/bin/python3") if p)
    levels = {p: sandbox_isolation("bubblewrap", p) for p in pythons if os.path.exists(p)}
    usable = [p for p, (_, message) in levels.items() if "without a user namespace" not in message]
    if not usable:
        pytest.skip(f"bubblewrap runs without a user namespace here: {levels}")
    reward = code_execution_reward(time_limit=3.0, memory_mb=256, workers=3, sandbox="bubblewrap", python=usable[0])
    holding_bomb = f"try:\n{indent(FORK_BOMB)}\nexcept OSError:\n    import time\n    time.sleep(1.5)\n    raise\n"
    forks_meanwhile = ("import os, time\ntime.sleep(0.5)\nkids = []\nfor _ in range(8):\n    pid = os.fork()\n"
                       "    if pid == 0:\n        time.sleep(0.2)\n        os._exit(0)\n    kids.append(pid)\n"
                       "for pid in kids:\n    os.waitpid(pid, 0)\n")
    nested_userns = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                     "if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER\n"
                     "    raise OSError(ctypes.get_errno(), 'unshare')\n")
    scores = reward([holding_bomb + GOOD, forks_meanwhile + GOOD, nested_userns + GOOD], [TESTS] * 3)
    assert scores == [0.0, 1.0, 0.0]


def indent(code: str) -> str:
    return "\n".join("    " + line for line in code.splitlines())


def test_bubblewrap_is_in_force_where_required():
    if not REQUIRED:
        pytest.skip("GRPOKIT_REQUIRE_SANDBOX is not 1")
    assert LEVEL == "bubblewrap", MESSAGE


@needs_bwrap
def test_bubblewrap_message_names_the_guarantees():
    assert sandbox_isolation("bubblewrap") == (LEVEL, MESSAGE)
    assert MESSAGE.startswith("code_execution: answers run under bubblewrap (")
    for words in ("read-only", "no network", "own PID namespace", f"uid {bwrap.SANDBOX_UID}"):
        assert words in MESSAGE


def test_without_bubblewrap_root_runs_answers_as_uid_65534(host, monkeypatch):
    """bwrap missing (simulated): as root the answers drop to uid 65534, which stops what file modes can stop."""
    if not ROOT:
        pytest.skip("the uid fallback switches uid, which needs root")
    monkeypatch.setattr(bwrap, "find_bwrap", lambda: None)
    pythons = dict.fromkeys(p for p in (sys.executable, shutil.which("python3"), "/usr/bin/python3") if p)
    levels = {p: sandbox_isolation("auto", p) for p in pythons if os.path.exists(p)}
    usable = [p for p, (level, _) in levels.items() if level == "unprivileged-uid"]
    if not usable:
        pytest.skip(f"no Python here that uid 65534 can run: {levels}")
    level, message = levels[usable[0]]
    assert "bubblewrap not found" in message and "apt-get install bubblewrap" in message
    assert f"uid {bwrap.SANDBOX_UID}" in message
    reward = code_execution_reward(time_limit=2.0, memory_mb=256, workers=4, python=usable[0])
    hostile = attacks(host, {"write into home", "write into run folder", "write into trainer", "read", "signal",
                             "fork"})
    identity = ("import os\nids = (os.getuid(), os.geteuid(), os.getgid(), os.getgroups())\n"
                "secret = os.environ.get('GRPOKIT_HOSTILE_SECRET')")
    monkeypatch.setenv("GRPOKIT_HOSTILE_SECRET", "s3cret")
    extra = {"runs as 65534 without the trainer's environment": (identity, [
        f"assert ids == ({bwrap.SANDBOX_UID}, {bwrap.SANDBOX_UID}, {bwrap.SANDBOX_UID}, [])",
        "assert secret is None"])}
    scores = grade_interleaved(reward, hostile, extra)
    assert scores == expected(hostile, extra)
    assert_no_trace(host, hostile)


def test_without_bubblewrap_an_ordinary_user_gets_rlimits_and_is_told_how_to_do_better(host, monkeypatch):
    if ROOT:
        pytest.skip("as root the fallback is uid 65534 (the test above), and root ignores RLIMIT_NPROC")
    monkeypatch.setattr(bwrap, "find_bwrap", lambda: None)
    level, message = sandbox_isolation()
    assert level == "rlimits-only"
    assert "bubblewrap not found" in message and "apt-get install bubblewrap" in message
    reward = code_execution_reward(time_limit=2.0, memory_mb=256, workers=2)
    hostile = attacks(host, {"fork", "one"})  # what rlimits alone stop
    assert grade_interleaved(reward, hostile) == expected(hostile)


def test_requiring_bubblewrap_where_it_is_missing_fails_at_load_with_the_fix(monkeypatch):
    monkeypatch.setattr(bwrap, "find_bwrap", lambda: None)
    with pytest.raises(RewardLoadError, match=r"sandbox = 'bubblewrap' but bubblewrap not found; "
                                              r"apt-get install bubblewrap, or set sandbox = 'auto'"):
        get_reward("code_execution", sandbox="bubblewrap")


def test_requiring_bubblewrap_where_it_cannot_start_names_the_reason(monkeypatch):
    monkeypatch.setattr(bwrap, "find_bwrap", lambda: "/bin/false")
    with pytest.raises(RewardLoadError, match=r"sandbox = 'bubblewrap' but bubblewrap cannot start a sandbox "
                                              r"here \(.+\); .*namespaces"):
        code_execution_reward(sandbox="bubblewrap")


def test_bad_sandbox_values_are_named():
    with pytest.raises(RewardLoadError, match=r"sandbox must be one of 'auto', 'bubblewrap', 'uid', 'none', "
                                              r"got 'docker'"):
        get_reward("code_execution", sandbox="docker")
    with pytest.raises(RewardLoadError, match=r"python '/no/such/python' is not an executable file"):
        get_reward("code_execution", python="/no/such/python")
    if not ROOT:
        with pytest.raises(RewardLoadError, match=r"sandbox = 'uid' needs root"):
            code_execution_reward(sandbox="uid")


def test_sandbox_none_is_todays_containment_and_says_so():
    level, message = sandbox_isolation("none")
    assert level == "rlimits-only" and "sandbox = 'none'" in message
    reward = code_execution_reward(time_limit=2.0, sandbox="none")
    assert reward([GOOD, "import os\nos._exit(1)"], [TESTS, TESTS]) == [1.0, 0.0]
