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

from flops import matmul_peak, mean_phase_bounds, model_shape, step_flops  # noqa: E402
from lengths import target_lengths  # noqa: E402

COMMON = dict(G=8, temperature=1.0, lr=1e-6, loss_type="dapo", reward="letter_fraction", num_prompts=256,
              threads=2, seed=0)
# name: (model, B prompts, completion length, beta, mu, runs, grpokit steps, TRL cycles, grpokit micro-batch)
CONFIGS = {
    "S": dict(model="S", B=4, L=16, beta=0.0, mu=1, runs=3, steps=4, trl_steps=4, micro=0),
    "M": dict(model="M", B=8, L=128, beta=0.0, mu=1, runs=3, steps=2, trl_steps=2, micro=8, trl_micro=(8, 64)),
    "R": dict(model="M", B=8, L=128, beta=0.04, mu=2, runs=3, steps=2, trl_steps=1, micro=8),
    "X": dict(model="M", B=8, L=512, beta=0.0, mu=1, runs=3, steps=1, trl_steps=1, micro=8, trl_runs=1),
    # Qwen2.5-0.5B's architecture (bench/build_models.py), the whole batch per micro-step in both systems; TRL
    # runs every (checkpointing, allocator) setting once and its fastest is "TRL at its best"
    "L": dict(model="L", G=4, B=4, L=128, beta=0.0, mu=1, runs=2, steps=2, trl_steps=1, micro=0, trl_runs=1,
              trl_per_device=16, trl_allocators="both"),
    # realistic lengths (bench/lengths.py): answers end at EOS after 16-512 tokens (log-normal, median 64), the
    # same lengths on both systems, batch by batch (both measure the same batches: steps = trl_steps); TRL
    # also searches its micro-batch (answers per micro-step: it pads each to its longest answer)
    "MV": dict(model="M", B=8, L=512, beta=0.0, mu=1, runs=3, steps=2, trl_steps=2, micro=8, lengths="realistic",
               trl_micro=(4, 8, 64)),
    # (TRL with all 16 answers in one micro-step was killed by the OOM killer at 24 GB, 2026-12-06: 4 only)
    "LV": dict(model="L", G=4, B=4, L=512, beta=0.0, mu=1, runs=2, steps=1, trl_steps=1, micro=0, trl_runs=1,
               lengths="realistic", trl_micro=(4,)),
}
REALISTIC = dict(lo=16, hi=512, median=64, sigma=0.9, seed=0)  # answer lengths of a reasoning task (tokens)
LARGE_MODELS = ("L",)  # (and LV)  # built only when a configuration asks for them (2 GB each)
PROMPT_TOKENS = 32
# Ablations (grpokit only): (label, config, spec changes); each fast path is a config option (train.*, rollout.*)
ABLATIONS = [
    ("all fast paths", "M", {}),
    ("fused log-softmax head off (plain checkpointed head)", "M", {"grpokit_train": {"fused_logprobs": False}}),
    ("one-pass backward off (fused head, recompute backward)", "M", {"grpokit_train": {"fused_backward": False}}),
    ("preallocated KV cache off (DynamicCache concatenation)", "M",
     {"grpokit_rollout": {"preallocated_kv_cache": False}}),
    ("inverse-CDF sampler off (Gumbel-max race)", "M", {"grpokit_rollout": {"sampler": "gumbel"}}),
    ("packed decode weights off (aten's fp32 matmul in the decode)", "M",
     {"grpokit_rollout": {"packed_weights": False}}),
    ("shared prefill off (prefill all N rows)", "M", {"grpokit_rollout": {"shared_prefill": False}}),
    ("shared prompt forward in training off (every row runs its prompt)", "M",
     {"grpokit_train": {"shared_prompt_forward": False}}),
    ("keep freed memory off (glibc's default mmap/trim thresholds)", "M",
     {"grpokit_train": {"keep_freed_memory": False}}),
    ("oneDNN linears in training off (aten's matmuls: layers' forward and dL/dx, the fused head's logits and dL/dh)",
     "M", {"grpokit_train": {"onednn_linear": False}}),
    ("embedding rows into the gradient off (torch's dense [vocab, hidden] embedding gradient every micro-step)", "M",
     {"grpokit_train": {"embedding_rows_into_grad": False}}),
    ("1 thread instead of 2", "M", {"threads": 1}),
    ("micro-batch 16 instead of 8", "M", {"grpokit_train": {"micro_batch_size": 16}}),
    ("micro-batch 64 (the whole batch) instead of 8", "M", {"grpokit_train": {"micro_batch_size": 0}}),
    ("zero-advantage skip on, half the groups tie", "M", {"reward": "half_unsolvable"}),
    ("zero-advantage skip off, half the groups tie", "M",
     {"reward": "half_unsolvable", "grpokit_train": {"skip_zero_advantage": False}}),
    ("R: old log-probs recomputed (TRL's way)", "R", {"grpokit_algorithm": {"old_logprobs": "recompute"}}),
    ("R: old log-probs from the sampler", "R", {"grpokit_algorithm": {"old_logprobs": "sampler"}}),
    ("MV: all fast paths", "MV", {}),
    ("MV: layer loop off (one-token decode steps through transformers' forward)", "MV",
     {"grpokit_rollout": {"layer_loop": False}}),
    ("MV: micro-batches in row order (no length grouping, no token budget)", "MV",
     {"grpokit_train": {"micro_batch_grouping": "rows"}}),
    ("MV: packed sequences off (padded micro-batches, sorted by length under the token budget)", "MV",
     {"grpokit_train": {"packed_sequences": False}}),
]
# Memory levers (grpokit only, --levers): what each costs in time and saves in peak RSS, against the main row
CHECKPOINTING = {"grpokit_train": {"gradient_checkpointing": True}}
LEVERS = [
    ("activation checkpointing (train.gradient_checkpointing)", "X", CHECKPOINTING),
    ("activation checkpointing (train.gradient_checkpointing)", "L", CHECKPOINTING),
    ("checkpointing + AdamW step in the backward (train.optimizer_in_backward; needs max_grad_norm = 0)", "L",
     {"grpokit_train": {"gradient_checkpointing": True, "optimizer_in_backward": True, "max_grad_norm": 0.0}}),
    ("checkpointing + AdamW in the backward + bfloat16 moments (train.optimizer_state_dtype)", "L",
     {"grpokit_train": {"gradient_checkpointing": True, "optimizer_in_backward": True, "max_grad_norm": 0.0,
                        "optimizer_state_dtype": "bfloat16"}}),
    ("bfloat16 weights, rollout and training (model.dtype)", "M", {"grpokit_model": {"dtype": "bfloat16"}}),
    ("bfloat16 weights, rollout and training (model.dtype)", "L", {"grpokit_model": {"dtype": "bfloat16"}}),
]


def spec_for(name: str, **changes) -> dict:
    c = CONFIGS[name]
    spec = {**COMMON, "name": name, "model": c["model"], "B": c["B"], "L": c["L"], "beta": c["beta"],
            "mu": c["mu"], "warmup": 1, "G": c.get("G", COMMON["G"])}
    if "trl_per_device" in c:
        spec["trl_per_device"] = c["trl_per_device"]
    if c.get("lengths"):
        spec["lengths"] = REALISTIC
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


QUIET_WAIT_S = 900.0  # how long a run waits for a quiet machine (bench/quick.py waits less)


def wait_quiet(max_wait: float | None = None, sample: float = 3.0, limit: float = 0.3) -> float:
    """Wait (up to max_wait s) until other processes use less than `limit` cores; returns what they used."""
    deadline = time.monotonic() + (QUIET_WAIT_S if max_wait is None else max_wait)
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


def measured_bandwidth(threads: int) -> tuple[float, float]:
    """(copy_bandwidth, read_bandwidth) in a process of its own: their 2 GB of buffers must not raise this
    driver's peak RSS, which Linux hands on (ru_maxrss survives execve) to every worker started after it."""
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); from flops import copy_bandwidth, read_bandwidth; "
            f"print(copy_bandwidth({threads}), read_bandwidth({threads}))")
    out = subprocess.run([PY, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    return float(out[-2]), float(out[-1])


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {load()}] {msg}", flush=True)


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


TRL_ENV: dict = {}  # --trl-malloc-tuned: MALLOC_TUNED for every TRL run of the main table
TRL_ONLY: list = []  # --trl-fastest-known: the one (gc, allocator) setting TRL runs in


def trl_label(gc: bool, tuned: bool, micro: int | None = None) -> str:
    per = f", {micro} per micro-step" if micro else ""
    return f"TRL (gc={'on' if gc else 'off'}{', allocator setting' if tuned else ''}{per})"


def trl_settings(c: dict) -> list[tuple[bool, bool, int | None]]:
    """(gradient checkpointing, allocator setting, answers per micro-step) that TRL runs in the first round;
    None: the configuration's own micro-batch."""
    micros = c.get("trl_micro", (None,))
    if TRL_ONLY:
        return [(gc, tuned, m) for gc, tuned in TRL_ONLY for m in micros]
    allocators = (False, True) if c.get("trl_allocators") == "both" else (bool(TRL_ENV),)
    return [(gc, tuned, m) for tuned in allocators for gc in (True, False) for m in micros]


def bench_config(name: str, log_runs: list) -> dict:
    c = CONFIGS[name]
    g_spec = spec_for(name, steps=c["steps"])
    t_spec = spec_for(name, steps=c["trl_steps"])
    grp, trl = [], {s: [] for s in trl_settings(c)}
    best = None
    for i in range(c["runs"]):
        r = run_worker("grpokit", g_spec)
        grp.append(r)
        log(f"{name} grpokit run {i + 1}: {r['s_per_opt_step']:.3f} s/step, rss {r['peak_rss_mb']:.0f} MB, "
            f"others {r['others_cores']:.2f} cores")
        if i >= c.get("trl_runs", c["runs"]):
            continue
        # TRL: every setting in the first round, then the fastest one only
        for gc, tuned, micro in (list(trl) if best is None else [best]):
            per_device = {"trl_per_device": micro} if micro else {}
            try:
                r = run_worker("trl", {**t_spec, "gc": gc, **per_device}, extra_env=MALLOC_TUNED if tuned else {})
            except RuntimeError as e:  # a setting this machine cannot run (the OOM killer): not TRL's best
                log(f"{name} {trl_label(gc, tuned, micro)}: {e}; left out")
                del trl[(gc, tuned, micro)]
                continue
            r["allocator_setting"] = tuned
            trl[(gc, tuned, micro)].append(r)
            log(f"{name} {trl_label(gc, tuned, micro)} run {len(trl[(gc, tuned, micro)])}: "
                f"{r['s_per_opt_step']:.3f} s/step, rss {r['peak_rss_mb']:.0f} MB, "
                f"others {r['others_cores']:.2f} cores")
        if best is None:
            if not trl:
                raise RuntimeError(f"{name}: TRL failed in every setting")
            best = min(trl, key=lambda s: trl[s][0]["s_per_opt_step"])
    log_runs.extend(grp + [r for runs in trl.values() for r in runs])
    return {"grpokit": grp, "trl": trl[best], "trl_gc": best[0], "trl_tuned": best[1], "trl_micro": best[2],
            "trl_other": {trl_label(*s): runs for s, runs in trl.items() if s != best and runs}}


def answer_lengths(c: dict) -> list[list[int]]:
    """Each measured generation batch's answer lengths for a configuration (CONFIGS' or a spec: B, G, L,
    steps, lengths): the forced ones (bench/lengths.py; batch 0 is the warm-up) or all the configured length."""
    N = c["B"] * c.get("G", COMMON["G"])
    if not c.get("lengths"):
        return [[c["L"]] * N]
    return [target_lengths(N, b, **REALISTIC) for b in range(1, 1 + c["steps"])]


def summarize(name: str, res: dict, peak: float, bandwidth: float, read_bw: float) -> dict:
    """Medians per system, with each phase's bound on this machine (flops.phase_bounds, averaged over the
    measured batches); `bandwidth` is the copy bandwidth (reported), `read_bw` the read bandwidth the decode
    bound uses."""
    c = CONFIGS[name]
    G = c.get("G", COMMON["G"])
    shape = model_shape(str(HERE / "out" / "models" / c["model"]))
    batches = answer_lengths(c)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    fl = mean([step_flops(shape, B=c["B"], G=G, P=PROMPT_TOKENS, T=c["L"], beta=c["beta"], mu=c["mu"],
                          lengths=lengths)["per_opt_step"] for lengths in batches])
    bound = mean_phase_bounds(shape, batches, B=c["B"], G=G, P=PROMPT_TOKENS, beta=c["beta"], mu=c["mu"],
                              peak_gflops=peak, read_gb_s=read_bw)
    answer_tokens = mean([sum(lengths) for lengths in batches])
    weight_bytes = 4 * (shape["P_body"] + shape["P_head"])  # fp32, read once per decode step (tied head: once)
    out = {"config": name, "flops_per_opt_step": fl, "trl_gc": res["trl_gc"], "trl_micro": res.get("trl_micro"),
           "trl_tuned": res.get("trl_tuned", bool(TRL_ENV)), "params": shape["P_body"] + shape["P_head"],
           "tokens_per_step": round(c["B"] * G * PROMPT_TOKENS + answer_tokens), "weight_bytes": weight_bytes,
           "answer_tokens": answer_tokens, "bound": bound}
    for system in ("grpokit", "trl"):
        runs = res[system]
        s = median_of(runs, "s_per_opt_step")
        out[system] = {
            "runs": len(runs), "s_per_opt_step": s, "rollout_s": median_of(runs, "rollout_s"),
            "train_s": median_of(runs, "train_s"),
            "tokens_per_s": answer_tokens / median_of(runs, "s_per_generation"),  # answer tokens, no padding
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "mfu": fl / s / (peak * 1e9),
            "all_s": [round(r["s_per_opt_step"], 3) for r in runs],
            "others_cores_max": max(r["others_cores"] for r in runs),
            "first_step": runs[0].get("first_step", {}),
            "mean_lengths": runs[0].get("mean_lengths"),  # the forced lengths' check: equal on both systems
        }
    out["trl_other"] = {label: {"s_per_opt_step": median_of(runs, "s_per_opt_step"),
                                "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}
                        for label, runs in res["trl_other"].items()}
    trl_rss = min([out["trl"]["peak_rss_mb"]] + [o["peak_rss_mb"] for o in out["trl_other"].values()])
    out["speedup"] = out["trl"]["s_per_opt_step"] / out["grpokit"]["s_per_opt_step"]
    out["memory_ratio"] = out["grpokit"]["peak_rss_mb"] / trl_rss
    return out


def table(rows: list[dict]) -> str:
    head = ("| config | system | s / opt. step (runs) | rollout s | train s | answer tok/s | MFU | peak RSS MB "
            "| others' load |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        for system in ("grpokit", "trl"):
            x = r[system]
            label = "grpokit" if system == "grpokit" else trl_label(r["trl_gc"], r["trl_tuned"], r["trl_micro"])
            lines.append(f"| {r['config']} | {label} | {x['s_per_opt_step']:.3f} ({', '.join(map(str, x['all_s']))}) "
                         f"| {x['rollout_s']:.3f} | {x['train_s']:.3f} | {x['tokens_per_s']:.0f} | {x['mfu']:.0%} "
                         f"| {x['peak_rss_mb']:.0f} | {x['others_cores_max']:.2f} |")
        for label, o in r["trl_other"].items():
            lines.append(f"| {r['config']} | {label} | {o['s_per_opt_step']:.3f} "
                         f"| | | | | {o['peak_rss_mb']:.0f} | |")
    lines += ["", "| config | speed-up (TRL s / grpokit s) | memory (grpokit / lower TRL peak RSS) |", "|---|---|---|"]
    lines += [f"| {r['config']} | {r['speedup']:.2f}x | {r['memory_ratio']:.2f}x |" for r in rows]
    return "\n".join(lines)


def run_ablations(peak: float, runs: int, match: str = "") -> list[dict]:
    """Every ablation row (whose label contains `match`) `runs` times, round-robin over the rows (slow drifts
    of the machine then touch every row alike); each row reports its median run."""
    chosen = [a for a in ABLATIONS if match in a[0]]
    done: dict[int, list[dict]] = {i: [] for i in range(len(chosen))}
    for round_ in range(runs):
        for i, (label, name, changes) in enumerate(chosen):
            c = CONFIGS[name]
            r = run_worker("grpokit", spec_for(name, steps=c["steps"], **changes))
            done[i].append(r)
            log(f"ablation [{name}] {label} (run {round_ + 1}): {r['s_per_opt_step']:.3f} s/step "
                f"(rollout {r['rollout_s']:.3f}, train {r['train_s']:.3f}), rss {r['peak_rss_mb']:.0f} MB")
    rows = []
    for i, (label, name, _) in enumerate(chosen):
        c, runs_i = CONFIGS[name], done[i]
        shape = model_shape(str(HERE / "out" / "models" / c["model"]))
        fl = {"per_opt_step": sum(step_flops(shape, B=c["B"], G=COMMON["G"], P=PROMPT_TOKENS, T=c["L"],
                                             beta=c["beta"], mu=c["mu"], lengths=lengths)["per_opt_step"]
                                  for lengths in answer_lengths(c)) / len(answer_lengths(c))}
        s = median_of(runs_i, "s_per_opt_step")
        rows.append({"label": label, "config": name, "s_per_opt_step": s, "rollout_s": median_of(runs_i, "rollout_s"),
                     "train_s": median_of(runs_i, "train_s"), "peak_rss_mb": max(r["peak_rss_mb"] for r in runs_i),
                     "others_cores": max(r["others_cores"] for r in runs_i),
                     "mfu": fl["per_opt_step"] / s / (peak * 1e9),
                     "all_s": [round(r["s_per_opt_step"], 3) for r in runs_i]})
    return rows


def bounds_table(rows: list[dict], peak: float, read_bw: float) -> str:
    """Each phase against its least possible time on this machine (flops.phase_bounds)."""
    lines = [f"Bounds: FLOPs at the fp32 matmul peak ({peak:.1f} GFLOP/s); a decode step at the larger of its FLOPs "
             f"at the peak and its weight + KV-cache bytes at the read bandwidth ({read_bw:.1f} GB/s).", "",
             "| config | phase | bound s | grpokit s | grpokit / bound | TRL s | TRL / bound |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        b, g, t = r["bound"], r["grpokit"], r["trl"]
        for phase, key in (("rollout (prefill + decode)", "rollout_s"), ("train (rewards, scoring, update)", "train_s"),
                           ("whole step", "s_per_opt_step")):
            bound = b[{"rollout_s": "rollout", "train_s": "train", "s_per_opt_step": "step"}[key]]
            lines.append(f"| {r['config']} | {phase} | {bound:.3f} | {g[key]:.3f} | {g[key] / bound:.2f}x "
                         f"| {t[key]:.3f} | {t[key] / bound:.2f}x |")
    return "\n".join(lines)


def growth_table(rows: list[dict]) -> str:
    """Seconds per step against parameters x tokens: how each system's cost grows with the work."""
    lines = ["| config | parameters | tokens / step (prompt + answer) | params x tokens | grpokit s / step "
             "| grpokit s per 1e12 | TRL s / step | TRL s per 1e12 | speed-up |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["params"] * r["tokens_per_step"]):
        work = r["params"] * r["tokens_per_step"]
        g, t = r["grpokit"]["s_per_opt_step"], r["trl"]["s_per_opt_step"]
        lines.append(f"| {r['config']} | {r['params'] / 1e6:.1f}M | {r['tokens_per_step']} | {work:.2e} | {g:.2f} "
                     f"| {g / work * 1e12:.2f} | {t:.2f} | {t / work * 1e12:.2f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def run_levers(rows: list[dict], runs: int, match: str = "") -> list[dict]:
    """Each lever (whose label contains `match`) on its configuration `runs` times, beside that configuration's
    main grpokit row (run here, as many times, when the main table did not have the configuration)."""
    out, bases = [], {r["config"]: r["grpokit"] for r in rows}
    for label, name, changes in [lever for lever in LEVERS if match in lever[0]]:
        c = CONFIGS[name]
        got = [run_worker("grpokit", spec_for(name, steps=c["steps"], **changes)) for _ in range(runs)]
        if name not in bases:
            bases[name] = summarize_grpokit([run_worker("grpokit", spec_for(name, steps=c["steps"]))
                                             for _ in range(runs)])
        base = bases[name]
        r = {"label": label, "config": name, **summarize_grpokit(got), "base": base}
        log(f"lever [{name}] {label}: {r['s_per_opt_step']:.3f} s/step, rss {r['peak_rss_mb']:.0f} MB")
        out.append(r)
    return out


def summarize_grpokit(runs: list[dict]) -> dict:
    return {"s_per_opt_step": median_of(runs, "s_per_opt_step"), "rollout_s": median_of(runs, "rollout_s"),
            "train_s": median_of(runs, "train_s"), "peak_rss_mb": max(x["peak_rss_mb"] for x in runs),
            "first_step": runs[0].get("first_step", {}), "all_s": [round(x["s_per_opt_step"], 3) for x in runs]}


def lever_table(rows: list[dict]) -> str:
    lines = ["| config | grpokit with | s / opt. step (runs) | rollout s | train s | peak RSS MB "
             "| against plain grpokit | first step's grad norm (plain) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["base"]
        vs = (f"{r['s_per_opt_step'] / b['s_per_opt_step']:.2f}x the time, {r['peak_rss_mb'] / b['peak_rss_mb']:.2f}x "
              f"the memory ({b['s_per_opt_step']:.3f} s, {b['peak_rss_mb']:.0f} MB)")
        gn, gb = r["first_step"].get("grad_norm"), b.get("first_step", {}).get("grad_norm")
        norms = f"{gn:.6g} ({gb:.6g})" if gn is not None and gb is not None else ""
        lines.append(f"| {r['config']} | {r['label']} | {r['s_per_opt_step']:.3f} ({', '.join(map(str, r['all_s']))}) "
                     f"| {r['rollout_s']:.3f} | {r['train_s']:.3f} | {r['peak_rss_mb']:.0f} | {vs} | {norms} |")
    return "\n".join(lines)


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

    from grpokit.models.cpu import cpu_description

    return {**cpu_description(), "cores": os.cpu_count(), "mem_gb": round(os.sysconf("SC_PAGE_SIZE") *
                                                                  os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="S,M,R,X", help="comma-separated configurations")
    ap.add_argument("--ablations", action="store_true", help="also run the grpokit ablation rows")
    ap.add_argument("--ablations-only", action="store_true")
    ap.add_argument("--ablation-runs", type=int, default=3, help="runs per ablation row (the median is reported)")
    ap.add_argument("--ablation-match", default="", help="only the ablation rows whose label contains this text")
    ap.add_argument("--malloc-study", action="store_true",
                    help="also S and M with glibc malloc tuned for both systems (MALLOC_TUNED)")
    ap.add_argument("--levers", action="store_true", help="also the memory levers (LEVERS) on X and L, grpokit only")
    ap.add_argument("--lever-runs", type=int, default=1)
    ap.add_argument("--lever-match", default="", help="only the levers whose label contains this text")
    ap.add_argument("--trl-malloc-tuned", action="store_true",
                    help="TRL runs with glibc's freed memory kept (MALLOC_TUNED), as grpokit does by itself")
    ap.add_argument("--trl-fastest-known", action="store_true",
                    help="TRL in one setting only, gradient checkpointing off with the allocator setting: its fastest "
                         "on M, X and L in every earlier run, within 2%% of gc=on on S (L's four settings take 20 "
                         "minutes of TRL alone)")
    args = ap.parse_args()
    TRL_ONLY.extend([(False, True)] if args.trl_fastest_known else [])
    TRL_ENV.update(MALLOC_TUNED if args.trl_malloc_tuned else {})
    stamp = time.strftime("%Y%m%d-%H%M%S")
    start_load = load()
    log("building models (cached in bench/out/models)")
    only = [n for n in args.only.split(",") if n]  # --only "": no main table (with --levers: the levers alone)
    wanted = set(only) | ({name for _, name, _ in LEVERS} if args.levers else set())
    large = [CONFIGS[n]["model"] for n in sorted(wanted) if CONFIGS[n]["model"] in LARGE_MODELS]
    subprocess.run([PY, str(HERE / "build_models.py"), *large], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    wait_quiet()
    peak_start = matmul_peak(COMMON["threads"])
    bw_start, read_start = measured_bandwidth(COMMON["threads"])
    log(f"fp32 matmul peak ({COMMON['threads']} threads): {peak_start:.1f} GFLOP/s; copy bandwidth "
        f"{bw_start:.1f} GB/s, read bandwidth {read_start:.1f} GB/s")
    results, runs = [], []
    if not args.ablations_only:
        for name in only:
            results.append(bench_config(name, runs))
            # each configuration's raw runs as soon as it is done (a later crash must not lose them)
            (HERE / "out" / f"runs-{stamp}.json").write_text(json.dumps(runs, indent=1))
    wait_quiet()
    peak_end = matmul_peak(COMMON["threads"])
    bw_end, read_end = measured_bandwidth(COMMON["threads"])
    peak, bandwidth = max(peak_start, peak_end), max(bw_start, bw_end)  # the higher: the conservative MFU / share
    read_bw = max(read_start, read_end)
    log(f"fp32 matmul peak at the end: {peak_end:.1f} GFLOP/s; MFU uses {peak:.1f}; copy bandwidth {bw_end:.1f} GB/s, "
        f"read bandwidth {read_end:.1f} GB/s")
    names = [] if args.ablations_only else only
    rows = [summarize(n, r, peak, bandwidth, read_bw) for n, r in zip(names, results)]
    levers = run_levers(rows, args.lever_runs, args.lever_match) if args.levers else []
    abl = run_ablations(peak, args.ablation_runs, args.ablation_match) if args.ablations or args.ablations_only else []
    mal = malloc_study(rows) if args.malloc_study else []
    report = {"trl_env": TRL_ENV, "machine": machine(), "load_start": start_load, "load_end": load(),
              "peak_gflops": peak, "peak_start": peak_start, "peak_end": peak_end, "bandwidth_gb_s": bandwidth,
              "bandwidth_start": bw_start, "bandwidth_end": bw_end, "read_bandwidth_gb_s": read_bw, "rows": rows,
              "levers": levers,
              "ablations": abl, "malloc": mal, "runs": runs, "configs": CONFIGS, "common": COMMON}
    out = HERE / "out"
    (out / f"results-{stamp}.json").write_text(json.dumps(report, indent=1))
    md = [f"TRL environment: {TRL_ENV or 'default'}", f"machine: {report['machine']}",
          f"load average (1/5/15 min) at start: {start_load}; at end: {load()}",
          f"fp32 matmul peak: {peak_start:.1f} GFLOP/s at start, {peak_end:.1f} at end",
          f"copy bandwidth: {bw_start:.1f} GB/s at start, {bw_end:.1f} at end; read bandwidth {read_start:.1f} / "
          f"{read_end:.1f}", ""]
    if rows:
        md += [table(rows), "", bounds_table(rows, peak, read_bw), "", growth_table(rows)]
    if levers:
        md += ["", lever_table(levers)]
    if abl:
        md += ["", ablation_table(abl)]
    if mal:
        md += ["", malloc_table(mal)]
    (out / f"results-{stamp}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
