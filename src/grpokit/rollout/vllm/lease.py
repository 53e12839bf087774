"""One run at a time on a vLLM server: a lease the run claims at its start and renews while it lives.

A vLLM server holds one set of weights. Two runs pushing theirs into one server sample from each other's policy
without an error (one run's step sampled from the other's weights: a log-prob gap of 2 nats at that step and
none at the others), so a server serves one run at a time. vLLM has no notion of an owner, so `grpokit serve`
adds one to vLLM's own server as an ASGI middleware (`--middleware grpokit.rollout.vllm.lease.RunLease`, vLLM's
flag for it):

    GET    /grpokit/lease    {"holder": {...} | null, "expires_in_s": s}
    POST   /grpokit/lease    {"run", "host", "pid", "command", "ttl_s", "take_over": run | null}: claim or renew
                             (200), or 409 with the holder when another run's lease is live
    DELETE /grpokit/lease    {"run"}: released by its holder

and every request that names a run (header `X-Grpokit-Run`) other than the live holder's is refused with 409: a run
whose lease lapsed (frozen past its time) and was claimed by another cannot push into it or sample from it. Requests
that name no run (other clients, `curl`) pass. The trainer (`ServerLease`) renews from a thread every quarter of
the lease's time, so a run stopped in any way (SIGKILL included) frees the server within `ttl_s`; a holder on this
machine whose process is gone is taken over at once. A server started without the middleware (vLLM's own
api_server by hand) cannot be leased: said once, the run goes on.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time

LEASE_PATH = "/grpokit/lease"
RUN_HEADER = "X-Grpokit-Run"
TTL_S = 60.0
_held: dict[str, "ServerLease"] = {}  # server URL -> the lease this process holds there


def release(url: str) -> None:
    """Give back the lease this process holds on `url` (the run's weights publisher closes; at exit at the latest)."""
    if (lease := _held.get(url.rstrip("/"))) is not None:
        lease.release()


def leased_run(url: str) -> str | None:
    """The run id this process holds `url`'s lease under (its clients name it in every call), or None."""
    lease = _held.get(url.rstrip("/"))
    return lease.run if lease is not None else None


class RunLease:
    """The server's end: pure ASGI (no framework beyond what vLLM's server runs), state in the server process.
    With several API server processes (vLLM's --api-server-count > 1) each would hold a lease of its own: grpokit
    serve starts one."""

    def __init__(self, app):
        self.app, self.holder, self.expires = app, None, 0.0

    def _live_holder(self) -> dict | None:
        if self.holder is not None and time.monotonic() > self.expires:
            self.holder = None  # lapsed: its run stopped renewing
        return self.holder

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] == LEASE_PATH:
            return await self._lease(scope, receive, send)
        run = dict(scope.get("headers") or []).get(RUN_HEADER.lower().encode())
        if run is not None:
            holder = self._live_holder()
            if holder is not None and holder["run"] != run.decode(errors="replace"):
                return await _reply(send, 409, {"error": "leased", "holder": holder})
            if holder is not None:  # the holder's own calls renew it too
                self.expires = time.monotonic() + holder["ttl_s"]
        return await self.app(scope, receive, send)

    async def _lease(self, scope, receive, send):
        method, holder = scope["method"], self._live_holder()
        if method == "GET":
            return await _reply(send, 200, {"holder": holder,
                                            "expires_in_s": max(0.0, self.expires - time.monotonic())})
        try:
            body = json.loads(await _body(receive) or b"{}")
            run = str(body["run"])
        except (ValueError, KeyError, TypeError):
            return await _reply(send, 400, {"error": "a JSON body with the run's id ('run') is required"})
        if method == "DELETE":
            if holder is not None and holder["run"] == run:
                self.holder = None
            return await _reply(send, 200, {"holder": self.holder})
        if method != "POST":
            return await _reply(send, 405, {"error": f"{method} {LEASE_PATH}"})
        if holder is not None and holder["run"] != run and body.get("take_over") != holder["run"]:
            return await _reply(send, 409, {"error": "leased", "holder": holder})
        ttl = min(max(float(body.get("ttl_s") or TTL_S), 5.0), 3600.0)
        since = holder["since"] if holder is not None and holder["run"] == run else time.time()
        self.holder = {"run": run, "host": str(body.get("host", "")), "pid": body.get("pid"),
                       "command": str(body.get("command", ""))[:300], "since": since, "ttl_s": ttl}
        self.expires = time.monotonic() + ttl
        return await _reply(send, 200, {"holder": self.holder})


async def _body(receive) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _reply(send, status: int, content: dict) -> None:
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def describe(holder: dict) -> str:
    """A lease holder in words, for the error a second run gets."""
    since = time.strftime("%H:%M:%S", time.localtime(float(holder.get("since") or 0)))
    where = f"process {holder.get('pid')} on {holder.get('host') or 'another machine'}"
    command = f" ({holder['command']})" if holder.get("command") else ""
    return f"run {holder.get('run')}, {where}{command}, since {since}"


def _process_gone(holder: dict) -> bool:
    """The holder ran on this machine and its process is gone (or is this process: an earlier run in it ended
    without releasing, e.g. refused at its start): its lease is free to take over at once."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    if holder["pid"] == os.getpid():
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


class ServerLease:
    """The run's end: `claim()` once at the start (one error naming the run holding the server), renewed from a
    daemon thread until `release()`. `client` (vllm/server.py ServerClient) then names the run in every call."""

    def __init__(self, client, run: str, ttl_s: float = TTL_S):
        self.client, self.run, self.ttl_s = client, run, ttl_s
        self.stop, self.thread, self.lost = threading.Event(), None, None

    def _body(self, take_over: str | None = None) -> dict:
        return {"run": self.run, "host": socket.gethostname(), "pid": os.getpid(), "ttl_s": self.ttl_s,
                "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:300],
                "take_over": take_over}

    def claim(self) -> bool:
        """Claim the server for this run; False where the server has no lease (started without grpokit serve)."""
        from grpokit.errors import UserError

        status, reply = self.client.lease_call("POST", self._body())
        if status == 404:
            return False
        if status == 409 and _process_gone(holder := reply.get("holder") or {}):
            status, reply = self.client.lease_call("POST", self._body(take_over=holder.get("run")))
        if status == 409:
            holder = reply.get("holder") or {}
            left = float(holder.get("ttl_s") or self.ttl_s)
            raise UserError(f"rollout.vllm.server: the vLLM server at {self.client.url} is in use by another run "
                            f"({describe(holder)}): a server holds one run's weights at a time, and two runs would "
                            "sample from each other's. Wait for that run to end (a run that stopped frees it within "
                            f"{left:g} s), or start another server for this run (grpokit serve MODEL --port P)")
        if status != 200:
            return False
        self.client.run = self.run
        _held[self.client.url] = self
        atexit.register(self.release)
        self.thread = threading.Thread(target=self._renew, daemon=True, name="vllm-lease")
        self.thread.start()
        return True

    def _renew(self) -> None:
        while not self.stop.wait(self.ttl_s / 4):
            try:
                status, reply = self.client.lease_call("POST", self._body(), timeout_s=10)
            except Exception:  # noqa: BLE001 - a server down is said by the run's own next call
                continue
            if status == 409:  # lapsed (this process was frozen past its time) and claimed by another run
                self.lost = reply.get("holder") or {}
                return

    def release(self) -> None:
        self.stop.set()
        if _held.get(self.client.url) is self:
            del _held[self.client.url]
        if self.client.run == self.run:
            try:
                self.client.lease_call("DELETE", {"run": self.run}, timeout_s=5)
            except Exception:  # noqa: BLE001 - down or frozen: the lease lapses by itself
                pass
