"""`vllm serve MODEL ...` and `python -m vllm.entrypoints.openai.api_server --model MODEL ...` on the CPU stand-in:
the HTTP endpoints grpokit's server engine calls, around the stand-in `vllm.LLM` (tests/fake_vllm/vllm/__init__.py).

Not vLLM's server: `/v1/completions` samples with grpokit's own sampler; the weight-transfer endpoints receive
tensors over a gloo group (vLLM: NCCL) in the manifest's order and load them into the model. It also keeps what a
test checks: the command line, the environment flags, and whether weights ever changed while a completion was
being sampled (`GET /stand_in_stats`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import torch


class State:
    def __init__(self, args):
        from vllm import LLM, LoRARequest

        self.args, self.LoRARequest = args, LoRARequest
        self.llm = LLM(args.model, dtype="float32" if args.dtype in ("auto", None) else args.dtype)
        self.lock = threading.Lock()  # one request sampled at a time (the model is not thread-safe)
        self.in_flight = 0
        self.updating = False
        self.group = None
        self.loras: dict[str, object] = {}
        self.loaded = 0
        self.stats = {"pid": os.getpid(), "updates": 0, "updates_during_sampling": 0, "completions": 0, "argv": sys.argv,
                      "dev_mode": os.environ.get("VLLM_SERVER_DEV_MODE"),
                      "lora_updating": os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING"), "paused": 0}

    def complete(self, body: dict) -> dict:
        from vllm import SamplingParams

        lora = self.loras.get(body["model"]) if body["model"] != self.args.served_name else None
        if body["model"] != self.args.served_name and lora is None:
            raise KeyError(f"model {body['model']} not found")
        params = SamplingParams(n=body["n"], temperature=body["temperature"], top_p=body["top_p"],
                                top_k=max(0, body["top_k"]), max_tokens=body["max_tokens"], seed=body["seed"],
                                stop_token_ids=body["stop_token_ids"], logprobs=0)
        with self.lock:
            self.in_flight += 1
            try:
                out = self.llm.generate([{"prompt_token_ids": body["prompt"]}], params, lora_request=lora)[0]
            finally:
                self.in_flight -= 1
        self.stats["completions"] += 1
        return {"choices": [{"index": i, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                             "logprobs": {"token_logprobs": [next(iter(d.values())).logprob for d in o.logprobs]}}
                            for i, o in enumerate(out.outputs)]}

    def update(self, info: dict) -> None:
        from vllm.distributed.weight_transfer.gloo_group import broadcast

        if self.in_flight:
            self.stats["updates_during_sampling"] += 1
        received = []
        for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"]):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            broadcast(self.group, t, 0)
            received.append((name, t))
        params = dict(self.llm.hf.named_parameters())
        with torch.no_grad():
            for name, t in received:
                if name in params:
                    params[name].copy_(t)
        self.stats["updates"] += 1

    def reload(self, body: dict) -> None:
        """`POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": FOLDER}}` (VLLM_SERVER_DEV_MODE
        only, as vLLM's): the weights of the folder's safetensors files, the CPU build's transfer (no NCCL)."""
        from pathlib import Path

        from safetensors.torch import load_file

        if not os.environ.get("VLLM_SERVER_DEV_MODE"):
            raise LookupError("not found")
        if body.get("method") != "reload_weights":
            raise NotImplementedError(f"the stand-in runs only reload_weights, not {body.get('method')}")
        if self.in_flight:
            self.stats["updates_during_sampling"] += 1
        params = dict(self.llm.hf.named_parameters())
        with torch.no_grad():
            for file in sorted(Path(body["kwargs"]["weights_path"]).glob("*.safetensors")):
                for name, t in load_file(str(file)).items():
                    if name in params:
                        params[name].copy_(t.to(params[name].dtype))
        self.stats["updates"] += 1
        self.stats["reloads"] = self.stats.get("reloads", 0) + 1


def handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, code: int, body: dict | str | None = None):
            text = isinstance(body, str)  # vLLM answers its LoRA calls in plain text
            data = body.encode() if text else json.dumps(body or {}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            path = urlparse(self.path).path
            if path == "/health":
                return self._reply(200)
            if path == "/v1/models":
                return self._reply(200, {"data": [{"id": state.args.served_name, "max_model_len": 4096}]})
            if path == "/server_info":
                return self._reply(200, {"vllm_config": {"model_config": {
                    "dtype": "torch.float32", "logprobs_mode": state.args.logprobs_mode},
                    "weight_transfer_config": {"backend": "gloo"}}})  # the stand-in's, in place of NCCL
            if path == "/get_world_size":
                return self._reply(200, {"world_size": 1})
            if path == "/stand_in_stats":
                return self._reply(200, {**state.stats, "loras_loaded": len(state.loras)})
            return self._reply(404, {"error": "not found"})

        def do_POST(self):
            url = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            hang = state.stats.get("hang")  # armed by POST /stand_in_hang: that call never answers
            if hang and url.path == hang["path"]:
                hang["after"] -= 1
                if hang["after"] < 0:
                    state.stats["hung"] = state.stats.get("hung", 0) + 1
                    threading.Event().wait()
            try:
                if url.path == "/stand_in_hang":
                    state.stats["hang"] = body
                    return self._reply(200)
                if url.path == "/stand_in_skip_receive":
                    state.stats["skip_receive"] = True
                    return self._reply(200)
                if url.path == "/v1/completions":
                    return self._reply(200, state.complete(body))
                if url.path == "/pause":
                    state.stats["paused"] += 1
                    state.stats["pause_mode"] = parse_qs(url.query).get("mode", ["abort"])[0]
                elif url.path == "/init_weight_transfer_engine":
                    from vllm.distributed.weight_transfer.gloo_group import open_group

                    info = body["init_info"]
                    state.group = open_group(info, info["rank_offset"])
                elif url.path == "/update_weights" and state.stats.get("skip_receive"):
                    pass  # armed by POST /stand_in_skip_receive: says it received, never joins the transfer
                elif url.path == "/update_weights":
                    state.update(body["update_info"])
                elif url.path == "/v1/load_lora_adapter":
                    if not os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
                        return self._reply(404, {"error": "not found"})
                    state.loaded += 1  # vLLM's own id for each adapter ever loaded
                    state.loras[body["lora_name"]] = state.LoRARequest(body["lora_name"], state.loaded,
                                                                       body["lora_path"])
                    return self._reply(200, f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
                elif url.path == "/v1/unload_lora_adapter":
                    state.loras.pop(body["lora_name"], None)
                    return self._reply(200, f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")
                elif url.path == "/collective_rpc":
                    try:
                        state.reload(body)
                    except LookupError:
                        return self._reply(404, {"error": "not found"})
                elif url.path not in ("/resume", "/start_weight_update", "/finish_weight_update",
                                      "/reset_prefix_cache"):
                    return self._reply(404, {"error": "not found"})
                return self._reply(200)
            except Exception as e:  # noqa: BLE001 - the server's answer says it
                return self._reply(500, {"error": f"{type(e).__name__}: {e}"})

    return Handler


def main() -> None:
    """Both of vLLM's ways to start its server: `vllm serve MODEL ...` (this module) and
    `python -m vllm.entrypoints.openai.api_server --model MODEL ...` (the stand-in's api_server calls this)."""
    argv = sys.argv[1:]
    parser = argparse.ArgumentParser(prog="vllm serve" if argv[:1] == ["serve"] else "api_server")
    if argv[:1] == ["serve"]:
        parser.add_argument("model")
        argv = argv[1:]
    else:  # no positional: an unknown flag's value (`--seed 1`) would be taken for it
        parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--logprobs-mode", default="raw_logprobs")
    parser.add_argument("--served-model-name", dest="served_name", default=None)
    args, _ = parser.parse_known_args(argv)
    args.served_name = args.served_name or args.model
    torch.set_num_threads(1)
    state = State(args)
    server = ThreadingHTTPServer((args.host, args.port), handler(state))
    print(f"stand-in vLLM server on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
