"""What a killed run or a killed `grpokit serve` leaves behind, against the real vLLM (its CPU build; .venv-vllm).

- `grpokit serve` SIGKILLed: vLLM's server, its engine core (674 MB on the tiny model) and multiprocessing's
  resource tracker all end with it (serve.py `run_vllm`); exec'd in its place, they lived on under PID 1.
- A LoRA run through a server SIGKILLed: its last adapter stays registered on the server and its adapter folder
  under TMPDIR; the next run's first push unloads the one and removes the other (rollout/vllm/leftovers.py), and
  leaves a live run's alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from grpokit.rollout.vllm.leftovers import here
from real_vllm.conftest import vllm_call

WAIT_S = 30.0  # a SIGKILLed grpokit serve: everything it started is gone within this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` still running (a zombie has ended: it waits only for its parent to read its code)."""
    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def test_a_sigkilled_grpokit_serve_leaves_no_process_of_vllm_behind(vllm_model_dir, tmp_path):
    """`grpokit serve` up (/health answers), its process tree noted (vLLM's server, its engine core, the resource
    tracker, the guard), then SIGKILL to grpokit serve alone: within 30 s none of them is left."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "grpokit.cli", "serve", str(vllm_model_dir), "--host", "127.0.0.1",
                             "--port", str(port), "--dtype", "float32", "--max-model-len", "128", "--kv-cache-gib",
                             "1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        t0 = time.monotonic()
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() - t0 < 240, log_path.read_text()[-4000:]
                time.sleep(1)
        tree = psutil.Process(proc.pid).children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in tree]  # vLLM names its processes (VLLM::EngineCore ...)
        assert any("EngineCore" in c for c in commands) and len(tree) >= 3, commands
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + WAIT_S
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [(p.pid, " ".join(p.cmdline())[:160]) for p in _alive(tree)]
        assert not left, f"left running {WAIT_S:g} s after grpokit serve was SIGKILLed: {left}"
    finally:  # whatever is left (this test's own processes only), so that a failure leaks nothing
        for p in _alive([psutil.Process(proc.pid)] if proc.poll() is None else []) + _alive(tree):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait(10)
        log.close()


TESTS = Path(__file__).resolve().parent.parent
KILLED_RUN = """import sys
sys.path.insert(0, {tests!r})
from conftest import make_config, parity
from grpokit.training.loop import train
train(make_config({model!r}, {out!r}, steps=1000, model={{"lora": {{"r": 4}}}}, train={{"num_threads": 1}},
                  rollout={{"engine": "vllm", "vllm": {{"server": {url!r}, "server_timeout_s": 60,
                                                       "weight_folder": {weights!r}}}}}), reward_functions=[parity])
"""


def adapters(url: str) -> dict[str, str]:
    """The LoRA adapters the server lists: name -> the folder it loaded each from (`root`)."""
    return {m["id"]: m.get("root") for m in vllm_call(url, "GET", "/v1/models")["data"] if m.get("parent")}


def test_a_killed_lora_runs_adapter_and_folder_are_swept_at_the_next_runs_start_a_live_runs_kept(
        fresh_server, vllm_model_dir, tmp_path):
    """A LoRA run through the server, SIGKILLed after its first push, leaves its adapter registered and its folder
    under rollout.vllm.weight_folder. The next run's first push unloads the one and removes the other, and a dead
    run's full-weight folder; a live run's adapter and folder (its pid runs), another machine's folder and an
    older folder without a pid stay."""
    from conftest import make_config, parity
    from grpokit.training.loop import train

    url, weights = fresh_server, tmp_path / "weights"
    log = open(tmp_path / "killed.log", "w")
    killed = subprocess.Popen([sys.executable, "-c", KILLED_RUN.format(
        tests=str(TESTS), model=str(vllm_model_dir), out=str(tmp_path / "killed"), url=url, weights=str(weights))],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])  # a run that still runs
    try:
        t0 = time.monotonic()
        while not [n for n in adapters(url) if n.startswith(f"grpokit-{killed.pid}-")]:
            assert killed.poll() is None and time.monotonic() - t0 < 300, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.5)
        os.killpg(killed.pid, signal.SIGKILL)  # after its first push: no close(), nothing unloaded or removed
        killed.wait(30)
        [(dead_name, dead_root)] = [(n, r) for n, r in adapters(url).items() if n.startswith(f"grpokit-{killed.pid}-")]
        dead_folder = Path(dead_root).parent  # <weight_folder>/grpokit-lora-<pid>-<host>-XXXXXXXX/push-0
        assert dead_folder.parent == weights and dead_folder.is_dir(), dead_root

        def folder(name: str) -> Path:  # a run folder holding a copy of the dead run's adapter
            shutil.copytree(dead_root, weights / name / "push-0")
            return weights / name

        live_folder = folder(f"grpokit-lora-{live.pid}-{here()}-abcdefgh")
        live_name = f"grpokit-{live.pid}-0-00000000-v0"
        vllm_call(url, "POST", "/v1/load_lora_adapter", {"lora_name": live_name,
                                                         "lora_path": str(live_folder / "push-0")})
        elsewhere = folder(f"grpokit-lora-{killed.pid}-1-another-host-abcdefgh")  # its pid means nothing here
        older = folder("grpokit-lora-abcdefgh")  # named before pids were: whose, unknown
        dead_weights = weights / f"grpokit-weights-{killed.pid}-{here()}-abcdefgh"
        (dead_weights / "push-0").mkdir(parents=True)
        (dead_weights / "push-0" / "model-00000.safetensors").write_bytes(b"0" * 1024)

        run = train(make_config(vllm_model_dir, tmp_path / "next", steps=1, model={"lora": {"r": 4}},
                                train={"num_threads": 1}, rollout={"engine": "vllm", "vllm": {
                                    "server": url, "server_timeout_s": 60, "weight_folder": str(weights)}}),
                    reward_functions=[parity])
        assert (run / "metrics.jsonl").is_file()
        left = adapters(url)
        assert dead_name not in left, f"the killed run's adapter is still registered: {left}"
        assert not dead_folder.exists() and not dead_weights.exists(), sorted(p.name for p in weights.iterdir())
        assert left.get(live_name) == str(live_folder / "push-0"), left  # a live run's: kept
        assert live_folder.is_dir() and elsewhere.is_dir() and older.is_dir(), sorted(p.name for p in weights.iterdir())
        assert not [n for n in left if n not in (live_name,)], left  # the next run unloaded its own at its end
    finally:
        if killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(30)
        live.kill()
        live.wait(10)
        log.close()
