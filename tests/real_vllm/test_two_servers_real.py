"""Two real vLLM servers (vLLM's CPU build) behind one run: `rollout.vllm.server = [a, b]` (rollout/vllm/servers.py).

The two servers are started once for the module (about a minute each) and reset before each test, as `fresh_server`
resets the session's one; the last test kills one, which the fixture starts again if a test after it needs it.
What the real servers cannot be made to show (the routing request by request, a push that fails on one server
while the other's still runs, LoRA and async mode counted per server) is in tests/test_several_servers.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from conftest import PARITY_SOURCE, parity
from grpokit.errors import RolloutWorkerError, UserError
from grpokit.training.loop import train
from real_vllm.conftest import free_port, start_server, vllm_call
from real_vllm.test_vllm_engine import GAP, _stop_at, run_toml, served_logprobs, server_config

LEASED = ["--middleware", "grpokit.rollout.vllm.lease.RunLease"]  # as `grpokit serve` starts vLLM
PROMPT, TOKENS = [1, 5, 6, 7], [8, 9, 10, 11]


@pytest.fixture(scope="module")
def pair(vllm_model_dir, tmp_path_factory):
    """Two servers on the tiny model, leased as `grpokit serve` starts them, started side by side; a list the tests
    may find a server of dead in (the kill test), started again by `fresh_pair`."""
    logs, servers = tmp_path_factory.mktemp("two-servers-log"), [None, None]

    def start(k: int, port: int | None = None) -> None:
        servers[k] = start_server(vllm_model_dir, port, lora_rank=8, extra_args=LEASED, log_dir=logs)

    threads = [threading.Thread(target=start, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(servers), "a server did not start (its log is in the test's tmp folder)"
    yield servers, start
    for server in servers:
        server.stop()


@pytest.fixture
def fresh_pair(pair, base_weights_dir):
    """Both servers' URLs, each reset as `fresh_server` resets one: adapters unloaded, resumed, base weights, an empty
    prefix cache; a server an earlier test killed is started again."""
    servers, start = pair
    for k, server in enumerate(servers):
        if not server.alive():
            server.stop()
            start(k)
        server = servers[k]
        for model in vllm_call(server.url, "GET", "/v1/models")["data"]:
            if model["id"] != server.model:
                vllm_call(server.url, "POST", "/v1/unload_lora_adapter", {"lora_name": model["id"]})
        vllm_call(server.url, "POST", "/resume")
        vllm_call(server.url, "POST", "/collective_rpc",
                  {"method": "reload_weights", "kwargs": {"weights_path": str(base_weights_dir)}})
        vllm_call(server.url, "POST", "/reset_prefix_cache")
    return [s.url for s in servers]


def finished_requests(url: str) -> float:
    """The requests the server has finished (vLLM's Prometheus counter, over every finish reason)."""
    text = vllm_call(url, "GET", "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def two_servers_toml(path, model, out, urls, **kw):
    listed = "[" + ", ".join(f'"{u}"' for u in urls) + "]"
    return run_toml(path, model, out, vllm=f'{{server = {listed}, server_timeout_s = 60, weight_transfer = "folder"}}',
                    **kw)


def test_a_cli_run_spreads_over_both_servers_and_both_hold_the_trained_weights(vllm_model_dir, fresh_pair,
                                                                                tmp_path):
    """`grpokit train` with two servers and the folder transport: both are sent requests (vLLM's own counters), the
    sampler's log-probs stay the trainer's (so every request, on either server, saw the pushed weights), and both
    hold the trained weights afterwards, not the base."""
    from grpokit.models.loading import load_model_and_tokenizer
    from grpokit.observe.tracking import read_metrics

    before = [finished_requests(u) for u in fresh_pair]
    toml = two_servers_toml(tmp_path / "run.toml", vllm_model_dir, tmp_path / "run", fresh_pair)
    done = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sent = [finished_requests(u) - b for u, b in zip(fresh_pair, before)]
    assert all(n >= 3 for n in sent), sent  # 3 steps x 4 prompts (and a probe each), spread over the two
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 3 and max(r["sampling/logprob_gap_max"] for r in rows) < GAP
    trained, _ = load_model_and_tokenizer(tmp_path / "run" / "checkpoint-3", device="cpu", dtype="float32")
    base, _ = load_model_and_tokenizer(vllm_model_dir, device="cpu", dtype="float32")

    def ours(m):
        with torch.no_grad():
            lp = torch.log_softmax(m(input_ids=torch.tensor([PROMPT + TOKENS])).logits[0].float(), -1)
        return torch.stack([lp[len(PROMPT) - 1 + k, t] for k, t in enumerate(TOKENS)])

    for url in fresh_pair:
        served = torch.tensor(served_logprobs(url, str(vllm_model_dir), PROMPT, TOKENS))
        assert float((served - ours(trained)).abs().max()) < GAP, url  # each holds the trained weights
        assert float((served - ours(base)).abs().max()) > 10 * GAP, url  # control: not the base's


def test_a_list_with_a_duplicate_or_an_unreachable_address_is_refused_naming_it(vllm_model_dir, fresh_pair,
                                                                                 tmp_path):
    a, b = fresh_pair
    toml = two_servers_toml(tmp_path / "dup.toml", vllm_model_dir, tmp_path / "dup", [a, a + "/"])
    done = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml)], capture_output=True, text=True,
                          timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert len(errors) == 1 and f"rollout.vllm.server: lists the server {a}/ twice" in errors[0], errors
    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError, match=f"rollout.vllm.server: no vLLM server answers at {gone} within "
                                        "rollout.vllm.server_timeout_s = 3 s"):
        train(server_config(vllm_model_dir, tmp_path / "gone", [a, gone], timeout_s=3), reward_functions=[parity])
    assert not (tmp_path / "gone").exists() or not list((tmp_path / "gone").glob("checkpoint-*"))


def test_a_server_serving_another_model_is_refused_naming_its_address(vllm_model_dir, fresh_pair, tmp_path):
    """Server b holds a model of the same sizes but other weights (another seed's): under LoRA its base is never
    pushed, so the start's probe on each server finds b's answers far from the trainer's: one error naming b, not a.
    Neither server keeps the run's adapter."""
    from safetensors.torch import load_file, save_file

    from grpokit.models.tiny import build_tiny_model

    a, b = fresh_pair
    other = tmp_path / "other"
    build_tiny_model(other, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=1)
    weights = load_file(str(other / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(other / "model.safetensors"))
    vllm_call(b, "POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(other)}})
    with pytest.raises(UserError) as e:
        train(server_config(vllm_model_dir, tmp_path / "run", [a, b], model={"lora": {"r": 4}}),
              reward_functions=[parity])
    said = str(e.value)
    assert said.startswith(f"rollout.vllm.server: the vLLM server at {b} does not serve the adapter's base model"), said
    assert a not in said, said
    for url in (a, b):
        assert [m["id"] for m in vllm_call(url, "GET", "/v1/models")["data"]] == [str(vllm_model_dir)], url


def test_torchrun_ranks_spread_over_both_servers_and_rank_0_pushes_to_both(vllm_model_dir, fresh_pair, tmp_path):
    """Sync data parallel, 2 ranks: each rank sends its prompts over both servers, rank 0 pushes every update to
    both (the other waits): the sampler's log-probs stay the trainer's on both ranks, and both servers were used."""
    from grpokit.observe.tracking import read_metrics

    before = [finished_requests(u) for u in fresh_pair]
    toml = two_servers_toml(tmp_path / "run.toml", vllm_model_dir, tmp_path / "run", fresh_pair, steps=2)
    done = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml), "--nproc-per-node", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2 and max(r["sampling/logprob_gap_max"] for r in rows) < GAP
    assert all(finished_requests(u) > b for u, b in zip(fresh_pair, before))


def test_a_server_frozen_or_restarted_mid_run_is_one_error_naming_it_with_the_steps_kept(vllm_model_dir, pair,
                                                                                         fresh_pair, tmp_path):
    """b frozen (SIGSTOP) while step 2's batch is graded: step 2's push waits server_timeout_s on b, then one
    error naming b (a was pushed to and resumed). b restarted on its port instead (it holds its starting weights
    again): said at the next push or batch, naming b. Both keep step 2."""
    servers, start = pair
    a, b = fresh_pair
    frozen = lambda: os.killpg(servers[1].proc.pid, signal.SIGSTOP)  # noqa: E731
    try:
        with pytest.raises(RolloutWorkerError) as e:
            train(server_config(vllm_model_dir, tmp_path / "frozen", [a, b], steps=4, timeout_s=15,
                                vllm={"weight_transfer": "folder"}), reward_functions=[_stop_at(2, frozen)])
    finally:
        os.killpg(servers[1].proc.pid, signal.SIGCONT)
    said = str(e.value)
    assert f"the vLLM server at {b} did not answer" in said and "within rollout.vllm.server_timeout_s = 15 s" in said
    assert a not in said and "step 2 is saved" in said, said
    assert vllm_call(a, "GET", "/is_paused")["is_paused"] is False

    port = int(b.rsplit(":", 1)[1])

    def restart():
        servers[1].stop()
        start(1, port)

    with pytest.raises(RolloutWorkerError) as e:
        train(server_config(vllm_model_dir, tmp_path / "restarted", [a, b], steps=4, timeout_s=120,
                            vllm={"weight_transfer": "folder"}), reward_functions=[_stop_at(2, restart)])
    said = str(e.value)
    assert f"the vLLM server at {b} was restarted during the run" in said and a not in said, said
    assert (tmp_path / "restarted" / "checkpoint-2").is_dir() and (tmp_path / "frozen" / "checkpoint-2").is_dir()


KILLER = '''
import os
import signal

CALLS = [0]
''' + PARITY_SOURCE + '''


def parity_then_b_dies(completions, **kwargs):
    """parity; grading the second batch kills server b's process group (GRPOKIT_TEST_KILL)."""
    CALLS[0] += 1
    if CALLS[0] == 2:
        os.killpg(int(os.environ["GRPOKIT_TEST_KILL"]), signal.SIGKILL)
    return parity(completions)
'''


def test_one_server_killed_mid_run_is_one_error_naming_it_and_the_finished_steps_kept(vllm_model_dir, pair,
                                                                                       fresh_pair, tmp_path):
    """b is SIGKILLed (its whole process group: API server and engine) while step 2's batch is graded: the run
    ends with one `error:` line naming b's address and no traceback, step 2 trained and saved."""
    servers, _ = pair
    a, b = fresh_pair
    (tmp_path / "killer.py").write_text(KILLER)
    toml = two_servers_toml(tmp_path / "run.toml", vllm_model_dir, tmp_path / "run", [a, b], steps=4)
    text = toml.read_text()
    toml.write_text(text[:text.index("functions = [")] + f'functions = ["{tmp_path}/killer.py:parity_then_b_dies"]'
                    + text[text.index("]", text.index("functions = [")) + 1:])
    env = {**os.environ, "GRPOKIT_TEST_KILL": str(servers[1].proc.pid)}
    done = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml)], capture_output=True, text=True,
                          timeout=600, env=env)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(errors) == 1 and f"the vLLM server at {b}" in errors[0] and a not in errors[0], errors
    assert "step 2 is saved" in errors[0], errors
    assert (tmp_path / "run" / "checkpoint-2" / "model.safetensors").is_file()
    assert not servers[1].alive()
