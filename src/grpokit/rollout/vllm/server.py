"""vLLM as a server on devices of its own (`rollout.vllm = {server = "http://host:8000"}`).

    grpokit serve MODEL --devices 1 --port 8000      # vLLM's own `vllm serve`, with the flags below
    rollout.engine = "vllm", rollout.vllm = {server = "http://localhost:8000"}

The sampler is vLLM's OpenAI-compatible server: each prompt is one `/v1/completions` request with its
token ids, `n = G`, a seed from the trainer's generator and `logprobs = 0` (the sampled token's log-prob,
with the temperature: the server runs with `--logprobs-mode processed_logprobs`). `ServerLLM` answers the
engine's `complete(...)` calls over HTTP, so sampling, multi-turn tool calls and the answers' bookkeeping are
`VLLMEngine`'s own code (vllm/engine.py) for both backends; only the weights move differently:

- full weights through vLLM's NCCL weight-transfer API (GPU), or written to a folder the server reloads them from
  (`rollout.vllm.weight_transfer`: "auto" picks NCCL where it can run; vllm/weights.py has both);
- with LoRA the adapter alone: saved to a folder the server can read and loaded under a new name
  (`/v1/load_lora_adapter`; the server started with `--enable-lora` and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`), which later requests name as their model.

The server must hold the model the trainer trains: after the start's push a probe (vllm/weights.py
`check_serves`: one short answer sampled by the server, scored by the trainer) compares the two's log-probs, so
a server started on another model, or one still holding weights an earlier run pushed under LoRA, is one error
at the start, not a run that learns nothing.
A server restarted mid-run (it lost the pushed weights) is noticed by its start time (`/metrics`).

A server is shared, and outlives runs, so a run does it no harm: before the trainer's model loads, `checks.check_server`
reads what the server says of itself (`/server_info`, vLLM's view of the served model) and refuses, in one error,
a model of other sizes than model.path's (its push would leave the server half-loaded), a LoRA rank above the
server's, more stop strings than it takes, a CPU server that splits prefills; then the run claims the server
(vllm/lease.py: one run at a time). A push pauses the server and resumes it on every way out
(`ServerClient.paused`), and a long call is watched (`ServerClient._watched`): a server stopped, restarted or
left paused meanwhile is said within seconds, not after `server_timeout_s`.

In async mode (docs/ASYNC.md) the worker process sends the requests and the trainer pushes the weights;
a lock shared by the two keeps a push from landing while a batch is being sampled, so each answer has
one policy version. FSDP shards are gathered one tensor at a time (`named_weights_for_sync`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from types import SimpleNamespace

from grpokit.config.options import VLLMOptions
from grpokit.errors import RolloutWorkerError, UserError
from grpokit.rollout.vllm.lease import LEASE_PATH, RUN_HEADER, describe, leased_run

FIX = ("start it with `grpokit serve MODEL` (or vLLM's api_server with VLLM_SERVER_DEV_MODE=1), or check "
       "rollout.vllm.server")
UNPAUSE = ("a run stopped during its weight push leaves a server so, or another client paused it. Resume it with "
           "`curl -X POST {url}/resume` (or restart it)")
WATCH_AFTER_S = 30.0  # calls allowed longer than this are watched (`ServerClient._watched`)
PROBE_EVERY_S = 5.0  # how often a watched call probes the server
PAUSED_S = 30.0  # a server paused this long, by no push of this process's, is said to be paused


class ServerClient:
    """vLLM's HTTP API, each failure one error naming the server and the fix."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        import requests  # vLLM's own dependency: present wherever vLLM is

        self.url, self.timeout_s, self.errors = url.rstrip("/"), timeout_s, requests.RequestException
        self.dtype: str | None = None  # the served weights' dtype, when the server says
        self.info: dict = {}  # /server_info's reply, when the server has it
        self.started: float | None = None  # the server's process start time: a restart loses pushed weights
        self.fix = FIX
        self.session = requests.Session()
        self.run: str | None = leased_run(self.url)  # this run's id on a server it leased (vllm/lease.py)
        self.pushing = False  # this process paused the server for a push: a pause is its own, not a fault
        self._watch = threading.Lock()
        self._watched_at, self._verdict, self._refused, self._paused_since = 0.0, None, 0, None

    def wait_ready(self) -> None:
        """Block until `/health` answers (the server may still be loading its model), at most timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                status = self.session.get(f"{self.url}/health", timeout=5).status_code
            except self.errors:
                status = None
            if status == 200:
                return
            if status == 404:  # something answers there, and it is not a vLLM server
                raise UserError(f"rollout.vllm.server: {self.url} answers, but has no /health: it is not a vLLM "
                                f"server's address (no /v1 at the end); {FIX}")
            if time.monotonic() > deadline:
                raise UserError(f"rollout.vllm.server: no vLLM server answers at {self.url} within "
                                f"rollout.vllm.server_timeout_s = {self.timeout_s:g} s; {FIX}")
            time.sleep(1.0)

    def call(self, method: str, path: str, *, timeout_s: float | None = None, text: bool = False, **kwargs):
        """The reply's JSON (`text`: its text, for the calls vLLM answers in plain text, as loading an adapter).

        A connection the server closed while idle (its HTTP keep-alive is 5 s; a pooled connection can be taken
        just as it closes: "Remote end closed connection without response") is tried once more on a new one: every
        call grpokit makes may be repeated (a seeded request samples the same answers), on the same server (a
        restarted one, which lost the pushed weights, is said instead). A server that is down refuses the second
        try too. A long call is watched (`_watched`): a server stopped, restarted or paused meanwhile is said
        within seconds, not after the whole timeout."""
        import requests

        timeout_s = timeout_s or self.timeout_s
        if self.run is not None:  # a leased server refuses a run that is not its holder (vllm/lease.py)
            kwargs["headers"] = {**kwargs.get("headers", {}), RUN_HEADER: self.run}

        def send():
            return self.session.request(method, f"{self.url}{path}", timeout=timeout_s, **kwargs)

        try:
            try:
                response = self._watched(send, path) if timeout_s > WATCH_AFTER_S else send()
            except requests.ConnectionError as e:
                if isinstance(e, requests.Timeout):
                    raise
                if path != "/metrics":  # (the start time itself comes from /metrics)
                    self.check_not_restarted()
                response = self._watched(send, path) if timeout_s > WATCH_AFTER_S else send()
        except self.errors as e:  # down, unreachable, or slower than the timeout
            paused = " It is paused (/is_paused): " + UNPAUSE.format(url=self.url) \
                if not self.pushing and self.is_paused() else ""  # (a push's own pause is no news)
            limit = f"rollout.vllm.server_timeout_s = {timeout_s:g} s" if timeout_s == self.timeout_s else \
                f"{timeout_s:g} s"
            raise RolloutWorkerError(f"rollout.vllm.server: the vLLM server at {self.url} did not answer {path} "
                                     f"within {limit} ({type(e).__name__});" + (paused or f" {FIX}")) from None
        if response.status_code == 409 and "leased" in response.text:
            raise RolloutWorkerError(self._lease_lost(response))
        if response.status_code == 404 and path == "/v1/completions" and "does not exist" in response.text:
            raise RolloutWorkerError(f"rollout.vllm.server: the vLLM server at {self.url} no longer holds the model "
                                     f"or adapter this run samples with ({response.text[:200]}); it was restarted "
                                     "or evicted it: restart the run with --resume (each start pushes it again)")
        if "lora" in path and (response.status_code == 404 or "LoRA is not enabled" in response.text):
            raise RolloutWorkerError(f"rollout.vllm.server: the vLLM server at {self.url} takes no LoRA adapters "
                                     f"({path}); restart it with `grpokit serve MODEL --lora-rank R` (R >= "
                                     "model.lora.r), or vLLM's --enable-lora with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
        if response.status_code == 404:
            raise RolloutWorkerError(f"rollout.vllm.server: the vLLM server at {self.url} has no {path}; {FIX}")
        if response.status_code != 200:
            raise RolloutWorkerError(f"rollout.vllm.server: {path} failed at {self.url} with HTTP "
                                     f"{response.status_code}: {response.text[:300]}")
        if text:
            return response.text
        try:
            return response.json() if response.content else {}
        except ValueError:  # something that is not vLLM answers there
            raise self.not_vllm(path, response.text) from None

    def _watched(self, send, path: str):
        """`send()` on a thread of its own while this one probes the server every few seconds (`verdict`): a server
        that stopped (a SIGTERMed vLLM waits for the open request before it exits: both would wait), restarted or
        stays paused ends the call with one error. A server that is only slow is waited for, up to the timeout."""
        box, done = [], threading.Event()

        def run():
            try:
                box.append((True, send()))
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
                box.append((False, e))
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name="vllm-call").start()
        while not done.wait(PROBE_EVERY_S):
            if (verdict := self.verdict()) is not None:
                raise RolloutWorkerError(f"rollout.vllm.server: the vLLM server at {self.url} {verdict} (while "
                                         f"{path} was waited for)")
        ok, value = box[0]
        if ok:
            return value
        raise value

    def verdict(self) -> str | None:
        """What the server's `/health` and start time say, probed at most every PROBE_EVERY_S by all of this
        client's threads together: "stopped", "restarted", "paused" (for longer than PAUSED_S and not by this
        process's own push) in words with the fix, or None (up, perhaps slow)."""
        import requests

        with self._watch:
            now = time.monotonic()
            if self._verdict is not None or now - self._watched_at < PROBE_EVERY_S:
                return self._verdict
            self._watched_at = now
            try:
                requests.get(f"{self.url}/health", timeout=PROBE_EVERY_S)
            except requests.ConnectionError as e:
                if not isinstance(e, requests.Timeout):
                    self._refused += 1  # refused twice in a row: gone (a busy server still accepts)
                    if self._refused >= 2:
                        self._verdict = ("stopped answering: it refuses connections (it was stopped, or it crashed)"
                                         f"; start it again ({FIX.split(', or check')[0]}), then continue with "
                                         "--resume")
                return self._verdict
            except requests.RequestException:
                return None
            self._refused = 0
            if self.started is not None and self.start_time() not in (None, self.started):
                self._verdict = ("was restarted and lost the weights it was sent; continue with --resume (each "
                                 "start pushes them again)")
            elif not self.pushing and self.is_paused():
                self._paused_since = self._paused_since or now
                if now - self._paused_since >= PAUSED_S:
                    self._verdict = "is paused (/is_paused) and no push of this run's is in progress: " + \
                        UNPAUSE.format(url=self.url)
            else:
                self._paused_since = None
            return self._verdict

    def is_paused(self) -> bool:
        """The server says it is paused (vLLM's /is_paused; False where it cannot say)."""
        import requests

        try:
            return requests.get(f"{self.url}/is_paused", timeout=5).json().get("is_paused") is True
        except (requests.RequestException, ValueError, AttributeError):
            return False

    @contextlib.contextmanager
    def paused(self):
        """The server paused for a push (`/pause`, requests kept for after it), and resumed on every way out: a
        failed push, a Ctrl-C (KeyboardInterrupt) or any other exception. Left paused, every later request to the
        server (other runs', other clients') would hang until its timeout. A resume the server did not confirm
        (frozen, or busy finishing the reload) has still reached it, and is said once."""
        self.pushing, failed = True, True
        try:  # a /pause that timed out has reached the server all the same (a frozen one takes it when it wakes)
            self.call("POST", "/pause", params={"mode": "keep"})
            yield
            failed = False
        finally:
            try:  # after a failure, briefly: the error to say is the push's
                self.call("POST", "/resume", timeout_s=min(self.timeout_s, 5.0 if failed else 30.0))
            except (RolloutWorkerError, KeyboardInterrupt):
                print(f"note: the vLLM server at {self.url} did not confirm that it resumed after this run's weight "
                      "push was stopped; if it stays paused (GET /is_paused): " + UNPAUSE.format(url=self.url),
                      file=sys.stderr, flush=True)
            finally:
                self.pushing = False

    def lease_call(self, method: str, body: dict, timeout_s: float | None = None) -> tuple[int, dict]:
        """A call to the server's lease (vllm/lease.py): its HTTP status and JSON reply (404: no lease there)."""
        try:
            response = self.session.request(method, f"{self.url}{LEASE_PATH}", json=body,
                                            timeout=timeout_s or min(self.timeout_s, 30.0))
        except self.errors as e:
            raise RolloutWorkerError(f"rollout.vllm.server: the vLLM server at {self.url} did not answer "
                                     f"{LEASE_PATH} ({type(e).__name__}); {FIX}") from None
        try:
            reply = response.json()
        except ValueError:
            reply = {}
        return response.status_code, reply if isinstance(reply, dict) else {}

    def _lease_lost(self, response) -> str:
        try:
            holder = response.json().get("holder") or {}
        except (ValueError, AttributeError):
            holder = {}
        return (f"rollout.vllm.server: the vLLM server at {self.url} is now held by another run ({describe(holder)}): "
                "this run's lease on it lapsed (the run was silent for longer than the lease, frozen or suspended) "
                "and that run claimed it, so its weights are no longer this run's. Continue with --resume once "
                "that run has ended, or on another server")

    def start_time(self) -> float | None:
        """The server's process start time (vLLM's Prometheus /metrics), or None where it does not say."""
        try:
            reply = self.call("GET", "/metrics", text=True, timeout_s=min(self.timeout_s, 30))
        except RolloutWorkerError:
            return None
        for line in reply.splitlines():
            if line.startswith("process_start_time_seconds "):
                return float(line.split()[1])
        return None

    def check_not_restarted(self) -> None:
        """The server this run pushed its weights to is still the one answering (a restarted server holds its
        starting weights, and a run would go on sampling from them without an error)."""
        if self.started is None:
            return
        now = self.start_time()
        if now is not None and now != self.started:
            raise RolloutWorkerError(f"rollout.vllm.server: the vLLM server at {self.url} was restarted during the "
                                     "run and lost the weights it was sent; continue with --resume (each start "
                                     "pushes them again)")

    def not_vllm(self, path: str, reply) -> RolloutWorkerError:
        return RolloutWorkerError(f"rollout.vllm.server: {self.url} answered {path} with {str(reply)[:120]!r}, "
                                  f"not what a vLLM server answers: it is not a vLLM server's address; {FIX}")

    def served_model(self) -> str:
        reply = self.call("GET", "/v1/models")
        try:
            return reply["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise self.not_vllm("/v1/models", reply) from None

    def check_setup(self) -> None:
        """The server's log-probs must include the temperature, as the trainer's do (when it says)."""
        try:
            info = self.call("GET", "/server_info", params={"config_format": "json"})
        except RolloutWorkerError:  # an older server without /server_info: nothing to check against
            return
        try:
            model_config = dict((info.get("vllm_config") or {}).get("model_config") or {})
        except (AttributeError, TypeError, ValueError):
            raise self.not_vllm("/server_info", info) from None
        self.info = info if isinstance(info, dict) else {}
        self.dtype = str(model_config.get("dtype") or "").removeprefix("torch.") or None
        mode = model_config.get("logprobs_mode")
        if mode not in (None, "processed_logprobs"):
            raise UserError(f"rollout.vllm.server: the vLLM server at {self.url} returns {mode}, not the sampling "
                            "distribution's log-probs; restart it with --logprobs-mode processed_logprobs "
                            "(`grpokit serve` sets it)")


class ServerLLM:
    """The server backend of `VLLMEngine` (vllm/engine.py): `complete` sends one `/v1/completions` request per
    prompt, concurrently (vLLM batches them); LoRA adapters are loaded and unloaded by name over HTTP."""

    def __init__(self, client: ServerClient):
        self.client, self.model = client, client.served_model()

    @classmethod
    def connect(cls, options: VLLMOptions) -> "ServerLLM":
        """The server at `options.server`, once it answers, with its setup checked and its start time noted."""
        client = ServerClient(options.servers[0], options.server_timeout_s)  # several: vllm/servers.py, one each
        client.wait_ready()
        client.check_setup()
        client.started = client.start_time()
        return cls(client)  # asks for the served model: something that is not vLLM is said first

    def complete(self, prompts: list[dict], params, adapter=None) -> list:
        self.client.check_not_restarted()  # once per call (a multi-turn rollout: per turn)
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        model = adapter.lora_name if adapter is not None else self.model
        return _concurrently(lambda *args: self._one(model, *args), list(zip(prompts, per_prompt, range(len(prompts)))),
                             width=min(256, len(prompts)))

    def serving(self):
        """Nothing to wake: the server is always up."""
        return contextlib.nullcontext()

    def wake_weights(self) -> None:
        """Nothing asleep: the server is always up."""

    def _one(self, model: str, prompt: dict, p, index: int) -> SimpleNamespace:
        if "multi_modal_data" in prompt:
            raise UserError("rollout.vllm.server: a vLLM server takes no images with token-id prompts; use the "
                            "colocated engine (no rollout.vllm.server) or rollout.engine = \"hf\" for images")
        payload = {"model": model, "prompt": prompt["prompt_token_ids"], "n": p.n, "max_tokens": p.max_tokens,
                   "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k or -1,
                   "seed": None if p.seed is None else p.seed + index,  # one call's prompts: noise of their own
                   "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
                   "ignore_eos": bool(p.ignore_eos), "stop_token_ids": p.stop_token_ids or [], "stop": p.stop or [],
                   "include_stop_str_in_output": bool(p.include_stop_str_in_output)}
        reply = self.client.call("POST", "/v1/completions", json=payload)
        try:
            choices = sorted(reply["choices"], key=lambda c: c.get("index", 0))
            outputs = [SimpleNamespace(token_ids=c["token_ids"], finish_reason=c.get("finish_reason"),
                                       logprobs=[{t: lp} for t, lp in zip(c["token_ids"],
                                                                           c["logprobs"]["token_logprobs"])])
                       for c in choices]
        except (KeyError, TypeError, AttributeError):  # no token ids or log-probs: not vLLM, or one too old
            raise self.client.not_vllm("/v1/completions", reply) from None
        return SimpleNamespace(outputs=outputs, prompt_token_ids=prompt["prompt_token_ids"])

    # ---- LoRA adapters (vllm/weights.py AdapterFolders) ---------------------------------------------

    def load_adapter(self, name: str, number: int, folder: str):
        """Load the adapter in `folder` (a folder the server reads) as `name`; requests name it as their model."""
        try:
            reply = self.client.call("POST", "/v1/load_lora_adapter", text=True,
                                     json={"lora_name": name, "lora_path": folder, "load_inplace": False})
        except RolloutWorkerError as e:  # a retried call whose first try loaded it: it is there, as asked
            if "has already been loaded" not in str(e):
                raise
            reply = "success"
        if "success" not in reply.lower():  # vLLM answers "Success: LoRA adapter '...' added successfully."
            raise self.client.not_vllm("/v1/load_lora_adapter", reply)
        return SimpleNamespace(lora_name=name, lora_int_id=number, lora_path=folder)

    def unload_adapter(self, previous, timeout_s: float | None = None) -> None:
        with contextlib.suppress(RolloutWorkerError):  # already gone (evicted, a restart): nothing to free
            self.client.call("POST", "/v1/unload_lora_adapter", text=True, json={"lora_name": previous.lora_name},
                             timeout_s=timeout_s)


def _concurrently(fn, calls: list[tuple], width: int) -> list:
    """`[fn(*c) for c in calls]` on `width` daemon threads: a Ctrl-C or a failed call returns at once, with no
    wait for the calls still in flight (a ThreadPoolExecutor joins its threads at exit: up to the timeout)."""
    if not calls:
        return []
    out, failed, left, done = [None] * len(calls), [], [width], threading.Event()
    lock = threading.Lock()

    def run(first: int) -> None:
        try:
            for i in range(first, len(calls), width):
                if failed:
                    return
                out[i] = fn(*calls[i])
        except BaseException as e:  # said by the caller's thread; the first failure ends the wait
            failed.append(e)
            done.set()
        finally:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    for k in range(width):
        threading.Thread(target=run, args=(k,), daemon=True, name="vllm-request").start()
    done.wait()
    if failed:
        raise failed[0]
    return out
