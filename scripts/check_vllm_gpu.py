#!/usr/bin/env python
"""Check grpokit's vLLM rollout path on one GPU, in under 10 minutes.

    pip install -e '.[vllm,peft]'        # on a CUDA machine
    python scripts/check_vllm_gpu.py [--out DIR] [--budget-s 540]

Builds a small Qwen2 model locally (no hub access: grpokit.models.tiny, hidden 256, 4 layers, head dim 64,
character tokenizer), then runs each phase in its own process (a fresh vLLM engine each):

  engine  VLLMEngine colocated with the trainer's model: vLLM's log-probs of its own samples against
          the trainer's recomputed ones; then the trainer's weights are perturbed, reloaded in process,
          and the new samples' log-probs must match the *new* weights (and not the old ones).
  train   5 GRPO steps through grpokit.train with rollout.engine = "vllm" and TIS (is_correction =
          "token_truncate", is_cap_max = 2):
          finite metrics, and the sampler-trainer gap stays small after every update (weights synced).
  lora    the same with model.lora: only the adapter is pushed (a new LoRARequest per update).
  sleep   the train phase with rollout.vllm.enable_sleep_mode = true.
  hf      5 GRPO steps with the built-in sampler (rollout.engine = "hf") on the GPU: finite metrics.
  async   5 GRPO steps with rollout.mode = "async" (max_staleness 1): a worker process with its own copy of
          the policy on the same GPU samples while the trainer updates; weights cross by gloo broadcast.
          Finite metrics, no answer more than 1 step stale, and where an answer is not stale the
          sampler-trainer gap stays small (the weights arrived intact).

  server  `grpokit serve` of the model on the same GPU (vLLM's own server, a quarter of the GPU), then 5 GRPO
          steps with rollout.mode = "async" through it: a worker process sends the requests over HTTP, the
          trainer pushes its weights through vLLM's NCCL weight-transfer API. The async checks above.

  vision       5 GRPO steps on a tiny Qwen2-VL (built locally, 32x32 images of the `shapes` task) with the
               built-in sampler on the GPU: finite metrics, the sampler-trainer gap small (the pixels reach both).
  vision_vllm  the same with rollout.engine = "vllm": each prompt's images go as vLLM's multi_modal_data beside
               its token ids (placeholders already expanded), and the gap stays small after every update.

  packed  packed sequences (train.packed_sequences) on the GPU in bf16: 24 answers of 1-200 tokens to 3 prompts,
          packed against padded: log-probs and the gradient agree to bf16 rounding, and each one's time
          (FlashAttention's varlen kernel where flash_attn is installed; without it a GPU runs padded by
          default, and the phase checks SDPA once per answer instead).

packed, hf, async and vision need no vLLM: without it they run alone (the vLLM phases are reported as SKIPPED).

Prints one line per check (PASS/FAIL with the numbers) and writes DIR/report.json. Exit code 0 when
every check passed. Phases left when the time budget runs out are reported as SKIPPED.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

PHASES = ("packed", "engine", "train", "lora", "sleep", "hf", "async", "server", "vision", "vision_vllm")
VLLM_PHASES = ("engine", "train", "lora", "sleep", "server", "vision_vllm")
# A dry run of this script's own logic on a machine without a GPU (tests/fake_vllm stands in for vLLM):
# GRPOKIT_CHECK_DEVICE=cpu PYTHONPATH=tests/fake_vllm python scripts/check_vllm_gpu.py
DEVICE = os.environ.get("GRPOKIT_CHECK_DEVICE", "cuda")
GAP_MEAN_MAX = 0.05  # mean |logp_vllm - logp_trainer| per token, bf16 on both sides


def build_model(path: Path) -> None:
    from grpokit.models.tiny import build_tiny_model

    if not (path / "config.json").is_file():
        build_tiny_model(path, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, max_positions=512, seed=0)


def vllm_options() -> dict:
    return {"gpu_memory_utilization": 0.25, "enforce_eager": True, "max_model_len": 512}


def parity(completions, **kwargs):
    """A reward with signal on a random model (the share of even characters), so every step updates; a
    conversational completion (the shapes task's) is its last message's text."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ord(ch) % 2 == 0 for ch in t) / max(1, len(t)) for t in texts]


def check(results: list, name: str, ok: bool, **numbers) -> None:
    results.append({"check": name, "ok": bool(ok), **numbers})
    shown = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers.items())
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {shown}", flush=True)


# ---- phases (each in its own process) ----------------------------------------------------------


def phase_engine(model_dir: Path, out: Path) -> list:
    import torch

    from grpokit.config.options import VLLMOptions
    from grpokit.models.forward import completion_logprobs
    from grpokit.models.loading import load_model_and_tokenizer
    from grpokit.rollout.request import RolloutRequest, SamplingParams
    from grpokit.rollout.vllm import VLLMEngine
    from grpokit.rollout.vllm.colocated import ColocatedLLM
    from grpokit.rollout.vllm.weights import InProcessReload
    from grpokit.tasks import get_task

    results: list = []
    model, tok = load_model_and_tokenizer(model_dir, dtype="bfloat16", device=DEVICE)
    rows = get_task("addition").generate(16, seed=0, split="train")
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    t0 = time.perf_counter()
    engine = VLLMEngine(ColocatedLLM.start(str(model_dir), VLLMOptions(**vllm_options()), dtype="bfloat16", seed=0))
    weights = InProcessReload(engine.backend, engine.served)  # the transport a colocated run publishes through
    check(results, "engine starts", True, seconds=time.perf_counter() - t0)
    s = SamplingParams(max_new_tokens=16, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def gap(m, rollout) -> tuple[float, float]:
        with torch.no_grad():
            lp, _ = completion_logprobs(m, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                        rollout.completion_mask)
        d = (lp.float() - rollout.logprobs.float()).abs()[rollout.completion_mask.bool()]
        return float(d.mean()), float(d.max())

    t0 = time.perf_counter()
    r = engine.generate(RolloutRequest(prompts, 8, s, gen)).rollout
    seconds = time.perf_counter() - t0
    check(results, "generate: 16 prompts x 8 answers", r.completion_ids.shape[0] == 128, seconds=seconds,
          tokens=int(r.completion_mask.sum()))
    mean, worst = gap(model, r)
    check(results, "logprobs: vLLM vs trainer (same weights)", mean < GAP_MEAN_MAX, mean_gap=mean, max_gap=worst)

    old = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    t0 = time.perf_counter()
    weights.publish(model, 1)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    check(results, "weight sync: one in-process reload_weights", engine.version == 1,
          seconds=time.perf_counter() - t0)
    r2 = engine.generate(RolloutRequest(prompts, 8, s, gen)).rollout
    new_mean, new_max = gap(model, r2)
    old_model, _ = load_model_and_tokenizer(model_dir, dtype="bfloat16", device=DEVICE)
    old_model.load_state_dict(old)
    stale_mean, _ = gap(old_model, r2)
    check(results, "after sync vLLM samples from the new weights",
          new_mean < GAP_MEAN_MAX and stale_mean > 3 * new_mean,
          mean_gap_new=new_mean, max_gap_new=new_max, mean_gap_old_weights=stale_mean)
    return results


def phase_train(model_dir: Path, out: Path, *, lora: bool = False, sleep: bool = False,
                vision_engine: str | None = None) -> list:
    """5 GRPO steps on vLLM (with `lora`, `sleep`), or, with `vision_engine` ("hf" or "vllm"), on a tiny Qwen2-VL
    built locally and the `shapes` task's image rows through that engine."""
    from grpokit.config.schema import (
        AlgorithmConfig,
        Config,
        DataConfig,
        ModelConfig,
        OutputConfig,
        RolloutConfig,
        TrainConfig,
    )
    from grpokit.observe.tracking import read_metrics
    from grpokit.training.loop import train

    results: list = []
    options = {**vllm_options(), **({"enable_sleep_mode": True} if sleep else {})}
    name = f"vision_{vision_engine}" if vision_engine else "lora" if lora else "sleep" if sleep else "train"
    data = DataConfig(task="addition", num_prompts=512)
    if vision_engine:
        from grpokit.models.tiny_vision import build_tiny_vlm

        model_dir = out / "tiny-vl"
        if not (model_dir / "config.json").is_file():
            build_tiny_vlm(model_dir, arch="qwen2_vl", hidden_size=128, num_layers=2, max_positions=512, seed=0)
        data = DataConfig(task="shapes", task_args={"grid": 4}, num_prompts=256)
    engine = vision_engine or "vllm"
    config = Config(
        model=ModelConfig(path=str(model_dir), dtype="bfloat16", device=DEVICE,
                          lora={"r": 8, "alpha": 16} if lora else {}),
        data=data,
        rollout=RolloutConfig(group_size=8, max_new_tokens=8 if vision_engine else 16, engine=engine,
                              vllm=options if engine == "vllm" else {}),
        algorithm=AlgorithmConfig(is_correction="token_truncate", is_cap_max=2.0),
        train=TrainConfig(steps=5, prompts_per_step=16, learning_rate=1e-2 if lora else 1e-3),
        output=OutputConfig(dir=str(out / name), console=False, overwrite=True),
    )
    t0 = time.perf_counter()
    run = train(config, reward_functions=[parity])
    rows = read_metrics(run)
    keys = ("reward", "loss", "grad_norm", "sampling/logprob_gap_mean", "sampling/is_ratio_mean")
    finite = all(r[k] is not None and math.isfinite(r[k]) for r in rows for k in keys)
    gaps = [r["sampling/logprob_gap_mean"] for r in rows]
    check(results, f"{name}: 5 GRPO steps, finite metrics", finite and len(rows) == 5,
          seconds=time.perf_counter() - t0, rollout_s=sum(r["time/rollout"] for r in rows) / len(rows),
          reward_first=rows[0]["reward"], reward_last=rows[-1]["reward"])
    updated = all(r["grad_norm"] > 0 for r in rows)  # else "after every update" would say nothing
    check(results, f"{name}: sampler-trainer gap stays small after every update", updated and max(gaps) < GAP_MEAN_MAX,
          gap_step1=gaps[0], gap_max=max(gaps), is_ratio_mean=rows[-1]["sampling/is_ratio_mean"],
          grad_norm=rows[-1]["grad_norm"])
    ckpt = run / "checkpoint-5"
    check(results, f"{name}: checkpoint written", (ckpt / "config.json").is_file()
          and (not lora or (ckpt / "adapter" / "adapter_config.json").is_file()))
    return results


def phase_builtin(model_dir: Path, out: Path, *, mode: str, server: str | None = None) -> list:
    """The built-in sampler on the GPU: in the trainer (sync) or in a worker process (async); with `server`, a
    vLLM server's address, the worker samples there."""
    from grpokit.config.schema import Config, DataConfig, ModelConfig, OutputConfig, RolloutConfig, TrainConfig
    from grpokit.observe.tracking import read_metrics
    from grpokit.training.loop import train

    results: list = []
    name = "server" if server else "async" if mode == "async" else "hf"
    engine = {"engine": "vllm", "vllm": {"server": server, "server_timeout_s": 300}} if server else {}
    config = Config(
        model=ModelConfig(path=str(model_dir), dtype="bfloat16", device=DEVICE),
        data=DataConfig(task="addition", num_prompts=512),
        rollout=RolloutConfig(group_size=8, max_new_tokens=16, mode=mode, max_staleness=1, **engine),
        train=TrainConfig(steps=5, prompts_per_step=16, learning_rate=1e-3),
        output=OutputConfig(dir=str(out / name), console=False, overwrite=True),
    )
    t0 = time.perf_counter()
    run = train(config, reward_functions=[parity])
    rows = read_metrics(run)
    finite = all(r[k] is not None and math.isfinite(r[k]) for r in rows for k in ("reward", "loss", "grad_norm"))
    check(results, f"{name}: 5 GRPO steps on the GPU, finite metrics", finite and len(rows) == 5,
          seconds=time.perf_counter() - t0, step_s=[round(r["time/step"], 3) for r in rows])
    if mode == "async":
        lags = [r["async/staleness_max"] for r in rows]
        fresh = [r["sampling/logprob_gap_mean"] for r in rows if r["async/staleness_max"] == 0]
        check(results, f"{name}: no answer more than max_staleness = 1 step stale", max(lags) <= 1, lags=lags)
        check(results, f"{name}: not stale, the sampler's log-probs are the trainer's", bool(fresh)
              and max(fresh) < GAP_MEAN_MAX, gaps=fresh, idle=[round(r["time/trainer_idle"], 3) for r in rows])
    return results


def phase_server(model_dir: Path, out: Path) -> list:
    """`grpokit serve` on this GPU, then the async phase through it."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(out / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "grpokit.cli", "serve", str(model_dir), "--host", "127.0.0.1",
                               "--port", str(port), "--gpu-memory-utilization", "0.25", "--max-model-len", "512",
                               "--vllm-args=--enforce-eager"], stdout=log, stderr=subprocess.STDOUT)
    url, t0 = f"http://127.0.0.1:{port}", time.perf_counter()
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.perf_counter() - t0 > 200:
                    results: list = []
                    check(results, "server: grpokit serve answers /health", False, exit=server.poll(),
                          log_tail=(out / "server.log").read_text()[-2000:])
                    return results
                time.sleep(1)
        results = []
        check(results, "server: grpokit serve answers /health", True, seconds=time.perf_counter() - t0)
        return results + phase_builtin(model_dir, out, mode="async", server=url)
    finally:
        server.kill()
        server.wait(30)


def phase_packed(model_dir: Path, out: Path) -> list:
    import torch

    from grpokit.models import packing
    from grpokit.models.forward import ForwardOptions, completion_logprobs
    from grpokit.models.loading import load_model_and_tokenizer

    results: list = []
    model, _ = load_model_and_tokenizer(model_dir, dtype="bfloat16", device=DEVICE)
    flash = packing.flash_attn_varlen_func is not None
    if DEVICE == "cuda" and not flash:  # the default then runs padded: check (and time) the SDPA loop anyway
        model._grpokit_packing_applies = packing._same_as_padded(model)
    check(results, "packed: packing applies to the model", packing.packing_applies(model), flash_attn=flash,
          kernel="flash_attn_varlen_func" if flash and DEVICE == "cuda" else "SDPA once per answer")
    g = torch.Generator().manual_seed(0)
    N, P, T = 24, 16, 200
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (3, P), generator=g).repeat_interleave(8, 0)  # [N, P]: 3 prompts
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()  # [N, T]
    args = [t.to(DEVICE) for t in (prompt_ids, torch.ones_like(prompt_ids), torch.randint(3, vocab, (N, T),
                                                                                        generator=g), completion_mask)]
    mask = args[3].bool()
    weights = torch.randn(N, T, generator=g).to(DEVICE) * mask

    def run(packed: bool):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize() if DEVICE == "cuda" else None
        t0 = time.perf_counter()
        logp, _ = completion_logprobs(model, *args, options=ForwardOptions(packed=packed))
        (logp.float() * weights).sum().backward()
        torch.cuda.synchronize() if DEVICE == "cuda" else None
        seconds = time.perf_counter() - t0
        grad = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        return logp.detach().float()[mask], grad, seconds

    for _ in range(2):  # warm-up
        run(True), run(False)
    (lp_pad, g_pad, s_pad), (lp_packed, g_packed, s_packed) = run(False), run(True)
    gap = float((lp_packed - lp_pad).abs().mean())
    rel = float((g_packed - g_pad).norm() / g_pad.norm())
    check(results, "packed: log-probs match the padded forward", gap < 0.02, mean_abs_gap=gap)
    check(results, "packed: gradient matches the padded one", rel < 0.05, relative_difference=rel)
    check(results, "packed: forward+backward time", True, padded_s=s_pad, packed_s=s_packed,
          real_token_share=float(mask.float().mean()))
    return results


def run_phase(phase: str, model_dir: Path, out: Path) -> list:
    if phase == "packed":
        return phase_packed(model_dir, out)
    if phase.startswith("vision"):
        return phase_train(model_dir, out, vision_engine="vllm" if phase == "vision_vllm" else "hf")
    if phase in ("hf", "async"):
        return phase_builtin(model_dir, out, mode="async" if phase == "async" else "sync")
    if phase == "server":
        return phase_server(model_dir, out)
    if phase == "engine":
        return phase_engine(model_dir, out)
    return phase_train(model_dir, out, lora=phase == "lora", sleep=phase == "sleep")


# ---- orchestration -----------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="vllm_gpu_check")
    parser.add_argument("--budget-s", type=float, default=540, help="stop starting phases after this many seconds")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # internal: run one phase here
    args = parser.parse_args()
    out = Path(args.out).resolve()
    model_dir = out / "model"
    if args.phase:
        out.mkdir(parents=True, exist_ok=True)
        results = run_phase(args.phase, model_dir, out)
        (out / f"{args.phase}.json").write_text(json.dumps(results, indent=2))
        return 0

    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    import torch
    try:
        import vllm
        version = vllm.__version__
    except ImportError as e:
        print(f"SKIPPED  the vLLM phases: vLLM is not importable ({e}); install with: pip install -e '.[vllm,peft]'")
        version = None
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("FAIL  no CUDA device")
        return 2
    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE
    print(f"vllm {version}  torch {torch.__version__}  {gpu}", flush=True)
    build_model(model_dir)
    report = {"vllm": version, "torch": torch.__version__, "gpu": gpu, "phases": {}}
    for phase in PHASES:
        left = args.budget_s - (time.perf_counter() - start)
        if version is None and phase in VLLM_PHASES:
            report["phases"][phase] = "skipped"
            continue
        if left < 60:
            print(f"SKIPPED  {phase} (time budget)")
            report["phases"][phase] = "skipped"
            continue
        t0 = time.perf_counter()
        print(f"--- {phase}", flush=True)
        try:
            proc = subprocess.run([sys.executable, __file__, "--out", str(out), "--phase", phase],
                                  timeout=min(left, 300), capture_output=True, text=True, env={**os.environ})
            sys.stdout.write("".join(line + "\n" for line in proc.stdout.splitlines()
                                     if line.startswith(("PASS", "FAIL"))))
            if proc.returncode:
                print(f"FAIL  {phase}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
            results = json.loads((out / f"{phase}.json").read_text()) if (out / f"{phase}.json").is_file() else []
            if proc.returncode:
                results.append({"check": f"{phase} exited", "ok": False, "stderr_tail": proc.stderr[-3000:]})
        except subprocess.TimeoutExpired:
            print(f"FAIL  {phase}: timed out")
            results = [{"check": f"{phase} timed out", "ok": False}]
        report["phases"][phase] = {"seconds": time.perf_counter() - t0, "results": results}
    report["seconds"] = time.perf_counter() - start
    ok = all(isinstance(p, dict) and p["results"] and all(r["ok"] for r in p["results"])
             for name, p in report["phases"].items() if not (version is None and name in VLLM_PHASES))
    report["ok"] = ok
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"{'ALL PASSED' if ok else 'SOME CHECKS FAILED'} in {report['seconds']:.0f} s; report: {out / 'report.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
