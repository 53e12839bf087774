"""The pieces of the vLLM server's safeguards that run without vLLM: the lease middleware `grpokit serve` adds to
vLLM's server (driven here as the ASGI app it is), and the reading of vLLM's view of the model it serves (a view
recorded from vLLM 0.32's CPU build). The real server's behaviour is tests/real_vllm/test_server_faults_real.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from grpokit.rollout.vllm import lease as lease_module
from grpokit.rollout.vllm.checks import model_shape, served_shape, shape_mismatch
from grpokit.rollout.vllm.lease import LEASE_PATH, RUN_HEADER, RunLease

QWEN2_VIEW = """Qwen2ForCausalLM()(
  (model): Qwen2Model()(
    (embed_tokens): VocabParallelEmbedding(num_embeddings=99, num_embeddings_per_partition=128, embedding_dim=64, org_vocab_size=99, num_embeddings_padded=128, tp_size=1)
    (layers): ModuleList()(
      (0-1): 2 x Qwen2DecoderLayer()(
        (self_attn): Qwen2Attention()(
          (qkv_proj): MergedQKVParallelLinearWithLoRA()(
            (base_layer): QKVParallelLinear(in_features=64, output_features=128, bias=True, tp_size=1, gather_output=False)
          )
          (attn): Attention(head_size=32, num_heads=2, num_kv_heads=1, scale=0.1767766952966369, backend=CPUAttentionBackendImpl)
        )
      )
    )
    (norm): RMSNorm(hidden_size=64, eps=1e-06)
  )
  (lm_head): ParallelLMHead(num_embeddings=99, num_embeddings_per_partition=128, embedding_dim=64, org_vocab_size=99, num_embeddings_padded=128, tp_size=1)
)"""  # noqa: E501 - vLLM's own lines


def test_the_served_models_sizes_are_read_from_vllms_view_and_compared_by_size(tiny_model_dir):
    assert served_shape(QWEN2_VIEW) == {"architecture": "Qwen2ForCausalLM", "vocab": 99, "hidden": 64,
                                        "head_size": 32, "layers": 2}
    mixed = QWEN2_VIEW.replace("(0-1): 2 x Qwen2DecoderLayer", "(0): Qwen2DecoderLayer()(\n      )\n"
                               "      (1-4): 4 x Qwen2DecoderLayer")
    assert served_shape(mixed)["layers"] == 5
    ours = model_shape(tiny_model_dir)
    assert set(ours) >= {"vocab", "hidden", "layers"}
    assert shape_mismatch(dict(ours), ours) is None
    differ = shape_mismatch({**ours, "hidden": ours["hidden"] * 2, "architecture": "LlamaForCausalLM"}, ours)
    assert differ == f"hidden size {ours['hidden'] * 2} where model.path has {ours['hidden']}"


def _call(app, method: str, path: str, body: dict | None = None, run: str | None = None) -> tuple[int, dict]:
    """One HTTP request through the ASGI `app`: its status and JSON reply."""
    sent, payload = [], json.dumps(body).encode() if body is not None else b""
    headers = [(RUN_HEADER.lower().encode(), run.encode())] if run else []

    async def receive():
        return {"type": "http.request", "body": payload, "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": method, "path": path, "headers": headers}, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body") or b"{}")


async def _vllm(scope, receive, send):  # what vLLM's app answers behind the middleware
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{\"served\": true}"})


def test_the_lease_serves_one_run_and_frees_itself_when_its_run_stops_renewing(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(lease_module.time, "monotonic", lambda: now[0])
    app = RunLease(_vllm)
    assert _call(app, "GET", LEASE_PATH)[1]["holder"] is None
    assert _call(app, "POST", LEASE_PATH, {"run": "x", "pid": 1, "ttl_s": 60})[0] == 200
    status, reply = _call(app, "POST", LEASE_PATH, {"run": "y", "pid": 2})
    assert status == 409 and reply["holder"]["run"] == "x"
    assert _call(app, "POST", "/v1/completions", {}, run="y")[0] == 409  # another run's call
    assert _call(app, "POST", "/v1/completions", {}, run="x") == (200, {"served": True})  # the holder's, renewing
    assert _call(app, "POST", "/v1/completions", {})[0] == 200  # a client that names no run
    now[0] += 50
    assert _call(app, "POST", "/collective_rpc", {}, run="x")[0] == 200  # renewed 50 s ago: live for 60 more
    now[0] += 59
    assert _call(app, "POST", LEASE_PATH, {"run": "y"})[0] == 409
    assert _call(app, "POST", LEASE_PATH, {"run": "y", "take_over": "x"})[0] == 200  # x's process is gone
    assert _call(app, "POST", "/v1/completions", {}, run="x")[0] == 409  # x, back: refused, not served y's weights
    assert _call(app, "DELETE", LEASE_PATH, {"run": "x"})[1]["holder"]["run"] == "y"  # only the holder releases
    assert _call(app, "DELETE", LEASE_PATH, {"run": "y"})[1]["holder"] is None
    now[0] += 1
    assert _call(app, "POST", LEASE_PATH, {"run": "x", "ttl_s": 10})[0] == 200
    now[0] += 11  # lapsed: free for anyone
    assert _call(app, "POST", LEASE_PATH, {"run": "z"})[0] == 200
    assert _call(app, "POST", LEASE_PATH, {"bad": 1})[0] == 400


def test_a_holder_whose_process_is_gone_on_this_machine_is_taken_over():
    import socket

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here = socket.gethostname()
    assert lease_module._process_gone({"host": here, "pid": gone.pid})
    assert lease_module._process_gone({"host": here, "pid": os.getpid()})  # an earlier run in this process
    assert not lease_module._process_gone({"host": here, "pid": os.getppid()})  # alive
    assert not lease_module._process_gone({"host": "elsewhere", "pid": gone.pid})  # cannot be known from here


@pytest.mark.parametrize("holder", [{"run": "r1", "pid": 7, "host": "h", "command": "grpokit train x.toml",
                                     "since": 0}])
def test_a_holder_is_described_with_its_process_and_command(holder):
    said = lease_module.describe(holder)
    assert "run r1, process 7 on h (grpokit train x.toml)" in said
