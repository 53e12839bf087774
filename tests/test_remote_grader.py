"""Remote graders (grpokit.rewards.remote): a real HTTP server on 127.0.0.1 plays the grader.

The server picks its behaviour from the request path (/echo, /500, /slow, ...), counts the requests and
the most it handled at once, and keeps every body it was sent. Timeouts and backoffs are tiny, so the
whole file runs in a few seconds; nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from grpokit.errors import RewardError, RewardLoadError
from grpokit.rewards.core import RewardSpec, compute_rewards
from grpokit.rewards.remote import RemoteGrader, is_url, url_reward_name

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(timeout_s=2.0, backoff_s=0.01)  # tiny backoffs; the timeout tests set their own tiny timeout_s


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.calls: Counter = Counter()  # requests per mode
        self.bodies: list[tuple[str, dict, dict]] = []  # (mode, body, headers)
        self.active = self.max_active = 0
        self.release = threading.Event()  # set at teardown: slow handlers stop waiting


def _echo(body: dict) -> list:
    return [float(c) for c in body["completions"]]


def _answer(mode: str, body: dict, call: int, state: _State) -> tuple[int, str]:
    """(status, response text) of the grader in `mode`, on its `call`-th request."""
    def ok():
        return json.dumps({"scores": _echo(body)})

    if mode == "echo":
        return 200, ok()
    if mode == "list":  # the other accepted form: a bare list
        return 200, json.dumps(_echo(body))
    if mode == "null":  # null = not graded by this grader
        return 200, json.dumps([None if i % 2 else 1.0 for i in range(len(body["completions"]))])
    if mode == "concurrent":
        state.release.wait(0.05)
        return 200, ok()
    if mode == "picky":  # a request holding "bad" fails every time
        return (500, "cannot grade 'bad'") if "bad" in body["completions"] else (200, ok())
    if mode in ("flaky", "throttled", "slowfirst") and call > 1:
        return 200, ok()
    if mode in ("flaky", "500"):
        return 500, "boom: grader crashed\n  Traceback ..."
    if mode == "throttled":
        return 429, "slow down"
    if mode in ("slow", "slowfirst"):
        state.release.wait(2.0)
        return 200, ok()
    if mode == "400":
        return 400, "missing column 'answer'"
    if mode == "malformed":
        return 200, "<html>not json"
    if mode == "object":
        return 200, json.dumps({"score": 1})
    if mode == "count":
        return 200, json.dumps(_echo(body)[:-1])
    if mode == "nonfinite":
        return 200, json.dumps(_echo(body)[:-1] + [math.nan])
    if mode == "string":
        return 200, json.dumps(_echo(body)[:-1] + ["1.0"])
    if mode == "bool":  # a pass flag is not a score (Python would read true as 1.0)
        return 200, json.dumps(_echo(body)[:-1] + [True])
    return 404, f"no mode {mode!r}"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        state: _State = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = self.path.strip("/")
        with state.lock:
            state.calls[mode] += 1
            call = state.calls[mode]
            state.bodies.append((mode, body, dict(self.headers)))
            state.active += 1
            state.max_active = max(state.max_active, state.active)
        try:
            status, text = _answer(mode, body, call, state)
        finally:
            with state.lock:  # before the answer goes out, so a finished client never counts twice
                state.active -= 1
        data = text.encode()
        if mode.startswith("redirect"):  # 302 (urllib would re-send the POST as a GET, without the batch) / 307
            self.send_response(int(mode[len("redirect"):] or 302))
            self.send_header("Location", "/echo")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if mode == "trickle":  # a whole answer promised, one byte every 0.05 s: each read is quick
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            with contextlib.suppress(OSError):
                while not state.release.wait(0.05):
                    self.wfile.write(b" ")
                    self.wfile.flush()
            return
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (a timeout test)
            pass


    def do_GET(self):  # what a followed redirect of a POST becomes: counted, so a test can see it never came
        with self.server.state.lock:
            self.server.state.calls["GET " + self.path.strip("/")] += 1
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"[]")


@pytest.fixture
def server():
    """(base URL, state) of a grader server on a free port of 127.0.0.1."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.state = _State()
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd.state
    httpd.state.release.set()
    httpd.shutdown()
    httpd.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(n: int) -> dict:
    return dict(prompts=[f"p{i}" for i in range(n)], completions=[str(i) for i in range(n)],
                completion_ids=[[i, i + 1] for i in range(n)])


# ---- names and arguments ---------------------------------------------------------------------------


def test_is_url_and_names():
    assert is_url("http://127.0.0.1:8000/score") and is_url("HTTPS://judge.example.com")
    assert not is_url("rewards.py:score") and not is_url("numeric_match") and not is_url("ftp://x")
    assert url_reward_name("http://127.0.0.1:8000/score") == "127.0.0.1_8000_score"
    assert url_reward_name("https://judge.example.com/v1/grade/?key=x") == "judge.example.com_v1_grade"
    assert url_reward_name("http://grader") == "grader"
    g = RemoteGrader("http://127.0.0.1:8000/score")
    assert g.name == g.__name__ == "127.0.0.1_8000_score"
    assert RemoteGrader("http://h/x", name="judge").name == "judge"


@pytest.mark.parametrize("kwargs, word", [
    ({"url": "127.0.0.1:8000/score"}, "url"),
    ({"url": "http:///score"}, "url"),
    ({"url": "http://h:notaport/x"}, "port"),
    ({"url": "http://user:secret@h/x"}, "credentials"),
    ({"name": "a/b"}, "name"),
    ({"name": ""}, "name"),
    ({"concurrency": 0}, "concurrency"),
    ({"concurrency": 2.5}, "concurrency"),
    ({"batch_size": True}, "batch_size"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": float("inf")}, "timeout_s"),
    ({"retries": -1}, "retries"),
    ({"backoff_s": -0.1}, "backoff_s"),
    ({"on_error": "ignore"}, "on_error"),
    ({"headers": {"Authorization": 5}}, "headers"),
])
def test_bad_arguments_name_the_argument(kwargs, word):
    kwargs = {"url": "http://127.0.0.1:8000/score", **kwargs}
    with pytest.raises(ValueError, match=word) as e:
        RemoteGrader(kwargs.pop("url"), **kwargs)
    assert "\n" not in str(e.value) and "secret" not in str(e.value).replace("user:secret@", "")


# ---- grading ---------------------------------------------------------------------------------------


def test_body_holds_the_batch_and_the_columns(server):
    base, state = server
    g = RemoteGrader(f"{base}/echo", headers={"Authorization": "Bearer t0ken"}, **FAST)
    batch = _batch(3)
    out = g(**batch, answer=[4, "x", None], weight=[0.5, math.nan, 1.0], env=[object()] * 3,
            trainer_state=object(), log_extra=lambda column, values: None)
    assert out == [0.0, 1.0, 2.0]
    [(_, body, headers)] = state.bodies
    assert body == {**batch, "answer": [4, "x", None], "weight": [0.5, None, 1.0]}  # NaN -> null
    assert g.omitted_columns == ["env"]  # not JSON: left out; the TRL extras are never sent
    assert headers["Authorization"] == "Bearer t0ken" and headers["Content-Type"] == "application/json"


@pytest.mark.parametrize("mode, expected", [("list", [0.0, 1.0, 2.0, 3.0]), ("null", [1.0, None, 1.0, None])])
def test_list_answers_and_nulls(server, mode, expected):
    base, _ = server
    assert RemoteGrader(f"{base}/{mode}", **FAST)(**_batch(4)) == expected


def test_empty_batch_sends_nothing(server):
    base, state = server
    assert RemoteGrader(f"{base}/echo", **FAST)(prompts=[], completions=[], completion_ids=[]) == []
    assert not state.bodies


def test_through_compute_rewards(server):
    """The grader is an ordinary reward function: compute_rewards passes it everything, extras included."""
    base, state = server
    per_fn, total = compute_rewards([RewardSpec("remote", RemoteGrader(f"{base}/null", **FAST))],
                                    prompts=["a", "b"], completions=["1", "2"], completion_ids=[[1], [2]],
                                    columns={"answer": [1, 2]})
    assert per_fn[:, 0].tolist()[0] == 1.0 and math.isnan(per_fn[1, 0]) and total[0] == 1.0
    assert state.bodies[0][1]["answer"] == [1, 2]


def test_concurrency_and_batching(server):
    base, state = server
    g = RemoteGrader(f"{base}/concurrent", concurrency=3, batch_size=4, **FAST)
    out = g(**_batch(30))
    assert out == [float(i) for i in range(30)]  # reassembled in order
    sizes = sorted(len(body["completions"]) for _, body, _ in state.bodies)
    assert sizes == [2] + [4] * 7  # ceil(30 / 4) requests of at most batch_size
    assert 2 <= state.max_active <= 3  # in parallel, never more than `concurrency`


def test_proxy_settings_do_not_catch_a_local_grader(server, monkeypatch):
    base, _ = server
    for var in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, f"http://127.0.0.1:{_free_port()}")  # a proxy that is not there
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert RemoteGrader(f"{base}/echo", retries=0, **FAST)(**_batch(2)) == [0.0, 1.0]


# ---- failures ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["flaky", "throttled", "slowfirst"])
def test_a_retry_succeeds(server, mode):
    """500, 429 and a timeout are retried; the second attempt answers."""
    base, state = server
    assert RemoteGrader(f"{base}/{mode}", retries=2, timeout_s=0.2, backoff_s=0.01)(**_batch(3)) == [0.0, 1.0, 2.0]
    assert state.calls[mode] == 2


@pytest.mark.parametrize("mode, what", [
    ("500", "HTTP 500 'boom: grader crashed Traceback ...'"),
    ("slow", "answer within 0.2 s"),  # "no answer" (a read timed out) or "no complete answer" (the deadline)
    ("malformed", "malformed JSON '<html>not json'"),
    ("object", "not a list of scores"),
    ("count", "3 scores for 4 completions"),
    ("nonfinite", "score NaN at index 3, not a finite number or null"),
    ("string", 'score "1.0" at index 3'),
    ("bool", "score true at index 3, not a finite number or null"),
])
def test_retries_then_one_line_error(server, mode, what):
    base, state = server
    url = f"{base}/{mode}"
    start = time.monotonic()
    with pytest.raises(RewardError) as e:
        RemoteGrader(url, retries=2, timeout_s=0.2 if mode == "slow" else 1.0, backoff_s=0.02)(**_batch(4))
    message = str(e.value)
    assert "\n" not in message and url in message and "3 time(s)" in message and what in message, message
    assert state.calls[mode] == 3
    assert time.monotonic() - start >= 0.02 + 0.04  # backoff_s * 2**attempt before each retry


def test_a_4xx_is_not_retried(server):
    base, state = server
    with pytest.raises(RewardError) as e:
        RemoteGrader(f"{base}/400", retries=3, **FAST)(**_batch(2), answer=[1, 2])
    message = str(e.value)
    assert "HTTP 400 \"missing column 'answer'\"" in message and "not retried" in message and "\n" not in message
    assert state.calls["400"] == 1


def test_skip_leaves_failed_requests_ungraded(server):
    base, state = server
    metrics = []
    g = RemoteGrader(f"{base}/picky", on_error="skip", batch_size=2, retries=1, **FAST)
    batch = dict(prompts=["p"] * 6, completions=["0", "1", "bad", "3", "4", "5"], completion_ids=[[0]] * 6)
    assert g(**batch, log_metric=lambda name, value: metrics.append((name, value))) == \
        [0.0, 1.0, None, None, 4.0, 5.0]
    assert metrics == [("rewards/127.0.0.1_%d_picky/ungraded" % int(base.rsplit(":", 1)[1]), 2)]
    assert g.ungraded == 2 and "HTTP 500" in g.last_failure and state.calls["picky"] == 4  # 3 + 1 retry
    g(**batch)  # without log_metric: counted all the same
    assert g.ungraded == 2 and g.ungraded_total == 4
    with pytest.raises(RewardError, match="picky"):
        RemoteGrader(f"{base}/picky", batch_size=2, retries=0, **FAST)(**batch)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_stop_signal_ends_the_retry_backoff_at_once(server, on_error):
    """SIGTERM during a back-off of 20 s (then 40, 80): the trainer's graceful stop hears it as always, and
    the grader retries no more: one error line, or (skip) the request ungraded, within seconds."""
    from grpokit.training.stopping import GracefulStop

    base, state = server
    url = f"{base}/500"
    grader = RemoteGrader(url, retries=3, backoff_s=20.0, timeout_s=2.0, on_error=on_error)
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM))
    start = time.monotonic()
    with GracefulStop() as stop:
        trainers = signal.getsignal(signal.SIGTERM)
        timer.start()
        try:
            if on_error == "raise":
                with pytest.raises(RewardError) as e:
                    grader(**_batch(2))
                message = str(e.value)
                assert url in message and "SIGTERM asked the run to stop" in message and "\n" not in message
            else:
                assert grader(**_batch(2)) == [None, None] and "HTTP 500" in grader.last_failure
        finally:
            timer.join()
        assert signal.getsignal(signal.SIGTERM) == trainers  # the trainer's handler is back in place
    assert stop.requested == "SIGTERM" and state.calls["500"] == 1
    assert time.monotonic() - start < 5.0


# ---- start-up check ------------------------------------------------------------------------------------


def test_check_reachable(server):
    base, state = server
    RemoteGrader(f"{base}/echo", **FAST).check_reachable()
    assert not state.bodies  # a connection only: nothing graded
    port = _free_port()
    with pytest.raises(RewardLoadError) as e:
        RemoteGrader(f"http://127.0.0.1:{port}/score", **FAST).check_reachable()
    message = str(e.value)
    assert f"http://127.0.0.1:{port}/score" in message and "start the grader" in message and "\n" not in message
    with pytest.raises(RewardLoadError, match="TLS|not reachable"):  # https to a plain-HTTP server
        RemoteGrader(base.replace("http:", "https:") + "/echo", timeout_s=0.2).check_reachable()


# ---- the example server ------------------------------------------------------------------------------


def test_example_grader_server():
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "grader_server.py"), "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("grading on http://127.0.0.1:"), line
        g = RemoteGrader(line.split()[-1], **FAST)
        g.check_reachable()
        out = g(prompts=["2+2=", "2+2=", "3+4=", "q"],
                completions=["4", "5", [{"role": "assistant", "content": "it is 7"}], "x"],
                completion_ids=[[1], [2], [3], [4]], answer=[4, 4, 7, None])
        assert out == [1.0, 0.0, 1.0, None]
    finally:
        proc.terminate()
        proc.wait(timeout=5)


def test_timeout_s_bounds_the_whole_request_not_each_read(server):
    url, _ = server
    start = time.monotonic()
    with pytest.raises(RewardError, match="no complete answer within 0.4 s"):
        RemoteGrader(f"{url}/trickle", retries=0, timeout_s=0.4)(**_batch(2))
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("code", [302, 307])
def test_a_redirect_is_refused_not_followed_as_a_get(server, code):
    base, state = server
    with pytest.raises(RewardError) as e:
        RemoteGrader(f"{base}/redirect{code}", retries=2, **FAST)(**_batch(2))
    message = str(e.value)
    assert f"HTTP {code}, a redirect to {base}/echo" in message and "put that URL in rewards.functions" in message
    assert "not retried" in message and "\n" not in message
    assert state.calls[f"redirect{code}"] == 1 and state.calls["GET echo"] == 0 and state.calls["echo"] == 0


@contextlib.contextmanager
def _trickling_server(head: bytes, every_s: float):
    """A raw TCP server that answers every request with `head` then spaces, one byte every `every_s`."""
    sock, stop = socket.socket(), threading.Event()
    sock.bind(("127.0.0.1", 0))
    sock.listen()

    def answer(conn):
        with conn:
            conn.recv(65536)
            data = head + b" " * 100_000
            for i in range(len(data)):
                if stop.wait(every_s):
                    return
                try:
                    conn.sendall(data[i:i + 1])
                except OSError:
                    return

    def serve():
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True, name="trickle-server").start()

    threading.Thread(target=serve, daemon=True, name="trickle-server").start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/grade"
    finally:
        stop.set()
        sock.close()


def _client_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name != "trickle-server" and t is not threading.main_thread()]


@pytest.mark.parametrize("where, head", [
    ("status line", b""),  # "HTTP/1.1 ..." never completes: urllib's per-read timeout never fires
    ("headers", b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\nX-Slow: "),
    ("body", b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"),
])
def test_a_grader_trickling_its_answer_is_bounded_by_timeout_s_and_leaves_no_thread(where, head):
    """One byte every 0.05 s, with a per-read timeout of 0.5 s: the whole answer is bounded by timeout_s
    (a run was held 170 s while its threads grew to 215), and no request thread outlives the call."""
    before = _client_threads()
    with _trickling_server(head or b"HTTP/1.1 200", 0.05) as url:
        g = RemoteGrader(url, retries=1, backoff_s=0.0, timeout_s=0.5, on_error="skip", concurrency=4, batch_size=1)
        for _ in range(3):
            start = time.monotonic()
            assert g(**_batch(4)) == [None] * 4
            assert time.monotonic() - start < 2.5  # 2 attempts x 0.5 s, with room for a loaded machine
            assert "no complete answer within 0.5 s" in g.last_failure, g.last_failure
            ended = time.monotonic() + 1.0  # a thread whose socket was just shut may take a moment to return
            while _client_threads() != before and time.monotonic() < ended:
                time.sleep(0.02)
            # every request thread (and its deadline timer) has ended; a thread an earlier test left may end too
            assert not Counter(_client_threads()) - Counter(before)
