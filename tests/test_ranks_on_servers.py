"""Several trainer processes on a vLLM server (rollout/vllm/ranks.py), against the CPU stand-in (tests/fake_vllm, as
tests/test_vllm_server.py): 2 torchrun ranks through the CLI (`grpokit train --nproc-per-node 2`), in async mode
(each rank's worker samples through the server; rank 0 pushes while every rank holds its worker's lock, which the
stand-in's count of pushes during sampling shows) and with FSDP (every rank takes part in each gather, rank 0
writes or sends). The real server's side is tests/real_vllm/test_ranks_on_server_real.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import test_vllm_server
from grpokit.observe.tracking import read_metrics
from test_vllm_server import FAKE, get

server = test_vllm_server.server  # `grpokit serve` of the tiny model on the stand-in (a fixture)
stand_in = test_vllm_server.stand_in

TOML = """
[model]
path = {model!r}
dtype = "float32"
device = "cpu"
[data]
task = "addition"
num_prompts = 64
[rollout]
group_size = 4
max_new_tokens = 5
engine = "vllm"
vllm = {{server = {url!r}, server_timeout_s = {timeout}, weight_transfer = {transfer!r}}}
worker_timeout_s = 60
[algorithm]
is_correction = "token_truncate"
[train]
steps = {steps}
prompts_per_step = 4
learning_rate = 1e-2
num_threads = 1
[rewards]
functions = ["{tests}/conftest.py:parity"]
[output]
dir = {out!r}
console = false
"""


def two_ranks(tmp_path: Path, model, url: str, name: str, *settings: str, steps: int = 3, transfer: str = "folder",
              timeout: int = 30) -> subprocess.CompletedProcess:
    """`grpokit train run.toml --nproc-per-node 2 --set ...` on the stand-in, in a folder of its own."""
    toml = tmp_path / f"{name}.toml"
    toml.write_text(TOML.format(model=str(model), url=url, transfer=transfer, steps=steps, out=str(tmp_path / name),
                                timeout=timeout, tests=str(Path(__file__).parent)))
    sets = [a for s in settings for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(FAKE), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml), "--nproc-per-node", "2", *sets],
                          env=env, capture_output=True, text=True, timeout=400)


def served_weights_are(url: str, checkpoint: Path, model_dir: Path) -> None:
    """The server's log-probs of a fixed answer are the checkpoint's (not the start's): it holds the trained
    weights. The stand-in's completions carry the log-probs of what it sampled, scored here by the checkpoint."""
    from grpokit.models.loading import load_model

    reply = _post(url, "/v1/completions", {"model": str(model_dir), "prompt": [1, 5, 6, 7], "n": 1, "max_tokens": 6,
                                           "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": 3,
                                           "stop_token_ids": []})
    choice = reply["choices"][0]
    ids, served = choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)

    def scored(folder):
        model = load_model(str(folder), device="cpu")
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([[1, 5, 6, 7] + ids])).logits[0, 3:-1].double()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]

    assert float((served - scored(checkpoint)).abs().max()) < 1e-4
    assert float((served - scored(model_dir)).abs().max()) > 1e-3  # control: not the weights it started on


def _post(url: str, path: str, body: dict) -> dict:
    import json
    import urllib.request

    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read() or b"{}")


def errors_of(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]


def test_async_on_a_server_with_two_ranks_never_pushes_into_a_batch(tiny_model_dir, tmp_path, server):
    """Each rank's worker samples its own batches through the server while the trainers update (max_staleness 1):
    rank 0 pushes only while both workers are between batches (no push during sampling), every rank's worker learns
    each version (no lag past the bound, step 1 on the start's weights), and the batches sampled on the trainer's
    weights match them (the sampler's log-probs)."""
    done = two_ranks(tmp_path, tiny_model_dir, server, "run", "rollout.mode=async", "rollout.max_staleness=1",
                     "rollout.max_new_tokens=48", steps=4, transfer="nccl")  # long batches: the pushes meet them
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["async/staleness_max"] <= 1 for r in rows) and rows[0]["async/staleness_max"] == 0
    fresh = [r for r in rows if r["async/staleness_max"] == 0]  # the mean over ranks: 0 on both
    assert fresh and max(r["sampling/logprob_gap_max"] for r in fresh) < 1e-4  # the max over ranks
    stats = get(f"{server}/stand_in_stats")
    assert stats["updates"] == 4 and stats["updates_during_sampling"] == 0, stats  # the start's, after steps 1-3
    assert stats["completions"] == 4 * 4 + 1  # 2 prompts a rank a step (n = G), and the start's probe


@pytest.mark.parametrize("mode, transfer", [("sync", "folder"), ("async", "nccl")])
def test_fsdp_on_a_server_gathers_on_every_rank_and_the_server_holds_the_trained_weights(tiny_model_dir, tmp_path,
                                                                                         server, mode, transfer):
    """model.fsdp: the parameters are shards, so both ranks gather each tensor and rank 0 writes it (the folder) or
    sends it (the NCCL push's protocol, gloo in the stand-in, on its own thread); the run ends and the server holds
    the last checkpoint's weights."""
    done = two_ranks(tmp_path, tiny_model_dir, server, "run", "model.fsdp=true", f"rollout.mode={mode}",
                     "rollout.max_staleness=0", "output.save_every=1", transfer=transfer)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 3 and max(r["sampling/logprob_gap_max"] for r in rows) < 1e-4
    last = 3 if mode == "sync" else 2  # async pushes nothing after the last step: no batch is sampled after it
    assert get(f"{server}/stand_in_stats")["updates"] == last + 1  # and the start's push
    trained, initial = load_file(tmp_path / "run" / "checkpoint-3" / "model.safetensors"), \
        load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(trained[n], initial[n]) for n in trained if n in initial)
    served_weights_are(server, tmp_path / "run" / f"checkpoint-{last}", tiny_model_dir)


@pytest.mark.parametrize("fsdp", [False, True])
def test_a_push_that_fails_on_rank_0_ends_both_ranks_with_its_error_and_the_steps_kept(tiny_model_dir, tmp_path,
                                                                                       server, fsdp):
    """The push of step 1's weights never ends (its last call, the prefix-cache reset, armed on the stand-in to
    hang after the start's push): rank 0's push
    fails after rollout.vllm.server_timeout_s; both ranks end with that error, one line each, step 1's checkpoint
    kept (under torchrun the loop does not save at an error: each step is saved as it ends, output.save_every)."""
    _post(server, "/stand_in_hang", {"path": "/reset_prefix_cache", "after": 1})
    done = two_ranks(tmp_path, tiny_model_dir, server, "run", f"model.fsdp={str(fsdp).lower()}",
                     "output.save_every=1", timeout=4)
    said = errors_of(done)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stdout[-2000:] + done.stderr[-3000:]
    assert len(said) == 2 and said[0] == said[1], said
    assert said[0].startswith(f"error: rollout.vllm.server: the vLLM server at {server} did not answer "
                              "/reset_prefix_cache within rollout.vllm.server_timeout_s = 4 s"), said
    assert "the newest checkpoint stays. Continue with:" in said[0], said  # torchrun: each step saved as it ends
    assert (tmp_path / "run" / "checkpoint-1" / "model.safetensors").is_file()
    assert not (tmp_path / "run" / "checkpoint-2").exists()
