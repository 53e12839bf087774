"""grpokit's vLLM paths against the real engine (vLLM's CPU build; run in .venv-vllm, tests/real_vllm/conftest.py).

Every number here comes from vLLM itself: its sampler's processed log-probs against the trainer's recompute on the
same weights (float32 on both sides: the gap is kernel noise, ~1e-6), its LoRA endpoints' replies, its
`reload_weights`. What the real server cannot be made to show stays in tests/test_vllm_server.py's stand-in: the
NCCL transfer's protocol (no NCCL on CPU), a push the server claims but never receives, requests that hang while the
server stays up, and the server-side counters (pushes during sampling)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import comparable, make_config, parity
from grpokit.errors import RolloutWorkerError, UserError
from grpokit.observe.tracking import read_metrics
from grpokit.training.loop import train
from real_vllm.conftest import vllm_call

GAP = 1e-3  # float32 sampler vs float32 trainer, same weights (measured: ~1e-6)
TESTS = Path(__file__).parent.parent


def server_config(model_dir, out, url, *, steps=3, rollout=None, timeout_s=60, vllm=None, **kw):
    return make_config(model_dir, out, steps=steps, learning_rate=1e-2,
                       rollout={"engine": "vllm", "vllm": {"server": url, "server_timeout_s": timeout_s,
                                                           **(vllm or {})}, **(rollout or {})},
                       train={"num_threads": 1, **kw.pop("train", {})},
                       algorithm={"is_correction": "token_truncate"}, **kw)  # logs the sampler-trainer gap


def served_logprobs(url: str, model: str, prompt: list[int], tokens: list[int]) -> list[float]:
    """The server's log-probs of `tokens` after `prompt` (its prompt log-probs of the joined sequence)."""
    reply = vllm_call(url, "POST", "/v1/completions", {"model": model, "prompt": prompt + tokens, "max_tokens": 1,
                                                       "prompt_logprobs": 0, "temperature": 1.0})
    per_position = reply["choices"][0]["prompt_logprobs"][len(prompt):]
    return [entry[str(t)]["logprob"] for entry, t in zip(per_position, tokens)]


def adapters(url: str, base: str) -> list[str]:
    return [m["id"] for m in vllm_call(url, "GET", "/v1/models")["data"] if m["id"] != base]


@pytest.mark.vllm_smoke
def test_the_servers_samples_and_log_probs_are_the_trainers(vllm_model_dir, fresh_server):
    """Token ids in, token ids out (n = G, a seed each); vLLM's processed log-probs of its own samples are the
    trainer's recompute on the same weights, and the same seed samples the same answers."""
    from grpokit.config.options import VLLMOptions
    from grpokit.models.forward import completion_logprobs
    from grpokit.models.loading import load_model_and_tokenizer
    from grpokit.rollout.request import RolloutRequest, SamplingParams
    from grpokit.rollout.vllm import VLLMEngine
    from grpokit.rollout.vllm.server import ServerLLM

    model, tok = load_model_and_tokenizer(vllm_model_dir, device="cpu", dtype="float32")
    engine = VLLMEngine(ServerLLM.connect(VLLMOptions(server=fresh_server, server_timeout_s=60)))
    prompts = [tok("12+34=", add_special_tokens=False)["input_ids"], tok("7+8=", add_special_tokens=False)["input_ids"]]
    s = SamplingParams(max_new_tokens=12, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    r = engine.generate(RolloutRequest(prompts, 4, s, torch.Generator().manual_seed(0))).rollout
    assert r.completion_ids.shape[0] == 8 and int(r.completion_mask.sum()) > 8
    with torch.no_grad():
        ours, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    gap = (ours - r.logprobs).abs()[r.completion_mask.bool()]
    assert float(gap.max()) < GAP, float(gap.max())
    again = engine.generate(RolloutRequest(prompts, 4, s, torch.Generator().manual_seed(0))).rollout
    assert torch.equal(again.completion_ids, r.completion_ids)


@pytest.mark.vllm_smoke
def test_sync_training_moves_full_weights_through_a_folder(vllm_model_dir, fresh_server, tmp_path, capsys):
    """No NCCL on CPU: "auto" writes the weights to a folder the server reloads, and says so once. After every
    update the server's log-probs of what it sampled are the trainer's; afterwards it holds the trained weights
    (not the base); the folder holds only the last push while it runs, and nothing after it."""
    import gc

    folder, held = tmp_path / "weights", []

    def watching(completions, **kwargs):  # what the folder holds while a batch is graded
        held.append(sorted(p.name for d in folder.iterdir() for p in d.iterdir()))
        return parity(completions)

    run = train(server_config(vllm_model_dir, tmp_path / "run", fresh_server, vllm={"weight_folder": str(folder)}),
                reward_functions=[watching])
    gc.collect()
    assert held == [["push-0"], ["push-1"], ["push-2"]] and list(folder.iterdir()) == []
    rows = read_metrics(run)
    assert len(rows) == 3 and max(r["sampling/logprob_gap_max"] for r in rows) < GAP
    assert "through a folder" in capsys.readouterr().err
    from grpokit.models.loading import load_model_and_tokenizer

    trained, _ = load_model_and_tokenizer(run / "checkpoint-3", device="cpu", dtype="float32")
    base, _ = load_model_and_tokenizer(vllm_model_dir, device="cpu", dtype="float32")
    prompt, tokens = [1, 5, 6, 7], [8, 9, 10, 11]
    served = torch.tensor(served_logprobs(fresh_server, str(vllm_model_dir), prompt, tokens))

    def ours(m):
        with torch.no_grad():
            lp = torch.log_softmax(m(input_ids=torch.tensor([prompt + tokens])).logits[0].float(), -1)
        return torch.stack([lp[len(prompt) - 1 + k, t] for k, t in enumerate(tokens)])

    assert float((served - ours(trained)).abs().max()) < GAP  # the server holds the trained weights
    assert float((served - ours(base)).abs().max()) > 10 * GAP  # control: which are not the base's


@pytest.mark.vllm_smoke
def test_lora_through_the_server_loads_switches_and_unloads_adapters(vllm_model_dir, fresh_server, tmp_path):
    """The adapter alone travels, loaded under a new name per version (vLLM answers in plain text), the previous
    one unloaded: while the run goes the server holds the base and one adapter, and samples with it (the gap stays
    small while the adapter trains: it is the trainer's); when it ends, the server outlives it and holds the base
    alone (the run's adapter folders are gone: a name left registered could not be reloaded)."""
    held = []

    def watching(completions, **kwargs):  # the server's adapters while a batch is graded
        held.append(adapters(fresh_server, str(vllm_model_dir)))
        return parity(completions)

    run = train(server_config(vllm_model_dir, tmp_path / "run", fresh_server, model={"lora": {"r": 4}}),
                reward_functions=[watching])
    rows = read_metrics(run)
    assert len(rows) == 3 and max(r["sampling/logprob_gap_max"] for r in rows) < GAP
    # named by the trainer's step, the version everywhere: step 1's batch samples the start's adapter (v0)
    assert [[name.rsplit("-", 1)[1] for name in step] for step in held] == [["v0"], ["v1"], ["v2"]], held
    assert adapters(fresh_server, str(vllm_model_dir)) == []  # v3, pushed after the last step, unloaded at the end


def test_async_through_the_server_with_max_staleness_0_is_the_sync_run(vllm_model_dir, fresh_server, tmp_path):
    sync = train(server_config(vllm_model_dir, tmp_path / "sync", fresh_server), reward_functions=[parity])
    run = train(server_config(vllm_model_dir, tmp_path / "async", fresh_server,
                              rollout={"mode": "async", "max_staleness": 0}), reward_functions=[parity])
    a, b = comparable(read_metrics(sync)), comparable(read_metrics(run))
    for x, y in zip(a, b, strict=True):
        assert y["async/staleness_max"] == 0
        for key in x:
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-5), key


def test_async_lora_with_lag_samples_each_batch_with_one_version(vllm_model_dir, fresh_server, tmp_path):
    run = train(server_config(vllm_model_dir, tmp_path / "run", fresh_server, steps=4, model={"lora": {"r": 4}},
                              rollout={"mode": "async", "max_staleness": 1}), reward_functions=[parity])
    rows = read_metrics(run)
    assert len(rows) == 4 and all(r["async/staleness_max"] <= 1 for r in rows)
    fresh = [r for r in rows if r["async/staleness_max"] == 0]
    assert fresh and max(r["sampling/logprob_gap_max"] for r in fresh) < GAP  # where not stale: the trainer's


RUN_TOML = """
[model]
path = {model!r}
dtype = "float32"
{lora}
[data]
task = "addition"
num_prompts = 64
[rollout]
group_size = 4
max_new_tokens = 6
engine = "vllm"
vllm = {vllm}
[algorithm]
is_correction = "token_truncate"
[train]
steps = {steps}
prompts_per_step = 4
learning_rate = 1e-2
[rewards]
functions = ["{tests}/conftest.py:parity"]
[output]
dir = {out!r}
console = false
"""
COLOCATED = '{dtype = "float32", max_model_len = 128, enforce_eager = true, kv_cache_gib = 1}'


def run_toml(path, model, out, *, vllm: str = COLOCATED, lora: bool = False, steps: int = 3) -> Path:
    """A run's TOML file (the addition task, 4 prompts of 4 answers a step), as a user writes one."""
    path.write_text(RUN_TOML.format(model=str(model), out=str(out), tests=str(TESTS), vllm=vllm, steps=steps,
                                    lora="lora = {r = 4}" if lora else ""))
    return path


@pytest.mark.vllm_smoke
@pytest.mark.parametrize("arch, lora", [("qwen2", False), ("qwen2", True), ("gemma", False)])
def test_the_colocated_engine_trains_on_cpu(vllm_model_dir, tmp_path, arch, lora):
    """`rollout.engine = "vllm"` without a server: vLLM in the trainer's process (its CPU build), the weights
    reloaded in process after each update (LoRA: the adapter as a new request); through the CLI, as a user runs
    it. It crashed at the first sync before (vLLM's CPU layers repack their weights: load_weights broke them);
    Gemma's non-persistent `embed_scale` buffer was sent, and vLLM's loader refused it."""
    model = vllm_model_dir
    if arch != "qwen2":
        from grpokit.models.tiny import build_tiny_model

        model = tmp_path / arch
        build_tiny_model(model, arch=arch, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=0)
    toml = run_toml(tmp_path / "run.toml", model, tmp_path / "run", lora=lora)
    done = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml)], capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 3 and max(r["sampling/logprob_gap_max"] for r in rows) < GAP


BIG_BATCH = """
import sys, torch
from grpokit.config.options import VLLMOptions
from grpokit.rollout.request import RolloutRequest, SamplingParams
from grpokit.rollout.vllm import VLLMEngine
from grpokit.rollout.vllm.colocated import ColocatedLLM
options = VLLMOptions(max_model_len=128, enforce_eager=True, kv_cache_gib=1)
engine = VLLMEngine(ColocatedLLM.start(sys.argv[1], options, dtype="float32", seed=0))
prompts = [[(i * 7 + j) % 90 + 3 for j in range(100)] for i in range(24)]  # 24 x 2 x 100: 4800 prompt tokens
s = SamplingParams(max_new_tokens=2, eos_token_ids=(), pad_token_id=0, ignore_eos=True)
r = engine.generate(RolloutRequest(prompts, 2, s, torch.Generator().manual_seed(0))).rollout
print("sampled", tuple(r.completion_ids.shape))
"""


def test_a_colocated_batch_larger_than_one_scheduler_step_samples(vllm_model_dir):
    """A batch whose prompts hold more tokens than one vLLM step takes (2048) crashed the CPU build: vLLM split a
    seeded prompt across steps and rewound its CPU generator ("CPU Generator does not use offset"). The engine
    now keeps prompts whole on a CPU."""
    done = subprocess.run([sys.executable, "-c", BIG_BATCH, str(vllm_model_dir)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "sampled (48, 2)" in done.stdout, done.stdout[-1000:] + done.stderr[-3000:]


def test_the_colocated_engine_refuses_an_architecture_vllm_runs_through_transformers(tmp_path):
    """GPT-NeoX has no vLLM implementation: vLLM's Transformers backend patches the transformers class in place, and
    the trainer's own model (same process) then failed in its first forward. One error before anything loads."""
    from grpokit.models.tiny import build_tiny_model

    build_tiny_model(tmp_path / "neox", arch="gpt_neox", hidden_size=64, num_layers=1, num_heads=2, seed=0)
    toml = run_toml(tmp_path / "run.toml", tmp_path / "neox", tmp_path / "run")
    done = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml)], capture_output=True, text=True,
                          timeout=200)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert len(errors) == 1 and "GPTNeoXForCausalLM" in errors[0] and "grpokit serve" in errors[0], errors


def test_the_colocated_engine_refuses_a_head_size_the_cpu_backend_lacks(tiny_model_dir, tmp_path):
    """The suite's usual tiny model has heads of 8: vLLM's CPU attention would start, then fail at the first
    request. One error before anything loads."""
    toml = run_toml(tmp_path / "run.toml", tiny_model_dir, tmp_path / "run")
    done = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "heads are of size 8" in errors[0], done.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("lora", [False, True])
def test_torchrun_data_parallel_samples_on_one_server_and_rank_0_pushes(vllm_model_dir, fresh_server, tmp_path,
                                                                        lora):
    """Two trainer processes send their own prompts to one server; rank 0 pushes each update (the other waits
    for it, then asks for the same adapter): the server's log-probs stay the trainer's on both ranks."""
    toml = run_toml(tmp_path / "run.toml", vllm_model_dir, tmp_path / "run", lora=lora, steps=2,
                    vllm=f'{{server = "{fresh_server}", server_timeout_s = 60}}')
    done = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml), "--nproc-per-node", "2"],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2 and max(r["sampling/logprob_gap_max"] for r in rows) < GAP
    assert adapters(fresh_server, str(vllm_model_dir)) == []  # the run's adapters unloaded when it ended


# ---- faults: each one error naming the field and the fix, the finished steps saved ----------------------------


def test_a_server_on_another_model_or_holding_pushed_weights_is_refused_at_the_start(vllm_model_dir, fresh_server,
                                                                                    tmp_path):
    """LoRA trains an adapter on the server's base: a server on another model (here another seed's weights), or
    one still holding weights an earlier full-weight run pushed, would sample from the wrong model silently. The
    probe at the start says so, before any step."""
    from grpokit.models.tiny import build_tiny_model

    other = tmp_path / "other"
    build_tiny_model(other, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=1)
    with pytest.raises(UserError, match="does not serve the adapter's base model"):
        train(server_config(other, tmp_path / "a", fresh_server, model={"lora": {"r": 4}}), reward_functions=[parity])
    assert adapters(fresh_server, str(vllm_model_dir)) == []  # the refused run's adapter is not left on the server
    train(server_config(vllm_model_dir, tmp_path / "full", fresh_server, steps=2), reward_functions=[parity])
    with pytest.raises(UserError, match="holds weights an earlier run pushed"):  # the server keeps the full run's
        train(server_config(vllm_model_dir, tmp_path / "b", fresh_server, model={"lora": {"r": 4}}),
              reward_functions=[parity])


def _stop_at(step: int, action):
    """A reward (parity) that runs `action` once, when step `step`'s batch is graded."""
    calls = []

    def reward(completions, **kwargs):
        calls.append(1)
        if len(calls) == step:
            action()
        return parity(completions)

    return reward


def test_a_server_killed_frozen_or_restarted_mid_run_is_one_error_with_the_steps_saved(vllm_model_dir, tmp_path,
                                                                                      server_factory):
    """Killed: the next call fails at once. Frozen (SIGSTOP): the call times out after server_timeout_s. Restarted
    on the same port: it holds its starting weights, which the run would go on sampling from; its start time
    says so. Each ends the run with one error, the steps before saved and resumable."""
    server = server_factory(vllm_model_dir)
    port = int(server.url.rsplit(":", 1)[1])

    with pytest.raises(RolloutWorkerError, match="did not answer") as killed:
        train(server_config(vllm_model_dir, tmp_path / "killed", server.url, steps=5),
              reward_functions=[_stop_at(2, server.stop)])
    assert "step 2 is saved" in str(killed.value) and (tmp_path / "killed" / "checkpoint-2").is_dir()

    server = server_factory(vllm_model_dir, port)
    frozen = lambda: os.killpg(server.proc.pid, signal.SIGSTOP)  # noqa: E731
    t0 = time.monotonic()
    try:
        with pytest.raises(RolloutWorkerError, match="within rollout.vllm.server_timeout_s = 15"):
            train(server_config(vllm_model_dir, tmp_path / "frozen", server.url, steps=5, timeout_s=15),  # 5 s: the
                      # first answers of a fresh server took longer on a loaded 2-core machine
                  reward_functions=[_stop_at(2, frozen)])
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)
    assert time.monotonic() - t0 < 60 and (tmp_path / "frozen" / "checkpoint-2").is_dir()

    def restart():
        server.stop()
        server_factory(vllm_model_dir, port)

    with pytest.raises(RolloutWorkerError, match="was restarted during the run") as restarted:
        train(server_config(vllm_model_dir, tmp_path / "restarted", server.url, steps=5, timeout_s=120),
              reward_functions=[_stop_at(2, restart)])
    assert "--resume" in str(restarted.value) and (tmp_path / "restarted" / "checkpoint-2").is_dir()


def test_a_server_without_dev_mode_or_lora_is_named_with_the_fix(vllm_model_dir, tmp_path, server_factory):
    server = server_factory(vllm_model_dir, lora_rank=None, extra_env={"VLLM_SERVER_DEV_MODE": "0"})
    with pytest.raises(RolloutWorkerError, match="has no /pause.*grpokit serve"):
        train(server_config(vllm_model_dir, tmp_path / "full", server.url), reward_functions=[parity])
    with pytest.raises(RolloutWorkerError, match="takes no LoRA adapters.*--lora-rank"):
        train(server_config(vllm_model_dir, tmp_path / "lora", server.url, model={"lora": {"r": 4}}),
              reward_functions=[parity])


def test_a_weights_folder_that_fills_its_disk_is_one_error_and_leaves_nothing(vllm_model_dir, fresh_server,
                                                                              tmp_path):
    """rollout.vllm.weight_folder on a disk too small for one push (a 64 KiB tmpfs; the model is ~0.5 MB): one
    error naming the field, the partial push removed."""
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(RolloutWorkerError, match=r"rollout.vllm.weight_folder: writing the weights .* failed "
                                                     r"\(No space left on device\); free space"):
            train(server_config(vllm_model_dir, tmp_path / "run", fresh_server,
                                vllm={"weight_folder": str(disk / "w")}), reward_functions=[parity])
        assert [list(d.iterdir()) for d in (disk / "w").iterdir()] in ([], [[]])  # nothing half-written left
    finally:
        subprocess.run(["umount", str(disk)])
