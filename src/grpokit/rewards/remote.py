"""Remote graders: a reward function that is an HTTP(S) endpoint instead of Python code.

An entry of `rewards.functions` that starts with `http://` or `https://` names a grader running as a
service (another machine, another language, a GPU judge model, a sandbox farm). grpokit POSTs each
generation batch to it and reads back one score per completion, so the grader's own dependencies
never enter the training process.

The protocol (one POST per request of at most `batch_size` samples):

    POST <url>   Content-Type: application/json
    {"prompts": [...], "completions": [...], "completion_ids": [[...], ...], "<column>": [...], ...}

Each list has one entry per completion, exactly as a Python reward function receives them: prompts
repeated once per completion (text, or chat messages), completions as text (for chat prompts
`[{"role": "assistant", "content": ...}]`), token ids, and every other dataset column. Columns that
are not JSON-serialisable (environment objects, datetimes, ...) are left out of the body (their names
are in `RemoteGrader.omitted_columns`); numpy / torch values are sent as numbers and lists, and NaN or
inf in a float column as null. The answer is a JSON list of scores, or an object `{"scores": [...]}`,
with one number or null per completion of the request; null means "not graded by this grader", as
None does for a Python function. JSON's true / false are not numbers and fail like any other non-number
(Python would read them as 1 / 0: a grader answering pass flags must say so with 1.0 / 0.0).

Failures are retried because graders are services that restart, queue and time out: a connection
error, no complete answer within `timeout_s` (the whole request; over 64 MiB is a fault too), HTTP 429
or >= 500, an answer that is not JSON, the wrong number of scores, or a score that is not a finite
number or null is retried up to `retries` times, waiting `backoff_s * 2**attempt` seconds before each
retry (SIGINT / SIGTERM during a call end these waits at once: a run asked to stop retries no more).
Any other 4xx is the grader refusing the request itself and is not retried, and so is a redirect (3xx:
urllib would send the POST on as a GET without the batch; the error names the URL to use). After the last
attempt, `on_error="raise"` stops the run with `RewardError` (one line: the URL, the attempts, what
came back); `on_error="skip"` leaves that request's samples ungraded (None) and reports their count
as the metric `rewards/<name>/ungraded`.

Credentials go in `headers` (e.g. `{Authorization = "Bearer ..."}`), never in the URL, which is
printed in errors and turned into the metric name. A grader on a loopback address (127.0.0.1,
localhost, ::1) is reached directly even when http_proxy / https_proxy are set; any other follows the
proxy environment variables as urllib does.

Only the standard library is used (urllib, threads): the core stays free of HTTP client packages.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import math
import numbers
import re
import socket
import ssl
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from grpokit.errors import RewardError, RewardLoadError
from grpokit.rewards.remote_io import AttemptFailed, fetch, preview_body, signals_end_backoff

_CONNECT_TIMEOUT_S = 5.0  # check_reachable's limit: a start-up check must not hang the launch
_DROPPED = ("trainer_state", "log_extra")  # TRL's extras that mean nothing to a remote service
def is_url(ref: str) -> bool:
    """True for a reward reference that names a remote grader ("http://..." or "https://...")."""
    return isinstance(ref, str) and ref[:8].lower().startswith(("http://", "https://"))


def url_reward_name(url: str) -> str:
    """The metric-safe name of a grader: host, explicit port and path joined by '_'.

    "http://127.0.0.1:8000/score" -> "127.0.0.1_8000_score", "https://judge.example.com/v1/grade" ->
    "judge.example.com_v1_grade". The scheme and the query are dropped, and every run of characters
    other than letters, digits, '.', '-' and '_' becomes one '_', so the name holds no '/' or ':' and
    `rewards/<name>/mean` stays one metric path. Two graders that map to the same name are told apart
    like any other rewards (`unique_reward_names` adds `_2`).
    """
    parts = urlsplit(url)
    port = _port_or_none(parts)
    raw = "_".join(p for p in [parts.hostname or "", str(port) if port else "", parts.path] if p)
    return re.sub(r"[^A-Za-z0-9.-]+", "_", raw).strip("_") or "remote"


def _port_or_none(parts) -> int | None:
    try:
        return parts.port
    except ValueError:  # a port that is not a number: reported by RemoteGrader's checks
        return None


def _jsonable(obj: Any) -> Any:
    """json.dumps' fallback: numpy scalars and arrays, torch tensors -> Python numbers and lists."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, allow_nan=False, default=_jsonable)


def _json_columns(columns: dict[str, Sequence]) -> tuple[dict[str, list], list[str]]:
    """The columns that can travel as JSON (NaN / inf floats as null), and the names of those that cannot."""
    kept, omitted = {}, []
    for name, values in columns.items():
        values = [None if isinstance(v, float) and not math.isfinite(v) else v for v in values]
        try:
            _dumps(values)
        except (TypeError, ValueError, OverflowError, RecursionError):  # objects, circular references
            omitted.append(name)
        else:
            kept[name] = values
    return kept, sorted(omitted)


def _is_loopback(host: str) -> bool:
    try:
        return host.lower() == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _GaveUp(Exception):
    def __init__(self, failure: AttemptFailed, attempts: int):
        super().__init__(failure.what)
        self.failure, self.attempts = failure, attempts


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_seconds(name: str, value: Any, positive: bool) -> float:
    bad = isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
        or (value <= 0 if positive else value < 0)
    if bad:
        raise ValueError(f"{name} must be a finite number of seconds {'> 0' if positive else '>= 0'}, "
                         f"got {value!r}")
    return float(value)


class RemoteGrader:
    """A reward function (TRL's convention) that asks an HTTP grader for the scores.

    `concurrency` requests of at most `batch_size` samples are in flight at once (threads); each waits
    at most `timeout_s` and is retried `retries` times after `backoff_s * 2**attempt` seconds. With
    `on_error="skip"` the samples of a request that still fails are None; `ungraded` holds their count
    in the last call, `ungraded_total` over all calls, `last_failure` what the last failure was.
    Arguments are checked here (ValueError naming the argument) since they come from user config.
    """

    def __init__(self, url: str, *, name: str | None = None, concurrency: int = 4, batch_size: int = 64,
                 timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 1.0, on_error: str = "raise",
                 headers: dict[str, str] | None = None):
        if not is_url(url):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        parts = urlsplit(url)
        if not parts.hostname:
            raise ValueError(f"url {url!r} has no host; write it like http://127.0.0.1:8000/score")
        try:
            parts.port
        except ValueError:
            raise ValueError(f"url {url!r} has a port that is not a number in 0-65535") from None
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"url {url!r} holds credentials, which would be printed in errors and metric names; "
                             f"pass them as headers = {{Authorization = \"...\"}} instead")
        if name is None:
            name = url_reward_name(url)
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"name must be a non-empty string without '/' (it names metrics), got {name!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be \"raise\" or \"skip\", got {on_error!r}")
        if headers is not None and not (isinstance(headers, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in headers.items())):
            raise ValueError("headers must be a table of strings, e.g. {Authorization = \"Bearer ...\"}, "
                             f"got a {type(headers).__name__}")
        self.url, self.name, self.__name__ = url, name, name  # __name__: how train(rewards=[...]) names it
        self.concurrency = _check_int("concurrency", concurrency, 1)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.retries = _check_int("retries", retries, 0)
        self.timeout_s = _check_seconds("timeout_s", timeout_s, positive=True)
        self.backoff_s = _check_seconds("backoff_s", backoff_s, positive=False)
        self.on_error = on_error
        self.headers = {"Content-Type": "application/json", "Accept": "application/json",
                        "User-Agent": "grpokit-remote-grader", **(headers or {})}
        self._scheme, self._host = parts.scheme.lower(), parts.hostname
        self._port = parts.port or (443 if self._scheme == "https" else 80)
        self._proxy = self._proxy_for()
        self._proxies = {self._scheme: self._proxy} if self._proxy else {}
        self.ungraded = 0
        self.ungraded_total = 0
        self.last_failure: str | None = None
        self.omitted_columns: list[str] = []

    def __repr__(self) -> str:
        return (f"RemoteGrader({self.url!r}, name={self.name!r}, concurrency={self.concurrency}, "
                f"batch_size={self.batch_size}, timeout_s={self.timeout_s}, retries={self.retries}, "
                f"backoff_s={self.backoff_s}, on_error={self.on_error!r})")

    def _proxy_for(self) -> str | None:
        """The proxy urllib would use for this URL (from the environment); none for a loopback grader."""
        if _is_loopback(self._host):
            return None
        proxy = urllib.request.getproxies().get(self._scheme)
        if not proxy or urllib.request.proxy_bypass(self._host):
            return None
        return proxy

    # ---- start-up check ------------------------------------------------------------------------------

    def check_reachable(self) -> None:
        """Fail fast, before the model loads, when nothing listens at the grader's host and port.

        Only a TCP connection (plus the TLS handshake for https) is tried: a grader may implement POST
        alone, and a POST would grade nothing. Through a proxy, the proxy is what is checked.
        """
        where = f"{self._host}:{self._port}"
        target, via = (self._host, self._port), ""
        if self._proxy:
            proxy = urlsplit(self._proxy if "://" in self._proxy else f"http://{self._proxy}")
            target, via = (proxy.hostname, _port_or_none(proxy) or 80), f" through the proxy {self._proxy}"
            where = f"{target[0]}:{target[1]}"
        limit = min(self.timeout_s, _CONNECT_TIMEOUT_S)
        fix = "start the grader (it must listen there) or fix the URL in rewards.functions"
        head = f"remote grader {self.url} is not reachable{via}"
        try:
            sock = socket.create_connection(target, timeout=limit)
        except socket.gaierror as e:
            raise RewardLoadError(f"{head}: host {target[0]!r} not found ({e.strerror}); fix the URL "
                                  f"in rewards.functions") from None
        except ConnectionRefusedError:
            raise RewardLoadError(f"{head}: nothing listens on {where} (connection refused); {fix}") from None
        except TimeoutError:
            raise RewardLoadError(f"{head}: no connection to {where} within {limit:g} s; {fix}, and check "
                                  f"that this machine may reach it (firewall)") from None
        except OSError as e:
            raise RewardLoadError(f"{head}: connecting to {where} failed ({e}); {fix}") from None
        with sock:
            if self._scheme != "https" or self._proxy:
                return
            try:
                with ssl.create_default_context().wrap_socket(sock, server_hostname=self._host):
                    pass
            except (ssl.SSLError, ssl.CertificateError, OSError) as e:
                raise RewardLoadError(f"remote grader {self.url}: the TLS handshake with {where} failed "
                                      f"({' '.join(str(e).split())}); use http:// if the grader does not speak "
                                      f"TLS, or give it a certificate this machine trusts (SSL_CERT_FILE)") from None

    # ---- grading -------------------------------------------------------------------------------------

    def __call__(self, prompts: Sequence, completions: Sequence, completion_ids: Sequence | None = None,
                 log_metric: Callable[[str, float], None] | None = None, **columns) -> list[float | None]:
        """One score (or None) per completion, graded by the remote service."""
        for key in _DROPPED:
            columns.pop(key, None)
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"remote grader {self.name!r} got {len(prompts)} prompts for {n} completions")
        cols, self.omitted_columns = _json_columns(columns)
        fields: dict[str, list] = {"prompts": list(prompts), "completions": list(completions)}
        if completion_ids is not None:
            fields["completion_ids"] = list(completion_ids)
        fields.update(cols)
        bounds = [(a, min(a + self.batch_size, n)) for a in range(0, n, self.batch_size)]
        bodies = [self._body(fields, a, b) for a, b in bounds]
        scores: list[float | None] = [None] * n
        ungraded = 0
        stop = threading.Event()  # set when the call gives up or a stop is asked for: back-offs end at once
        heard: list[str] = []  # the stop signals that arrived during the call
        pool = ThreadPoolExecutor(max(1, min(self.concurrency, len(bounds))), thread_name_prefix="grader")
        try:
            with signals_end_backoff(stop, heard):
                futures = {pool.submit(self._request, body, b - a, stop): (a, b)
                           for body, (a, b) in zip(bodies, bounds)}
                for future in as_completed(futures):
                    a, b = futures[future]
                    try:
                        scores[a:b] = future.result()
                    except _GaveUp as e:
                        self.last_failure = e.failure.what
                        if self.on_error == "raise":
                            stop.set()
                            raise RewardError(self._message(e, b - a, sorted(fields), heard)) from None
                        ungraded += b - a
        except BaseException:  # a RewardError, or Ctrl-C: never wait for a request still hanging
            stop.set()
            raise
        finally:
            pool.shutdown(wait=not stop.is_set(), cancel_futures=True)
        self.ungraded = ungraded
        self.ungraded_total += ungraded
        if self.on_error == "skip" and log_metric is not None:
            log_metric(f"rewards/{self.name}/ungraded", ungraded)
        return scores

    def _body(self, fields: dict[str, list], a: int, b: int) -> bytes:
        try:
            return _dumps({k: v[a:b] for k, v in fields.items()}).encode()
        except (TypeError, ValueError) as e:  # prompts / completions / ids that JSON cannot carry
            raise RewardError(f"remote grader {self.url}: the batch cannot be sent as JSON ({e}); a remote grader "
                              f"takes text or chat prompts and completions") from None

    def _message(self, gave_up: _GaveUp, k: int, fields: list[str], heard: Sequence[str] = ()) -> str:
        what, attempts, samples = gave_up.failure.what, gave_up.attempts, f"{k} sample{'s' * (k != 1)}"
        if heard and gave_up.failure.retry and attempts <= self.retries:  # the stop ended its retries
            return (f"remote grader {self.url} failed {attempts} time(s) on a request of {samples}, last with "
                    f"{what}, and {heard[0]} asked the run to stop, so it was not retried again and the run "
                    f"stops without this step; start the grader (or fix it) before continuing the run")
        if not gave_up.failure.retry:
            return (f"remote grader {self.url} refused a request of {samples} with {what} (not retried: only "
                    f"429, 5xx, timeouts and connection errors are); fix the URL or make the grader accept the "
                    f"body it was sent, with the fields {fields}")
        return (f"remote grader {self.url} failed {attempts} time(s) on a request of {samples}, last with "
                f"{what}; check that the grader runs and answers one finite number or null per completion, "
                f"or raise its timeout_s / retries, or set on_error = \"skip\" in rewards.args")

    def _request(self, body: bytes, k: int, stop: threading.Event) -> list[float | None]:
        """POST one request, retrying; `_GaveUp` after the last attempt or a failure not worth retrying."""
        attempt = 0
        while True:
            try:
                return self._post(body, k)
            except AttemptFailed as failure:
                if not failure.retry or attempt >= self.retries:
                    raise _GaveUp(failure, attempt + 1) from None
                if stop.wait(self.backoff_s * 2 ** attempt):  # another request gave up: so does this one
                    raise _GaveUp(failure, attempt + 1) from None
                attempt += 1

    def _post(self, body: bytes, k: int) -> list[float | None]:
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            raw = fetch(request, self.timeout_s, self._proxies)  # the whole answer within timeout_s; no redirect
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise AttemptFailed(f"no answer within {self.timeout_s:g} s (timeout_s)") from None
            raise AttemptFailed(f"a connection error ({e.reason})") from None
        except TimeoutError:
            raise AttemptFailed(f"no answer within {self.timeout_s:g} s (timeout_s)") from None
        except (OSError, http.client.HTTPException) as e:
            raise AttemptFailed(f"a connection error ({type(e).__name__}: {e})") from None
        return self._parse(raw, k)

    @staticmethod
    def _parse(raw: bytes, k: int) -> list[float | None]:
        try:
            data = json.loads(raw)
        except ValueError:
            raise AttemptFailed(f"malformed JSON {preview_body(raw)}") from None
        if isinstance(data, dict) and "scores" in data:
            data = data["scores"]
        if not isinstance(data, list):
            raise AttemptFailed(f"JSON {preview_body(raw)}, not a list of scores or {{\"scores\": [...]}}")
        if len(data) != k:
            raise AttemptFailed(f"{len(data)} scores for {k} completions {preview_body(raw)}")
        scores: list[float | None] = []
        for i, v in enumerate(data):
            try:
                x = None if v is None else float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) \
                    else math.nan
            except OverflowError:  # an integer beyond float's range
                x = math.inf
            if x is not None and not math.isfinite(x):
                raise AttemptFailed(f"score {json.dumps(v)[:40]} at index {i}, not a finite number or null")
            scores.append(x)
        return scores
