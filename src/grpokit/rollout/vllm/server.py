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

In async mode (docs/ASYNC.md) the worker process sends the requests and the trainer pushes the weights;
a lock shared by the two keeps a push from landing while a batch is being sampled, so each answer has
one policy version. FSDP shards are gathered one tensor at a time (`named_weights_for_sync`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

from grpokit.config.options import VLLMOptions
from grpokit.errors import RolloutWorkerError, UserError

FIX = ("start it with `grpokit serve MODEL` (or vLLM's api_server with VLLM_SERVER_DEV_MODE=1), or check "
       "rollout.vllm.server")


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
        call grpokit makes may be repeated (a seeded request samples the same answers). A server that is down
        refuses the second try too."""
        import requests

        try:
            try:
                response = self.session.request(method, f"{self.url}{path}", timeout=timeout_s or self.timeout_s,
                                                **kwargs)
            except requests.ConnectionError as e:
                if isinstance(e, requests.Timeout):
                    raise
                response = self.session.request(method, f"{self.url}{path}", timeout=timeout_s or self.timeout_s,
                                                **kwargs)
        except self.errors as e:  # down, unreachable, or slower than the timeout
            raise RolloutWorkerError(f"rollout.vllm.server: the vLLM server at {self.url} did not answer {path} "
                                     f"within rollout.vllm.server_timeout_s = {self.timeout_s:g} s "
                                     f"({type(e).__name__}); {FIX}") from None
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
        client = ServerClient(options.server, options.server_timeout_s)
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
