"""Several vLLM servers (`rollout.vllm.server = [...]`, rollout/vllm/servers.py), against the CPU stand-in
(tests/fake_vllm, as tests/test_vllm_server.py) and with stand-in servers in this process, for what the real servers
(tests/real_vllm/test_two_servers_real.py) cannot show: the routing by load request by request, a failure on one
server while the other's push is still running, LoRA and async mode over two servers (counted by the stand-in), and
`grpokit serve --replicas` on a GPU host's command lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

import test_vllm_server
from conftest import make_config, parity
from grpokit.errors import ConfigError, RolloutWorkerError
from grpokit.observe.tracking import read_metrics
from grpokit.rollout.vllm.servers import ServerPool, on_every
from grpokit.training.loop import train
from test_vllm_server import FAKE, free_port, get

stand_in = test_vllm_server.stand_in  # the stand-in vllm importable here and in spawned workers (a fixture)

# ---- the config -------------------------------------------------------------------------------------------------


def test_a_list_of_servers_is_taken_and_one_address_still_is(stand_in):
    from grpokit.config.schema import RolloutConfig

    one = RolloutConfig(engine="vllm", vllm={"server": "http://localhost:8000/"})
    assert one.vllm_options.servers == ("http://localhost:8000",) and one.vllm_options.server == "http://localhost:8000/"
    two = RolloutConfig(engine="vllm", vllm={"server": ["http://a:8000", "http://a:8001/"]})
    assert two.vllm_options.servers == ("http://a:8000", "http://a:8001")


@pytest.mark.parametrize("servers, said", [
    (["http://a:8000", "http://A:8000/"], r"lists the server http://A:8000/ twice \('http://a:8000' and"),
    (["http://a:80", "http://a"], r"lists the server http://a twice"),
    (["http://a:8000", "http://a:8001/v1"], r"'http://a:8001/v1' has a path \(/v1\)"),
    ([], r"is an empty list"),
    (["http://a:8000", 8001], r"item 2 must be a string"),
])
def test_a_bad_list_is_one_error_naming_the_address(stand_in, servers, said):
    from grpokit.config.schema import RolloutConfig

    with pytest.raises(ConfigError, match=r"^rollout.vllm.server: " + said):
        RolloutConfig(engine="vllm", vllm={"server": servers})


def test_nccl_to_several_servers_is_refused_naming_the_field(stand_in):
    from grpokit.config.schema import RolloutConfig

    with pytest.raises(ConfigError, match=r"^rollout.vllm.weight_transfer: is \"nccl\", and NCCL to several servers "
                                          r"\(2 in rollout.vllm.server\) is not built yet"):
        RolloutConfig(engine="vllm", vllm={"server": ["http://a:1", "http://a:2"], "weight_transfer": "nccl"})
    RolloutConfig(engine="vllm", vllm={"server": ["http://a:1"], "weight_transfer": "nccl"})  # one server: as before


# ---- the routing, with servers in this process ------------------------------------------------------------------


class FakeServer:
    """What ServerPool calls on a ServerLLM: `_one` (holds until `release` is set, when given), its client."""

    def __init__(self, url: str, hold: threading.Event | None = None, fail: bool = False):
        self.model, self.hold, self.fail, self.got = url, hold, fail, []
        self.client = SimpleNamespace(url=url, check_not_restarted=lambda: None)

    def _one(self, model, prompt, p, index):
        self.got.append(index)
        if self.hold is not None:
            self.hold.wait(10)
        if self.fail:
            raise RolloutWorkerError(f"rollout.vllm.server: the vLLM server at {self.client.url} did not answer")
        return SimpleNamespace(index=index, server=self.client.url, model=model, seed=p.seed + index)


def test_each_request_goes_to_the_server_with_the_fewest_answers_in_flight():
    """Server a holds its requests; b answers at once: while a's is in flight every later request goes to b (a
    round robin would send every other one to a), and a batch over two idle servers is split evenly."""
    release = threading.Event()
    a, b = FakeServer("http://a", hold=release), FakeServer("http://b")
    pool, p = ServerPool([a, b]), SimpleNamespace(n=4, seed=100)
    held = threading.Thread(target=pool._routed, args=(None, {}, p, 0))
    held.start()
    time.sleep(0.2)
    answers = [pool._routed(None, {}, p, i) for i in range(1, 7)]  # one after the other, a still busy
    assert [x.server for x in answers] == ["http://b"] * 6 and pool.in_flight == [4, 0]
    release.set()
    held.join()
    assert pool.in_flight == [0, 0] and pool.sent == [1, 6]
    pool2 = ServerPool([FakeServer("http://a"), FakeServer("http://b")])
    out = pool2.complete([{"prompt_token_ids": [1]}] * 8, p, SimpleNamespace(lora_name="policy-v3"))
    assert pool2.sent == [4, 4]
    assert [o.index for o in out] == list(range(8)) and {o.model for o in out} == {"policy-v3"}
    assert [o.seed for o in out] == [100 + i for i in range(8)]  # each prompt's seed, whichever server took it


def test_a_failure_on_one_server_waits_for_the_others_and_names_the_one_at_fault():
    done = []

    def push(server):
        if server == "http://b":
            raise RolloutWorkerError("rollout.vllm.server: the vLLM server at http://b did not answer /pause")
        time.sleep(0.5)  # a's reload still running when b fails
        done.append(server)

    with pytest.raises(RolloutWorkerError, match=r"^rollout.vllm.server: the vLLM server at http://b did not answer "
                                                 r"/pause$"):
        on_every(push, ["http://a", "http://b"])
    assert done == ["http://a"]  # a's push ended (resumed) before the error was raised

    def both(server):
        raise RolloutWorkerError(f"the vLLM server at {server} failed")

    with pytest.raises(RolloutWorkerError, match=r"http://a failed \(and on another server: the vLLM server at "
                                                 r"http://b failed\)"):
        on_every(both, ["http://a", "http://b"])


def test_an_adapter_that_fails_to_load_on_one_server_is_unloaded_from_the_others():
    calls = []

    class Server(FakeServer):
        def load_adapter(self, name, number, folder):
            calls.append(("load", self.client.url))
            if self.fail:
                raise RolloutWorkerError(f"the vLLM server at {self.client.url} takes no LoRA adapters")

        def unload_adapter(self, previous, timeout_s=None):
            calls.append(("unload", self.client.url))

    pool = ServerPool([Server("http://a"), Server("http://b", fail=True)])
    with pytest.raises(RolloutWorkerError, match="http://b takes no LoRA"):
        pool.load_adapter("p-v0", 1, "/tmp/x")
    assert sorted(calls) == [("load", "http://a"), ("load", "http://b"), ("unload", "http://a"), ("unload", "http://b")]


# ---- two stand-in servers ---------------------------------------------------------------------------------------


def _serve(model_dir, port: int, *flags):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "grpokit.cli", "serve", str(model_dir), "--port", str(port),
                             "--host", "127.0.0.1", "--dtype", "float32", "--lora-rank", "4", *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _up(proc, urls: list[str]) -> None:
    deadline = time.monotonic() + 120
    for url in urls:
        while True:
            try:
                get(f"{url}/health")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.3)


@pytest.fixture
def two(tiny_model_dir, stand_in):
    """Two stand-in servers, each its own `grpokit serve` (one can be killed alone); their URLs."""
    procs, urls = [], []
    for _ in range(2):
        port = free_port()
        procs.append(_serve(tiny_model_dir, port))
        urls.append(f"http://127.0.0.1:{port}")
    for proc, url in zip(procs, urls):
        _up(proc, [url])
    yield urls
    for proc in procs:
        proc.kill()
        proc.wait(10)


def config_for(model_dir, out, urls, *, steps=2, rollout=None, **kw):
    return make_config(model_dir, out, steps=steps, learning_rate=1e-2,
                       rollout={"engine": "vllm", "vllm": {"server": urls, "server_timeout_s": 30,
                                                           "weight_transfer": "folder"}, **(rollout or {})},
                       train={"num_threads": 1}, algorithm={"is_correction": "token_truncate"}, **kw)


def test_grpokit_serve_replicas_starts_servers_a_run_spreads_over(tiny_model_dir, tmp_path, stand_in):
    """`grpokit serve --replicas 2` (here one stand-in per GPU: --devices 0,1) prints the list to train with; a sync
    run through the folder transport sends requests to both, reloads both at every push, and samples what the
    trainer trains on both (the gap of the sampler's log-probs to the trainer's stays at float rounding)."""
    port = free_port()
    proc = _serve(tiny_model_dir, port, "--replicas", "2", "--devices", "0,1")
    try:
        lines = []
        while not any("then train with" in line for line in lines):
            lines.append(proc.stdout.readline())
            assert lines[-1] or proc.poll() is None, "".join(lines)
        said = next(line for line in lines if "then train with" in line)
        urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        assert f'rollout.vllm = {{server = ["{urls[0]}", "{urls[1]}"]}}' in said, said
        assert sum("starting:" in line for line in lines) == 2
        _up(proc, urls)
        run = train(config_for(tiny_model_dir, tmp_path / "run", urls, steps=3), reward_functions=[parity])
        rows = read_metrics(run)
        assert len(rows) == 3 and max(r["sampling/logprob_gap_max"] for r in rows) < 1e-4
        stats = [get(f"{u}/stand_in_stats") for u in urls]
        assert [s["reloads"] for s in stats] == [4, 4]  # the start's push, then one after each step, on each
        assert all(s["completions"] >= 4 for s in stats), stats  # 3 steps x 4 prompts + 2 probes, spread
        assert sum(s["completions"] for s in stats) == 3 * 4 + 2  # one request per prompt; a probe on each
        assert {s["argv"][s["argv"].index("--port") + 1] for s in stats} == {str(port), str(port + 1)}
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(10)


def test_serve_replicas_command_lines(tiny_model_dir, monkeypatch):
    """On GPUs one server per group of --devices, each its own port; on the CPU build the KV cache shared out."""
    from grpokit import serve
    from grpokit.cli import build_parser
    from grpokit.errors import UserError

    def commands(platform, *flags):
        monkeypatch.setattr(serve, "vllm_platform", lambda: platform)
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        port = free_port()
        args = build_parser().parse_args(["serve", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port),
                                          *flags])
        return port, serve.serve_commands(args)

    port, cmds = commands("cuda", "--replicas", "2", "--devices", "2,3")
    assert [(c[0][c[0].index("--port") + 1], c[1]["CUDA_VISIBLE_DEVICES"]) for c in cmds] == \
        [(str(port), "2"), (str(port + 1), "3")]
    port, cmds = commands("cuda", "--replicas", "2", "--devices", "0,1,2,3", "--tensor-parallel-size", "2")
    assert [c[1]["CUDA_VISIBLE_DEVICES"] for c in cmds] == ["0,1", "2,3"]
    with pytest.raises(UserError, match=r"^--devices: 3 GPUs \(0,1,2\) for --replicas 2 x --tensor-parallel-size 1: "
                                        r"give 2"):
        commands("cuda", "--replicas", "2", "--devices", "0,1,2")
    with pytest.raises(UserError, match=r"^--replicas: 2 servers on GPUs need --devices"):
        commands("cuda", "--replicas", "2")
    with pytest.raises(UserError, match=r"^--replicas: 0 servers"):
        commands("cuda", "--replicas", "0")
    monkeypatch.setattr(serve, "ram_gib", lambda: (64.0, 16.0))
    monkeypatch.setattr("grpokit.rollout.vllm.checks.cpu_head_size_problem", lambda folder: None)
    port, cmds = commands("cpu", "--replicas", "2")
    assert [c[1]["VLLM_CPU_KVCACHE_SPACE"] for c in cmds] == ["4", "4"]  # 16 GiB free / (2 x 2)
    port, cmds = commands("cpu", "--replicas", "3", "--kv-cache-gib", "1")
    assert [c[0][c[0].index("--port") + 1] for c in cmds] == [str(port + k) for k in range(3)]
    assert [c[1]["VLLM_CPU_KVCACHE_SPACE"] for c in cmds] == ["1"] * 3


def parity_then_b_dies(completions, **kwargs):
    """`parity`; grading the second batch kills server b (its pid in GRPOKIT_TEST_SERVER_PID)."""
    CALLS["n"] += 1
    if CALLS["n"] == 2:
        os.kill(int(os.environ["GRPOKIT_TEST_SERVER_PID"]), 9)
    return parity(completions)


CALLS = {"n": 0}


def test_a_push_that_fails_on_one_server_of_two_names_it_and_keeps_the_finished_steps(tiny_model_dir, tmp_path,
                                                                                      two, monkeypatch):
    """Server b dies while step 2's batch is graded: step 2 trains, its push reaches a and fails on b: one error
    naming b (not a), step 2 saved; a was resumed (its requests answer)."""
    a, b = two
    monkeypatch.setenv("GRPOKIT_TEST_SERVER_PID", str(get(f"{b}/stand_in_stats")["pid"]))
    CALLS["n"] = 0
    with pytest.raises(RolloutWorkerError) as e:
        train(config_for(tiny_model_dir, tmp_path / "run", [a, b], steps=4), reward_functions=[parity_then_b_dies])
    said = str(e.value)
    assert f"rollout.vllm.server: the vLLM server at {b} did not answer" in said and a not in said, said
    assert "step 2 is saved" in said, said
    assert (tmp_path / "run" / "checkpoint-2" / "model.safetensors").is_file()
    assert get(f"{a}/stand_in_stats")["reloads"] == 3  # the start's, step 1's and step 2's


def test_lora_over_two_servers_loads_and_unloads_the_adapter_on_each(tiny_model_dir, tmp_path, two):
    run = train(config_for(tiny_model_dir, tmp_path / "run", two, steps=2, model={"lora": {"r": 4}}),
                reward_functions=[parity])
    rows = read_metrics(run)
    assert max(r["sampling/logprob_gap_max"] for r in rows) < 1e-4  # every request found this step's adapter
    stats = [get(f"{u}/stand_in_stats") for u in two]
    assert all(s["completions"] >= 2 for s in stats), stats
    assert [s["loras_loaded"] for s in stats] == [0, 0]  # the run's last adapter unloaded from each
    assert [s.get("reloads", 0) for s in stats] == [0, 0]  # the base is never pushed under LoRA


def test_async_over_two_servers_spreads_one_workers_requests_and_never_pushes_mid_batch(tiny_model_dir, tmp_path,
                                                                                       two):
    run = train(config_for(tiny_model_dir, tmp_path / "run", two, steps=3,
                           rollout={"mode": "async", "max_staleness": 0}), reward_functions=[parity])
    rows = read_metrics(run)
    assert len(rows) == 3 and max(r["sampling/logprob_gap_max"] for r in rows) < 1e-4
    stats = [get(f"{u}/stand_in_stats") for u in two]
    assert all(s["completions"] >= 3 for s in stats) and [s["updates_during_sampling"] for s in stats] == [0, 0]


def test_one_unreachable_address_of_two_is_one_error_naming_it(tiny_model_dir, tmp_path, two):
    gone = f"http://127.0.0.1:{free_port()}"
    config = make_config(tiny_model_dir, tmp_path / "run", rollout={"engine": "vllm", "vllm": {
        "server": [two[0], gone], "server_timeout_s": 2}})
    with pytest.raises(Exception, match=re.escape(f"rollout.vllm.server: no vLLM server answers at {gone} within")):
        train(config, reward_functions=[parity])
