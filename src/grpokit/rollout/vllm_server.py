"""vLLM as a server on devices of its own (`rollout.vllm = {server = "http://host:8000"}`).

    grpokit serve MODEL --devices 1 --port 8000      # vLLM's own `vllm serve`, with the flags below
    rollout.engine = "vllm", rollout.vllm = {server = "http://localhost:8000"}

The sampler is vLLM's OpenAI-compatible server: each prompt is one `/v1/completions` request with its
token ids, `n = G`, a seed from the trainer's generator and `logprobs = 0` (the sampled token's log-prob,
with the temperature: the server runs with `--logprobs-mode processed_logprobs`). `ServerLLM` answers the
colocated engine's `llm.generate(...)` calls over HTTP, so sampling, multi-turn tool calls and the
answers' bookkeeping are `VLLMEngine`'s own code; only the weights move differently:

- full weights through vLLM's weight-transfer API (the server started with `VLLM_SERVER_DEV_MODE=1` and
  `--weight-transfer-config '{"backend": "nccl"}'`): the trainer opens an NCCL group with the server's
  workers once (`/init_weight_transfer_engine`), then per sync `/pause` -> `/start_weight_update` ->
  the tensors broadcast from the trainer while `/update_weights` receives them -> `/finish_weight_update`
  -> `/resume`. The broadcast runs on a thread of its own: NCCL has no timeout, the HTTP call has one;
- with LoRA the adapter alone: saved to a folder the server can read and loaded under a new name
  (`/v1/load_lora_adapter`; the server started with `--enable-lora` and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`), which later requests name as their model.

In async mode (docs/ASYNC.md) the worker process sends the requests and the trainer pushes the weights;
a lock shared by the two keeps a push from landing while a batch is being sampled, so each answer has
one policy version. FSDP shards are gathered one tensor at a time (`named_weights_for_sync`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

from grpokit.errors import RolloutWorkerError, UserError
from grpokit.models.lora import adapter_of
from grpokit.models.parallel import any_rank, rank
from grpokit.rollout.vllm import VLLMEngine, named_weights_for_sync, sync_tensors

FIX = ("start it with `grpokit serve MODEL` (or vLLM's `vllm serve` with VLLM_SERVER_DEV_MODE=1 and "
       "--weight-transfer-config '{\"backend\": \"nccl\"}'), or check rollout.vllm.server")


class ServerClient:
    """vLLM's HTTP API, each failure one error naming the server and the fix."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        import requests  # vLLM's own dependency: present wherever vLLM is

        self.url, self.timeout_s, self.errors = url.rstrip("/"), timeout_s, requests.RequestException
        self.dtype: str | None = None  # the served weights' dtype, when the server says
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

    def call(self, method: str, path: str, *, timeout_s: float | None = None, **kwargs) -> dict:
        try:
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
        if response.status_code == 404 and "lora" in path:
            raise RolloutWorkerError(f"rollout.vllm.server: the vLLM server at {self.url} takes no LoRA adapters "
                                     f"({path}); restart it with `grpokit serve MODEL --lora-rank R` (R >= "
                                     "model.lora.r), or vLLM's --enable-lora with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
        if response.status_code == 404:
            raise RolloutWorkerError(f"rollout.vllm.server: the vLLM server at {self.url} has no {path}; {FIX}")
        if response.status_code != 200:
            raise RolloutWorkerError(f"rollout.vllm.server: {path} failed at {self.url} with HTTP "
                                     f"{response.status_code}: {response.text[:300]}")
        try:
            return response.json() if response.content else {}
        except ValueError:  # something that is not vLLM answers there
            raise self.not_vllm(path, response.text) from None

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
        self.dtype = str(model_config.get("dtype") or "").removeprefix("torch.") or None
        mode = model_config.get("logprobs_mode")
        if mode not in (None, "processed_logprobs"):
            raise UserError(f"rollout.vllm.server: the vLLM server at {self.url} returns {mode}, not the sampling "
                            "distribution's log-probs; restart it with --logprobs-mode processed_logprobs "
                            "(`grpokit serve` sets it)")


class ServerLLM:
    """`vllm.LLM.generate` over HTTP: one `/v1/completions` request per prompt, sent concurrently."""

    def __init__(self, client: ServerClient):
        self.client, self.model = client, client.served_model()

    def generate(self, prompts, sampling_params, use_tqdm=False, lora_request=None):
        per_prompt = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        model = lora_request.lora_name if lora_request is not None else self.model
        return _concurrently(lambda *args: self._one(model, *args), list(zip(prompts, per_prompt, range(len(prompts)))),
                             width=min(256, len(prompts)))  # vLLM batches them

    def _one(self, model: str, prompt: dict, p, index: int) -> SimpleNamespace:
        if "multi_modal_data" in prompt:
            raise UserError("rollout.vllm.server: a vLLM server takes no images with token-id prompts; use the "
                            "colocated engine (no rollout.vllm.server) or rollout.engine = \"hf\" for images")
        payload = {"model": model, "prompt": prompt["prompt_token_ids"], "n": p.n, "max_tokens": p.max_tokens,
                   "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k or -1,
                   "seed": None if p.seed is None else p.seed + index,  # one call's prompts: noise of their own
                   "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
                   "ignore_eos": bool(getattr(p, "ignore_eos", False)),
                   "stop_token_ids": getattr(p, "stop_token_ids", None) or [],
                   "stop": getattr(p, "stop", None) or [],
                   "include_stop_str_in_output": bool(getattr(p, "include_stop_str_in_output", False))}
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

    def reset_prefix_cache(self):
        """The server clears its caches itself when paused for new weights."""


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


def _vllm_transfer():
    """vLLM's trainer side of its NCCL weight transfer (imported on the trainer only: the worker sends HTTP).
    vLLM 0.28 replaced the engine's static trainer calls with these helpers (as TRL 1.16 reads them)."""
    try:
        from vllm.utils.network_utils import get_ip, get_open_port
        packed_in_init = True
        try:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
            from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer as send
        except ImportError:  # vLLM < 0.28: `packed` travels with each update, not in the init info
            packed_in_init = False
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerSendWeightsArgs
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine as Engine

            trainer_init = Engine.trainer_init

            def send(iterator, group, src=0, post_iter_func=None):
                Engine.trainer_send_weights(iterator=iterator,
                                            trainer_args=NCCLTrainerSendWeightsArgs(group=group, packed=True))
    except ImportError as e:
        raise UserError(f"rollout.vllm.server: this vLLM has no weight-transfer API ({e}); install a vLLM that does "
                        "(pip install -U vllm), or train with LoRA (model.lora: adapters travel as folders)") from None
    return SimpleNamespace(trainer_init=trainer_init, send=send, get_ip=get_ip, get_open_port=get_open_port,
                           packed_in_init=packed_in_init)


class VLLMServerEngine(VLLMEngine):
    """The colocated engine's sampling over HTTP (`ServerLLM`), weights pushed through vLLM's transfer API."""

    def __init__(self, url: str, *, server_timeout_s: float = 600.0, seed: int = 0, lora: dict | None = None,
                 tokenizer=None, tools=None, max_tool_turns: int = 8, transfer=None):
        self.client = ServerClient(url, server_timeout_s)
        self.client.wait_ready()
        self.client.check_setup()
        super().__init__(url, seed=seed, lora=lora, llm=ServerLLM(self.client),
                         vllm_module=SimpleNamespace(SamplingParams=SimpleNamespace), tokenizer=tokenizer,
                         tools=tools, max_tool_turns=max_tool_turns)
        self._transfer, self._group, self._packed_in_init = transfer, None, True
        # adapters are named <prefix>-v<version>: this run's own names (a server outlives runs), which an async
        # worker's engine, given the same prefix, asks for by the version it reads
        self.adapter_prefix = _shared_with_ranks(f"grpokit-{os.getpid()}-{int(time.time())}")

    def sync_weights(self, model) -> None:
        self.push(model, self._lora_version + 1)

    def push(self, model, version: int) -> None:
        """Push the trainer's weights to the server: with LoRA the adapter alone, named for `version`, else every
        tensor. Under torchrun (data parallel: every rank holds the whole model) rank 0 pushes while the others
        wait for it, then ask for the same adapter name; a failure on rank 0 reaches every rank."""
        adapter, failed = adapter_of(model), None
        if rank() == 0:
            try:
                self._sync_adapter(adapter, version) if adapter is not None else self._push_all(model)
            except RolloutWorkerError as e:
                failed = e
        if any_rank(failed is not None):  # the others wait here for rank 0's push
            raise failed or RolloutWorkerError("rollout.vllm.server: rank 0 could not push the weights to the "
                                               "vLLM server (its error says why)")
        if adapter is not None and rank() != 0:
            self._lora_version = version
            self.use_adapter(version)

    def _push_all(self, model) -> None:
        if self._group is None:
            self._open()
            ours = str(next(model.parameters()).dtype).removeprefix("torch.")
            if self.client.dtype not in (None, ours):  # as TRL: said once, the correction covers the gap
                print(f"note: the vLLM server at {self.client.url} holds {self.client.dtype} weights, the trainer "
                      f"{ours}: the sampler's log-probs will differ more (algorithm.is_correction corrects for "
                      f"it); `grpokit serve --dtype {ours}` or model.dtype = \"{self.client.dtype}\" aligns "
                      "them", file=sys.stderr, flush=True)
        manifest = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in sync_tensors(model)]
        info = {"names": [m[0] for m in manifest], "dtype_names": [m[1] for m in manifest],
                "shapes": [m[2] for m in manifest]}
        if not self._packed_in_init:  # vLLM < 0.28 reads `packed` from each update
            info["packed"] = True
        self.client.call("POST", "/pause", params={"mode": "keep"})
        self.client.call("POST", "/start_weight_update", json={"is_checkpoint_format": True})
        stream = named_weights_for_sync(model)  # FSDP: each tensor gathered as it is sent
        try:
            self._while_sending(lambda: self._transfer.send(iterator=stream, group=self._group, src=0,
                                                            post_iter_func=lambda item: item[1]),
                                lambda: self.client.call("POST", "/update_weights", json={"update_info": info}))
        except RolloutWorkerError as e:  # the transfer's own error is the one to say; the clean-up is brief
            for path in ("/finish_weight_update", "/resume"):
                with contextlib.suppress(RolloutWorkerError):
                    self.client.call("POST", path, timeout_s=10)
            raise RolloutWorkerError(f"{e}. The server may hold half-received weights: restart it before "
                                     "resuming (a resumed run pushes every weight again)") from None
        self.client.call("POST", "/finish_weight_update")
        self.client.call("POST", "/resume")

    def _open(self) -> None:
        t = self._transfer = self._transfer or _vllm_transfer()
        self._packed_in_init = getattr(t, "packed_in_init", True)
        reply = self.client.call("GET", "/get_world_size")
        try:
            size = 1 + int(reply["world_size"])
        except (KeyError, TypeError, ValueError):
            raise self.client.not_vllm("/get_world_size", reply) from None
        info = {"master_address": t.get_ip(), "master_port": t.get_open_port(), "rank_offset": 1,
                "world_size": size}
        if self._packed_in_init:
            info["packed"] = True
        self._while_sending(lambda: setattr(self, "_group", t.trainer_init(info)),
                            lambda: self.client.call("POST", "/init_weight_transfer_engine",
                                                     json={"init_info": info}))

    def _while_sending(self, send, drive) -> None:
        """Run `send` (a collective without a timeout) on a thread while `drive` (the HTTP call that makes the
        server take part, with one) runs here: a server that fails answers the call, never hangs the trainer."""
        failed: list[BaseException] = []
        thread = threading.Thread(target=lambda: _noting(send, failed), daemon=True, name="vllm-weight-transfer")
        thread.start()
        drive()
        thread.join(self.client.timeout_s)  # the server said it received: the sending side ends soon after
        if thread.is_alive():
            raise RolloutWorkerError(f"rollout.vllm.server: the vLLM server at {self.client.url} answered, but the "
                                     f"weight transfer did not end within rollout.vllm.server_timeout_s = "
                                     f"{self.client.timeout_s:g} s; {FIX}")
        if failed:
            raise RolloutWorkerError(f"rollout.vllm.server: the weight transfer to the vLLM server failed "
                                     f"({type(failed[0]).__name__}: {failed[0]})") from failed[0]

    def use_adapter(self, version: int) -> None:
        """Sample with the adapter pushed as `version` (an async worker: the trainer's engine pushed it)."""
        name = f"{self.adapter_prefix}-v{version}"
        self.lora_request = SimpleNamespace(lora_name=name, lora_int_id=version, lora_path="")

    def _sync_adapter(self, adapter, version: int) -> None:
        """Save the adapter where the server reads it and load it under its version's name; the old one goes."""
        if self._lora_dir is None:  # the server reads it: local to the trainer (TMPDIR may be a shared folder)
            self._lora_dir = tempfile.mkdtemp(prefix="grpokit-lora-server-")
            weakref.finalize(self, shutil.rmtree, self._lora_dir, True)
        previous = self.lora_request
        self._lora_version = version
        name, folder = f"{self.adapter_prefix}-v{version}", Path(self._lora_dir) / f"v{version}"
        if previous is not None and previous.lora_name == name:  # already there (the start's push, again)
            return
        adapter.save_pretrained(str(folder))
        self.client.call("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder),
                                                                "load_inplace": False})
        self.lora_request = SimpleNamespace(lora_name=name, lora_int_id=version, lora_path=str(folder))
        if previous is not None:
            with contextlib.suppress(RolloutWorkerError):
                self.client.call("POST", "/v1/unload_lora_adapter", json={"lora_name": previous.lora_name})
            shutil.rmtree(previous.lora_path, ignore_errors=True)


def _shared_with_ranks(value: str) -> str:
    """Rank 0's `value` on every rank (torchrun: all ranks ask for the adapters rank 0 loads)."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return value
    box = [value]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def _noting(fn, failed: list) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - said by the caller's thread
        failed.append(e)
