"""grpokit vs TRL's GRPOTrainer, side by side on this machine: one command.

    .venv/bin/python bench/run.py                    # S, M, R, X: grpokit and TRL, alternating
    .venv/bin/python bench/run.py --only S,M         # a subset
    .venv/bin/python bench/run.py --ablations        # also grpokit with each fast path switched off
    .venv/bin/python bench/run.py --trl-malloc-tuned # TRL with the allocator setting grpokit applies itself

Builds the benchmark models if missing (bench/build_models.py: 32k BPE tokenizer trained on the
standard library, random-init Qwen2 models), measures the fp32 matmul peak, then runs every
configuration through grpokit and through TRL (each run in its own process, so that peak RSS is
that system's alone), alternating the systems, and prints the table. TRL runs with its defaults
(gradient checkpointing on) and with gradient checkpointing off; the faster is "TRL at its best".
Answers all have the configured length in both systems (EOS ignored / masked).
Raw results go to bench/out/results-<time>.json and the table to bench/out/results-<time>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
sys.path.insert(0, str(HERE))

from flops import matmul_peak, model_shape, step_flops  # noqa: E402

COMMON = dict(G=8, temperature=1.0, lr=1e-6, loss_type="dapo", reward="letter_fraction", num_prompts=256,
              threads=2, seed=0)
# name: (model, B prompts, completion length, beta, mu, runs, grpokit steps, TRL cycles, grpokit micro-batch)
CONFIGS = {
    "S": dict(model="S", B=4, L=16, beta=0.0, mu=1, runs=3, steps=4, trl_steps=4, micro=0),
    "M": dict(model="M", B=8, L=128, beta=0.0, mu=1, runs=3, steps=2, trl_steps=2, micro=8),
    "R": dict(model="M", B=8, L=128, beta=0.04, mu=2, runs=3, steps=2, trl_steps=1, micro=8),
    "X": dict(model="M", B=8, L=512, beta=0.0, mu=1, runs=3, steps=1, trl_steps=1, micro=8, trl_runs=1),
}
PROMPT_TOKENS = 32
# Ablations (grpokit only): (label, config, spec changes); each fast path is a config option (train.*, rollout.*)
ABLATIONS = [
    ("all fast paths", "M", {}),
    ("fused log-softmax head off (plain checkpointed head)", "M", {"grpokit_train": {"fused_logprobs": False}}),
    ("one-pass backward off (fused head, recompute backward)", "M", {"grpokit_train": {"fused_backward": False}}),
    ("preallocated KV cache off (DynamicCache concatenation)", "M",
     {"grpokit_rollout": {"preallocated_kv_cache": False}}),
    ("inverse-CDF sampler off (Gumbel-max race)", "M", {"grpokit_rollout": {"sampler": "gumbel"}}),
    ("shared prefill off (prefill all N rows)", "M", {"grpokit_rollout": {"shared_prefill": False}}),
    ("shared prompt forward in training off (every row runs its prompt)", "M",
     {"grpokit_train": {"shared_prompt_forward": False}}),
    ("keep freed memory off (glibc's default mmap/trim thresholds)", "M",
     {"grpokit_train": {"keep_freed_memory": False}}),
    ("1 thread instead of 2", "M", {"threads": 1}),
    ("micro-batch 16 instead of 8", "M", {"grpokit_train": {"micro_batch_size": 16}}),
    ("micro-batch 64 (the whole batch) instead of 8", "M", {"grpokit_train": {"micro_batch_size": 0}}),
    ("zero-advantage skip on, half the groups tie", "M", {"reward": "half_unsolvable"}),
    ("zero-advantage skip off, half the groups tie", "M",
     {"reward": "half_unsolvable", "grpokit_train": {"skip_zero_advantage": False}}),
    ("R: old log-probs recomputed (TRL's way)", "R", {"grpokit_algorithm": {"old_logprobs": "recompute"}}),
    ("R: old log-probs from the sampler", "R", {"grpokit_algorithm": {"old_logprobs": "sampler"}}),
]


def spec_for(name: str, **changes) -> dict:
    c = CONFIGS[name]
    spec = {**COMMON, "name": name, "model": c["model"], "B": c["B"], "L": c["L"], "beta": c["beta"],
            "mu": c["mu"], "warmup": 1}
    train = {"micro_batch_size": c["micro"]} if c["micro"] else {}
    spec["grpokit_train"] = train
    spec["grpokit_algorithm"] = {"old_logprobs": "first_pass"} if c["mu"] > 1 else {}
    for k, v in changes.items():
        spec[k] = {**spec[k], **v} if isinstance(spec.get(k), dict) else v
    return spec


# glibc keeps freed memory instead of unmapping blocks over 32 MB (each reuse then page-faults anew)
MALLOC_TUNED = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**36)}


def busy_seconds() -> float:
    """CPU seconds this machine has spent busy (all processes; steal counts: another VM had the core)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(max_wait: float = 900, sample: float = 3.0, limit: float = 0.3) -> float:
    """Wait (up to max_wait s) until other processes use less than `limit` cores; returns what they used."""
    deadline = time.monotonic() + max_wait
    while True:
        b = busy_seconds()
        time.sleep(sample)
        others = (busy_seconds() - b) / sample
        if others < limit or time.monotonic() > deadline:
            return others
        log(f"machine busy ({others:.2f} cores used by other processes); waiting")
        time.sleep(20)


def run_worker(system: str, spec: dict, timeout: float = 1800, extra_env: dict | None = None,
               tries: int = 4, limit: float = 0.3) -> dict:
    """One run in its own process; rerun (up to `tries` times) when other processes used more than
    `limit` cores on average while it ran (measured: machine busy time minus this run's CPU time)."""
    best = None
    for attempt in range(tries):
        wait_quiet()
        b, c = busy_seconds(), children_cpu()
        out = _run_once(system, spec, timeout, extra_env)
        out["others_cores"] = max(0.0, (busy_seconds() - b) - (children_cpu() - c)) / out["process_s"]
        if best is None or out["others_cores"] < best["others_cores"]:
            best = out
        if out["others_cores"] < limit:
            break
        log(f"{system} {spec['name']}: other processes used {out['others_cores']:.2f} cores during the run "
            f"({out['s_per_opt_step']:.3f} s/step); running it again")
    best["attempts"] = attempt + 1
    return best


def _run_once(system: str, spec: dict, timeout: float, extra_env: dict | None) -> dict:
    script = HERE / ("run_grpokit.py" if system == "grpokit" else "run_trl.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"]), **(extra_env or {})}
    t = time.perf_counter()
    proc = subprocess.run([PY, str(script), json.dumps(spec)], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise RuntimeError(f"{system} {spec['name']} failed (exit {proc.returncode})")
    out = json.loads(lines[-1][len("BENCH_RESULT "):])
    out["process_s"] = time.perf_counter() - t
    return out


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {load()}] {msg}", flush=True)


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


TRL_ENV: dict = {}  # --trl-malloc-tuned: MALLOC_TUNED for every TRL run of the main table


def bench_config(name: str, log_runs: list) -> dict:
    c = CONFIGS[name]
    g_spec = spec_for(name, steps=c["steps"])
    t_spec = spec_for(name, steps=c["trl_steps"])
    grp, trl = [], {True: [], False: []}
    best_gc = None
    for i in range(c["runs"]):
        r = run_worker("grpokit", g_spec)
        grp.append(r)
        log(f"{name} grpokit run {i + 1}: {r['s_per_opt_step']:.3f} s/step, rss {r['peak_rss_mb']:.0f} MB, "
            f"others {r['others_cores']:.2f} cores")
        if i >= c.get("trl_runs", c["runs"]):
            continue
        # TRL: both gradient-checkpointing settings in the first round, then the faster one only
        for gc in ((True, False) if best_gc is None else (best_gc,)):
            r = run_worker("trl", {**t_spec, "gc": gc}, extra_env=TRL_ENV)
            trl[gc].append(r)
            log(f"{name} TRL (gc={gc}) run {len(trl[gc])}: {r['s_per_opt_step']:.3f} s/step, "
                f"rss {r['peak_rss_mb']:.0f} MB, others {r['others_cores']:.2f} cores")
        if best_gc is None:
            best_gc = min((True, False), key=lambda g: trl[g][0]["s_per_opt_step"])
    log_runs.extend(grp + trl[True] + trl[False])
    return {"grpokit": grp, "trl": trl[best_gc], "trl_gc": best_gc, "trl_other": trl[not best_gc]}


def summarize(name: str, res: dict, peak: float) -> dict:
    c = CONFIGS[name]
    shape = model_shape(str(HERE / "out" / "models" / c["model"]))
    fl = step_flops(shape, B=c["B"], G=COMMON["G"], P=PROMPT_TOKENS, T=c["L"], beta=c["beta"], mu=c["mu"])
    out = {"config": name, "flops_per_opt_step": fl["per_opt_step"], "trl_gc": res["trl_gc"]}
    for system in ("grpokit", "trl"):
        runs = res[system]
        s = median_of(runs, "s_per_opt_step")
        out[system] = {
            "runs": len(runs), "s_per_opt_step": s, "rollout_s": median_of(runs, "rollout_s"),
            "train_s": median_of(runs, "train_s"),
            "tokens_per_s": c["B"] * COMMON["G"] * c["L"] / median_of(runs, "s_per_generation"),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "mfu": fl["per_opt_step"] / s / (peak * 1e9),
            "all_s": [round(r["s_per_opt_step"], 3) for r in runs],
            "others_cores_max": max(r["others_cores"] for r in runs),
        }
    other = res["trl_other"]
    out["trl_other"] = {"s_per_opt_step": median_of(other, "s_per_opt_step"),
                        "peak_rss_mb": max(r["peak_rss_mb"] for r in other)} if other else None
    trl_rss = min([out["trl"]["peak_rss_mb"]] + ([out["trl_other"]["peak_rss_mb"]] if other else []))
    out["speedup"] = out["trl"]["s_per_opt_step"] / out["grpokit"]["s_per_opt_step"]
    out["memory_ratio"] = out["grpokit"]["peak_rss_mb"] / trl_rss
    return out


def table(rows: list[dict]) -> str:
    head = ("| config | system | s / opt. step (runs) | rollout s | train s | compl. tok/s | MFU | peak RSS MB "
            "| others' load |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        for system in ("grpokit", "trl"):
            x = r[system]
            label = "grpokit" if system == "grpokit" else f"TRL (gc={'on' if r['trl_gc'] else 'off'})"
            lines.append(f"| {r['config']} | {label} | {x['s_per_opt_step']:.3f} ({', '.join(map(str, x['all_s']))}) "
                         f"| {x['rollout_s']:.3f} | {x['train_s']:.3f} | {x['tokens_per_s']:.0f} | {x['mfu']:.0%} "
                         f"| {x['peak_rss_mb']:.0f} | {x['others_cores_max']:.2f} |")
        o = r["trl_other"]
        if o:
            lines.append(f"| {r['config']} | TRL (gc={'off' if r['trl_gc'] else 'on'}) | {o['s_per_opt_step']:.3f} "
                         f"| | | | | {o['peak_rss_mb']:.0f} | |")
    lines += ["", "| config | speed-up (TRL s / grpokit s) | memory (grpokit / lower TRL peak RSS) |", "|---|---|---|"]
    lines += [f"| {r['config']} | {r['speedup']:.2f}x | {r['memory_ratio']:.2f}x |" for r in rows]
    return "\n".join(lines)


def run_ablations(peak: float, runs: int) -> list[dict]:
    """Every ablation row `runs` times, round-robin over the rows (slow drifts of the machine then
    touch every row alike); each row reports its median run."""
    done: dict[int, list[dict]] = {i: [] for i in range(len(ABLATIONS))}
    for round_ in range(runs):
        for i, (label, name, changes) in enumerate(ABLATIONS):
            c = CONFIGS[name]
            r = run_worker("grpokit", spec_for(name, steps=c["steps"], **changes))
            done[i].append(r)
            log(f"ablation [{name}] {label} (run {round_ + 1}): {r['s_per_opt_step']:.3f} s/step "
                f"(rollout {r['rollout_s']:.3f}, train {r['train_s']:.3f}), rss {r['peak_rss_mb']:.0f} MB")
    rows = []
    for i, (label, name, _) in enumerate(ABLATIONS):
        c, runs_i = CONFIGS[name], done[i]
        shape = model_shape(str(HERE / "out" / "models" / c["model"]))
        fl = step_flops(shape, B=c["B"], G=COMMON["G"], P=PROMPT_TOKENS, T=c["L"], beta=c["beta"], mu=c["mu"])
        s = median_of(runs_i, "s_per_opt_step")
        rows.append({"label": label, "config": name, "s_per_opt_step": s, "rollout_s": median_of(runs_i, "rollout_s"),
                     "train_s": median_of(runs_i, "train_s"), "peak_rss_mb": max(r["peak_rss_mb"] for r in runs_i),
                     "others_cores": max(r["others_cores"] for r in runs_i),
                     "mfu": fl["per_opt_step"] / s / (peak * 1e9),
                     "all_s": [round(r["s_per_opt_step"], 3) for r in runs_i]})
    return rows


def ablation_table(rows: list[dict]) -> str:
    lines = ["| config | grpokit variant | s / opt. step (runs) | rollout s | train s | MFU | peak RSS MB "
             "| others' load |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['label']} | {r['s_per_opt_step']:.3f} ({', '.join(map(str, r['all_s']))}) "
                     f"| {r['rollout_s']:.3f} "
                     f"| {r['train_s']:.3f} | {r['mfu']:.0%} | {r['peak_rss_mb']:.0f} | {r['others_cores']:.2f} |")
    return "\n".join(lines)


def malloc_study(rows: list[dict]) -> list[dict]:
    """S and M once more, both systems with MALLOC_TUNED (TRL with its faster checkpointing setting)."""
    out = []
    for name in ("S", "M"):
        c = CONFIGS[name]
        gc = next((r["trl_gc"] for r in rows if r["config"] == name), False)
        g = run_worker("grpokit", spec_for(name, steps=c["steps"]), extra_env=MALLOC_TUNED)
        t = run_worker("trl", {**spec_for(name, steps=c["trl_steps"]), "gc": gc}, extra_env=MALLOC_TUNED)
        log(f"malloc-tuned {name}: grpokit {g['s_per_opt_step']:.3f} s/step, TRL {t['s_per_opt_step']:.3f} s/step")
        out.append({"config": name, "grpokit": g, "trl": t, "trl_gc": gc})
    return out


def malloc_table(rows: list[dict]) -> str:
    lines = ["| config | grpokit s / step | TRL s / step | speed-up | grpokit RSS MB | TRL RSS MB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        g, t = r["grpokit"], r["trl"]
        lines.append(f"| {r['config']} (glibc malloc tuned, both) | {g['s_per_opt_step']:.3f} "
                     f"| {t['s_per_opt_step']:.3f} "
                     f"| {t['s_per_opt_step'] / g['s_per_opt_step']:.2f}x | {g['peak_rss_mb']:.0f} "
                     f"| {t['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def machine() -> dict:
    import torch
    import transformers
    import trl

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gb": round(os.sysconf("SC_PAGE_SIZE") *
                                                                  os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="S,M,R,X", help="comma-separated configurations")
    ap.add_argument("--ablations", action="store_true", help="also run the grpokit ablation rows")
    ap.add_argument("--ablations-only", action="store_true")
    ap.add_argument("--ablation-runs", type=int, default=3, help="runs per ablation row (the median is reported)")
    ap.add_argument("--malloc-study", action="store_true",
                    help="also S and M with glibc malloc tuned for both systems (MALLOC_TUNED)")
    ap.add_argument("--trl-malloc-tuned", action="store_true",
                    help="TRL runs with glibc's freed memory kept (MALLOC_TUNED), as grpokit does by itself")
    args = ap.parse_args()
    TRL_ENV.update(MALLOC_TUNED if args.trl_malloc_tuned else {})
    stamp = time.strftime("%Y%m%d-%H%M%S")
    start_load = load()
    log("building models (cached in bench/out/models)")
    subprocess.run([PY, str(HERE / "build_models.py")], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    wait_quiet()
    peak_start = matmul_peak(COMMON["threads"])
    log(f"fp32 matmul peak ({COMMON['threads']} threads): {peak_start:.1f} GFLOP/s")
    results, runs = [], []
    if not args.ablations_only:
        for name in args.only.split(","):
            results.append(bench_config(name, runs))
    wait_quiet()
    peak_end = matmul_peak(COMMON["threads"])
    peak = max(peak_start, peak_end)  # the higher peak: the conservative MFU
    log(f"fp32 matmul peak at the end: {peak_end:.1f} GFLOP/s; MFU uses {peak:.1f}")
    names = [] if args.ablations_only else args.only.split(",")
    rows = [summarize(n, r, peak) for n, r in zip(names, results)]
    abl = run_ablations(peak, args.ablation_runs) if args.ablations or args.ablations_only else []
    mal = malloc_study(rows) if args.malloc_study else []
    report = {"trl_env": TRL_ENV, "machine": machine(), "load_start": start_load, "load_end": load(),
              "peak_gflops": peak, "peak_start": peak_start, "peak_end": peak_end, "rows": rows, "ablations": abl,
              "malloc": mal, "runs": runs, "configs": CONFIGS, "common": COMMON}
    out = HERE / "out"
    (out / f"results-{stamp}.json").write_text(json.dumps(report, indent=1))
    md = [f"TRL environment: {TRL_ENV or 'default'}", f"machine: {report['machine']}",
          f"load average (1/5/15 min) at start: {start_load}; at end: {load()}",
          f"fp32 matmul peak: {peak_start:.1f} GFLOP/s at start, {peak_end:.1f} at end", ""]
    if rows:
        md.append(table(rows))
    if abl:
        md += ["", ablation_table(abl)]
    if mal:
        md += ["", malloc_table(mal)]
    (out / f"results-{stamp}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
