"""Waiting on a grader: one POST whose whole answer (status line, headers, body) is read within the
request's deadline, no redirect followed, and stop signals that end the retry back-off (`rewards/remote.py`).

urllib's `timeout` bounds each socket operation, not the request: a grader that trickles its answer a
byte at a time (each read well within the timeout) would hold the request, and the thread waiting on
it, for as long as it liked. `fetch` arms a timer that shuts the request's socket down at the deadline,
which ends any read in progress at once; the waiting thread then returns, so none is left behind.
"""

from __future__ import annotations

import contextlib
import http.client
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Iterator

MAX_RESPONSE_BYTES = 64 * 2**20  # a grader's answer is a list of numbers: anything this large is a fault
_PREVIEW_CHARS = 120


def preview_body(raw: bytes | str) -> str:
    """A short one-line repr of what a grader sent back."""
    text = " ".join((raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw).split())
    return repr(text if len(text) <= _PREVIEW_CHARS else text[: _PREVIEW_CHARS - 3] + "...")


class AttemptFailed(Exception):
    """One attempt failed: `what` came back; `retry` says whether another attempt may help."""

    def __init__(self, what: str, retry: bool = True):
        super().__init__(what)
        self.what, self.retry = what, retry


@contextlib.contextmanager
def signals_end_backoff(stop: threading.Event, heard: list[str]) -> Iterator[None]:
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
    urllib's own timeout applies to each read) and at most MAX_RESPONSE_BYTES; `AttemptFailed` otherwise."""
    parts, size = [], 0
    while True:
        if time.monotonic() > deadline:
            raise AttemptFailed(f"no complete answer within {timeout_s:g} s (timeout_s)")
        chunk = response.read1(65536) if hasattr(response, "read1") else response.read(65536)
        if not chunk:
            return b"".join(parts)
        if (size := size + len(chunk)) > MAX_RESPONSE_BYTES:
            raise AttemptFailed(f"an answer larger than {MAX_RESPONSE_BYTES >> 20} MiB")
        parts.append(chunk)


class _Deadline:
    """Shuts down every socket of one request when `seconds` have passed (a timer thread that ends with
    the request); `expired` says whether it did."""

    def __init__(self, seconds: float):
        self._lock, self._sockets, self.expired = threading.Lock(), [], False
        self._timer = threading.Timer(seconds, self.expire)
        self._timer.daemon = True

    def attach(self, sock) -> None:
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            _shut(sock)

    def expire(self) -> None:
        with self._lock:
            self.expired, sockets = True, list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


def _shut(sock) -> None:
    with contextlib.suppress(OSError):  # already closed, or (TLS) detached into its wrapper
        sock.shutdown(socket.SHUT_RDWR)


def _watched(base: type, deadline: _Deadline) -> type:
    """`base` (HTTPConnection / HTTPSConnection) whose sockets `deadline` can shut: the TCP socket as soon as
    it exists, and the TLS socket that takes its descriptor over."""
    class Watched(base):
        def connect(self):
            create = self._create_connection

            def created(*args, **kwargs):
                sock = create(*args, **kwargs)
                deadline.attach(sock)
                return sock

            self._create_connection = created
            super().connect()
            deadline.attach(self.sock)

    return Watched


class _HTTP(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(_watched(http.client.HTTPConnection, self.deadline), req)


class _HTTPS(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        extra = {"check_hostname": self._check_hostname} if hasattr(self, "_check_hostname") else {}  # (3.11)
        return self.do_open(_watched(http.client.HTTPSConnection, self.deadline), req, context=self._context,
                            **extra)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is not followed: urllib turns a redirected POST into a GET without the batch."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        fp.close()
        raise AttemptFailed(f"HTTP {code}, a redirect to {newurl} (not followed: the POST would arrive there as a GET "
                      f"without the batch); put that URL in rewards.functions", retry=False)


def fetch(request: urllib.request.Request, timeout_s: float, proxies: dict[str, str]) -> bytes:
    """The body of the answer to `request`, all of it within `timeout_s`; `AttemptFailed` for a timeout, an HTTP
    error status or a redirect; connection errors are raised as urllib raises them."""
    deadline = _Deadline(timeout_s)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler(proxies), _NoRedirect(), _HTTP(deadline),
                                         _HTTPS(deadline))
    late = AttemptFailed(f"no complete answer within {timeout_s:g} s (timeout_s)")
    with deadline:
        try:
            with opener.open(request, timeout=timeout_s) as response:
                raw = _read_until(response, time.monotonic() + timeout_s, timeout_s)
        except urllib.error.HTTPError as e:
            if deadline.expired:
                raise late from None
            detail = b""
            with contextlib.suppress(Exception):  # the error body is only for the message
                detail = _read_until(e, time.monotonic() + timeout_s, timeout_s)
            raise AttemptFailed(f"HTTP {e.code} {preview_body(detail)}", retry=e.code >= 500 or e.code == 429) from None
        except AttemptFailed:
            raise
        except Exception as e:
            timed_out = isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)
            if deadline.expired and not timed_out:  # the shut socket ended a read: that is the timeout
                raise late from None
            raise  # (a read that timed out by itself as the deadline came: remote.py says so)
        if deadline.expired:  # the shut socket looked like the end of the answer
            raise late
    return raw
