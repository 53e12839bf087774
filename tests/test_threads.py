"""torch's CPU threads: the cores this process may use, train.num_threads, OMP_NUM_THREADS, and the
one-line note when other processes keep those cores busy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import grpokit.models.threads as threads
from conftest import make_config, parity
from grpokit.config.schema import TrainConfig
from grpokit.errors import ConfigError
from grpokit.training.loop import train


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_thread_count_follows_the_setting_then_omp_then_the_usable_cores(monkeypatch):
    monkeypatch.setattr(threads, "busy_elsewhere", lambda cores: 0.0)
    assert threads.configure_threads(1) == (1, None) and torch.get_num_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = threads.usable_cores()
    assert threads.configure_threads(0)[0] == len(cores) == torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's choice, which torch read at import, is kept
    assert threads.configure_threads(0)[0] == 1
    with pytest.raises(ConfigError, match="train.num_threads"):
        TrainConfig(num_threads=-1)


def test_a_note_when_other_processes_keep_the_cores_busy(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: {0, 1})
    monkeypatch.setattr(threads, "busy_elsewhere", lambda cores: 1.0)
    n, note = threads.configure_threads(2)
    assert n == 2 and "1.0 of the 2 usable cores busy" in note and "train.num_threads = 1" in note
    assert threads.configure_threads(1) == (1, None)  # one thread leaves room: nothing to say
    monkeypatch.setattr(threads, "busy_elsewhere", lambda cores: 0.1)
    assert threads.configure_threads(2) == (2, None)


def _spin_elsewhere() -> int:
    """A busy process that is not this one's descendant (its parent exits at once): the pid."""
    out = subprocess.run([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen([sys.executable, "
                          "'-c', 'while True: pass'], start_new_session=True, stdout=subprocess.DEVNULL, "
                          "stderr=subprocess.DEVNULL).pid)"],
                         capture_output=True, text=True, timeout=30)
    return int(out.stdout)


def test_busy_elsewhere_sees_another_process_and_not_this_one():
    cores = threads.usable_cores()
    start = time.process_time()
    while time.process_time() - start < 0.3:  # this process busy: not "elsewhere"
        pass
    idle = threads.busy_elsewhere(cores, window_s=0.3)
    spinner = _spin_elsewhere()
    try:
        time.sleep(0.3)
        busy = threads.busy_elsewhere(cores, window_s=0.5)
    finally:
        os.kill(spinner, signal.SIGKILL)
    assert busy is not None and busy >= 0.6
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # beside another test worker "idle" is busy too
        assert busy >= min(idle + 0.4, len(cores) - 0.2)  # (on a machine others keep busy: nearly all of it)


def test_this_runs_own_worker_processes_are_not_elsewhere(monkeypatch):
    """Isolated-reward workers start (import, build) just before the threads are set: they are this run's
    work. One window while a child spins: the descendants' CPU time that `busy_elsewhere` subtracts is the
    child's, read from /proc at the same moments. (Two windows in turn, with and without the subtraction,
    compared loads that a neighbouring test worker changes between them: that failed one CI run.)"""
    cores = threads.usable_cores()
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])

    def child_seconds() -> float:  # utime + stime of the spinning child
        fields = open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    seen: list[tuple[float, float, float]] = []  # (the child's seconds, descendants' as read, the child's again)
    real = threads._descendants_seconds

    def spy() -> float:
        before = child_seconds()
        got = real()
        seen.append((before, got, child_seconds()))
        return got

    monkeypatch.setattr(threads, "_descendants_seconds", spy)
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        assert threads.busy_elsewhere(cores, window_s=0.5) is not None
        elapsed = time.monotonic() - t0
    finally:
        child.kill()
        child.wait()
    (_, desc0, child0_after), (child1_before, desc1, _) = seen
    child_at_least = child1_before - child0_after  # what the child used between the two reads, at the least
    assert child_at_least / elapsed > 0.2, seen  # the child did run
    # subtracted: the child's time, all of it (the same /proc counters, read in between; another descendant of this
    # test worker could only add to it)
    assert desc1 - desc0 >= child_at_least, seen
    growth = iter([0.0, 1000.0])  # descendants that used every core and more: nothing is left "elsewhere"
    monkeypatch.setattr(threads, "_descendants_seconds", lambda: next(growth))
    assert threads.busy_elsewhere(cores, window_s=0.05) == 0.0


def test_a_process_that_is_just_ending_gives_no_note(monkeypatch):
    """The run before this one (or its workers) finishing as this one starts: busy once, gone a moment later."""
    monkeypatch.setattr(threads, "usable_cores", lambda: {0, 1})
    seen = iter([2.0, 0.0])
    monkeypatch.setattr(threads, "busy_elsewhere", lambda cores: next(seen))
    assert threads.configure_threads(2) == (2, None)
    monkeypatch.setattr(threads, "busy_elsewhere", lambda cores: 2.0)  # still busy: a job that competes
    assert "torch threads would compete" in threads.configure_threads(2)[1]


def test_the_run_prints_the_note_once(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(threads, "busy_elsewhere", lambda cores: 2.0)
    monkeypatch.setattr(threads, "usable_cores", lambda: {0, 1})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    train(make_config(tiny_model_dir, tmp_path / "run", steps=1), reward_functions=[parity])
    assert capsys.readouterr().out.count("torch threads would compete") == 1
