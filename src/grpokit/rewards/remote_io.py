"""Waiting on a grader: an answer read within the whole request's deadline, and stop signals that end the
retry back-off (`rewards/remote.py`)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Callable, Iterator

MAX_RESPONSE_BYTES = 64 * 2**20  # a grader's answer is a list of numbers: anything this large is a fault


class _Failed(Exception):
    """One attempt failed: `what` came back; `retry` says whether another attempt may help."""

    def __init__(self, what: str, retry: bool = True):
        super().__init__(what)
        self.what, self.retry = what, retry


@contextlib.contextmanager
def _signals_end_backoff(stop: threading.Event, heard: list[str]) -> Iterator[None]:
    """While a call runs, SIGINT and SIGTERM also set `stop` (appending the signal's name to `heard`), so a
    request waiting out its retry back-off gives up at once instead of sleeping through it: a stop asked
    for (the trainer's "stopping after the current step", a scheduler's SIGTERM before its SIGKILL) must not
    wait `backoff_s * 2**attempt` seconds per retry. The handler in place runs as before (the trainer's
    graceful stop, Ctrl-C's KeyboardInterrupt); a signal left to its default action (SIGTERM ends the
    process) or ignored is not touched, and off the main thread (where handlers cannot be set) nothing
    changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Callable] = {}

    def handle(signum, frame):
        heard.append(signal.Signals(signum).name)
        stop.set()
        previous[signum](signum, frame)

    for sig in (signal.SIGINT, signal.SIGTERM):
        if callable(handler := signal.getsignal(sig)):
            previous[sig] = handler
            signal.signal(sig, handle)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _read_until(response, deadline: float, timeout_s: float) -> bytes:
    """The response body, read in chunks until `deadline` (a grader trickling bytes cannot hold the run:
    urllib's own timeout applies to each read) and at most MAX_RESPONSE_BYTES; `_Failed` otherwise."""
    parts, size = [], 0
    while True:
        if time.monotonic() > deadline:
            raise _Failed(f"no complete answer within {timeout_s:g} s (timeout_s)")
        chunk = response.read1(65536) if hasattr(response, "read1") else response.read(65536)
        if not chunk:
            return b"".join(parts)
        if (size := size + len(chunk)) > MAX_RESPONSE_BYTES:
            raise _Failed(f"an answer larger than {MAX_RESPONSE_BYTES >> 20} MiB")
        parts.append(chunk)
