"""The process layer (grpokit/processes.py): every blocking receive from a child has a deadline, a stop takes
the child's whole process group, a child dies with its parent."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from grpokit import processes


def _queue_a_tensor_then_freeze(results) -> None:
    results.put(("batch", torch.arange(1000.0)))  # its storage stays here: the reader fetches it from us
    time.sleep(1.0)  # the queue's feeder thread has written the message
    os.kill(os.getpid(), signal.SIGSTOP)


def _state(pid: int) -> str:
    """The process's state letter (R, S, T: stopped, Z: a zombie), "X" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "X"


def _alive(pid: int) -> bool:
    return _state(pid) not in ("Z", "X")


def test_a_message_whose_frozen_sender_holds_its_tensors_does_not_block_the_receiver():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_queue_a_tensor_then_freeze, args=(results,), daemon=True)
    child.start()
    inbox = processes.Inbox(lambda timeout: results.get(timeout=timeout), "test-inbox")
    try:
        deadline = time.monotonic() + 60
        while _state(child.pid) != "T":
            assert time.monotonic() < deadline, "the child never froze"
            time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(queue.Empty):  # the message is written, its tensor unfetchable: nothing, in time
            while True:
                inbox.get(timeout=1.0)
        assert time.monotonic() - t0 < 5
    finally:
        assert processes.stop([child]) == [-signal.SIGKILL]  # a stopped process is killed too
        inbox.close()
        results.cancel_join_thread()
        results.close()


def test_a_reply_cut_off_halfway_times_out_instead_of_blocking():
    ours, theirs = socket.socketpair()
    conn = Connection(ours.detach())
    theirs.sendall((100).to_bytes(4, "big") + b"x" * 10)  # a header for 100 bytes, then 10 of them
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        processes.receive(conn.recv, 0.5)
    assert time.monotonic() - t0 < 3
    theirs.close()  # the child's end goes away: the receive still running ends (EOF)


def test_stop_kills_the_childs_whole_process_group():
    script = "import subprocess, time; print(subprocess.Popen(['sleep', '1000']).pid, flush=True); time.sleep(1000)"
    launcher = processes.Launcher("test")
    proc = launcher.popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    grandchild = int(proc.stdout.readline())
    assert _alive(grandchild)
    assert processes.stop([proc], grace=0.1) == [-signal.SIGKILL]
    deadline = time.monotonic() + 5
    while _alive(grandchild):
        assert time.monotonic() < deadline, "what the child started outlived it"
        time.sleep(0.05)
    launcher.close()


def test_a_child_dies_with_its_parent_however_the_parent_dies(tmp_path):
    """The parent (a process of its own here) is SIGKILLed: its child, which asked for it, goes too."""
    src = str(Path(processes.__file__).parents[1])
    (tmp_path / "child.py").write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {src!r})
        from grpokit import processes
        processes.die_with_parent(int(sys.argv[1]))
        print(os.getpid(), flush=True)
        time.sleep(1000)
    """))
    (tmp_path / "parent.py").write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, {str(tmp_path / "child.py")!r}, str(os.getpid())])
        time.sleep(1000)
    """))
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py")], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while _alive(child):
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.05)
