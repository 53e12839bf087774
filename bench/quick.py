"""The speed test for regressions: grpokit against TRL's GRPOTrainer on S (long and short prompts, fixed and
realistic answer lengths) and on the demo's GRPO step, in one invocation, in about ten minutes. CI does not
run it; run it after each performance change and record its figure in BENCHMARKS.md.

    .venv/bin/python bench/quick.py          # waits at most 30 s for a quiet machine before each run
    .venv/bin/python bench/quick.py 0        # does not wait (the others' load column says what it cost)
    .venv/bin/python bench/quick.py 30 SV    # only these configurations

S is bench/run.py's configuration S (64-wide 2-layer Qwen2, 32k BPE vocabulary, 4 prompts x G8 x 16
tokens, 32-token prompts); S6 is S with the prompts cut to their first 6 tokens (grpokit's shared prefill
saves less); SV is S with realistic answer lengths (bench/lengths.py: 16-512 tokens, log-normal with
median 64, ending at EOS, the same lengths forced on both systems). D is `grpokit demo`'s GRPO step: its
model (grpokit.demo.MODEL) and character tokenizer, 16 addition prompts x G8 x 6 tokens, on random
weights (both systems do the same work: answers have the full length, the reward never ties). Each
system runs 3 times, alternating, each run in its own process; TRL runs without gradient checkpointing
(its faster setting at these sizes) and with the allocator setting grpokit applies to itself, and its
first run tries every micro-batch size in TRL_MICRO (answers per micro-step; gradient accumulation does
the rest), the later ones its fastest. The CPU, its vector instructions and the load are printed with the
ratio: compare figures only from one invocation. Each phase (rollout, train, whole step) is printed next to
its least possible time on this machine (flops.phase_bounds: FLOPs at the fp32 matmul peak, measured at the
start; a decode step at the larger of that and its weight + KV-cache bytes at the measured read bandwidth),
as bench/run.py prints it for its configurations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run  # noqa: E402
from flops import matmul_peak, mean_phase_bounds, model_shape  # noqa: E402
from host_sensitivity import host_costs  # noqa: E402
from run import (  # noqa: E402
    COMMON,
    CONFIGS,
    MALLOC_TUNED,
    PROMPT_TOKENS,
    PY,
    REALISTIC,
    ROOT,
    answer_lengths,
    bounds_table,
    load,
    log,
    machine,
    measured_bandwidth,
    median_of,
    run_worker,
    spec_for,
)

DEMO_MODEL = HERE / "out" / "models" / "D"
RUNS = 3


def build_demo_model() -> None:
    """The demo's model (grpokit.demo.MODEL) and 512 held-in addition prompts, once."""
    from grpokit.demo import MODEL, TASK

    stamp = json.dumps({"model": MODEL, "task": TASK}, sort_keys=True)  # the demo's settings change: rebuild
    if (DEMO_MODEL / "prompts.json").is_file() and (DEMO_MODEL / "demo.json").is_file() \
            and (DEMO_MODEL / "demo.json").read_text() == stamp:
        return
    code = ("import json, sys; from grpokit.demo import MODEL, TASK; from grpokit.models.tiny import build_tiny_model;"
            " from grpokit.tasks import get_task; p = sys.argv[1]; build_tiny_model(p, **MODEL, seed=0);"
            " args = {k: v for k, v in TASK.items() if k != 'name'};"
            " rows = get_task(TASK['name'], **args).generate(512, seed=0, split='train');"
            " open(p + '/prompts.json', 'w').write(json.dumps([{'prompt': r['prompt']} for r in rows]))")
    subprocess.run([PY, "-c", code, str(DEMO_MODEL)], check=True, capture_output=True,
                   env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    (DEMO_MODEL / "demo.json").write_text(stamp)


def specs() -> dict[str, dict]:
    s = spec_for("S", steps=CONFIGS["S"]["steps"])
    s6 = {**s, "name": "S6", "prompt_tokens": 6}
    sv = {**s, "name": "SV", "L": REALISTIC["hi"], "lengths": REALISTIC, "steps": 1}  # both measure batch 1
    d = {**s, "name": "D", "model": "D", "B": 16, "G": 8, "L": 6, "steps": 10, "reward": "digit_mean",
         "grpokit_train": {}, "grpokit_algorithm": {}}
    return {"S": s, "S6": s6, "SV": sv, "D": d}


def trl_micro(spec: dict) -> tuple[int, ...]:
    """TRL's micro-batch sizes to try: 8 answers per micro-step (gradient accumulation for the rest) and the
    whole batch in one."""
    return tuple(sorted({8, spec["B"] * spec["G"]}))


def bound_of(spec: dict, peak: float, read_bw: float) -> dict:
    """Each phase's least possible time for `spec` on this machine (flops.phase_bounds), averaged over the
    measured batches (run.answer_lengths)."""
    from common import load_rows
    from transformers import AutoTokenizer

    path = str(HERE / "out" / "models" / spec["model"])
    if spec["model"] == "D":  # the demo's own prompts: their mean length in its character tokenizer
        tok = AutoTokenizer.from_pretrained(path)
        rows = load_rows(spec["B"], "D")
        P = round(sum(len(tok(r["prompt"]).input_ids) for r in rows) / len(rows))
    else:
        P = spec.get("prompt_tokens") or PROMPT_TOKENS
    return mean_phase_bounds(model_shape(path), answer_lengths(spec), B=spec["B"], G=spec["G"], P=P,
                             beta=spec["beta"], mu=spec["mu"], peak_gflops=peak, read_gb_s=read_bw)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = list(specs())
    parser = argparse.ArgumentParser(description="grpokit against TRL on S, S6, SV and D, in one invocation.")
    parser.add_argument("wait_s", nargs="?", type=float, default=30.0,
                        help="wait at most this many seconds for a quiet machine before each run (0: do not wait; "
                             "the others' load column says what it cost) (default: 30)")
    parser.add_argument("only", nargs="?", default=",".join(names),
                        help=f"comma-separated configurations to run, of {','.join(names)} (default: all)")
    args = parser.parse_args(argv)
    if args.wait_s < 0:
        parser.error(f"wait_s: must be 0 or more seconds, got {args.wait_s:g}")
    unknown = [n for n in args.only.split(",") if n not in names]
    if unknown:
        parser.error(f"only: unknown configuration {','.join(unknown)}; choose from {','.join(names)}")
    return args


def main() -> None:
    args = parse_args()
    run.QUIET_WAIT_S = args.wait_s  # a busy machine: measured, and said
    started, start_load = time.perf_counter(), load()
    subprocess.run([PY, str(HERE / "build_models.py")], check=True, capture_output=True,
                   env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    build_demo_model()
    run.wait_quiet()
    peak, (_, read_bw) = matmul_peak(COMMON["threads"]), measured_bandwidth(COMMON["threads"])
    costs = host_costs()  # what the small configurations pay per operation on this host (bench/host_sensitivity.py)
    log(f"fp32 matmul peak {peak:.1f} GFLOP/s, read bandwidth {read_bw:.1f} GB/s; per-operation costs (us): "
        f"{json.dumps(costs)}")
    rows, phases = {}, []
    only = args.only.split(",")
    for name, spec in [(n, s) for n, s in specs().items() if n in only]:
        g, t, tried = [], [], {}
        trl_spec = {**spec, "steps": 3 if name == "D" else spec["steps"], "gc": False}
        trl_run = lambda micro: run_worker("trl", {**trl_spec, "trl_per_device": micro}, extra_env=MALLOC_TUNED,  # noqa: E731
                                           tries=2)
        for i in range(RUNS):
            g.append(run_worker("grpokit", spec, tries=2))
            if i == 0:  # every micro-batch size once; the fastest is TRL's from here on
                for micro in trl_micro(spec):
                    tried[micro] = trl_run(micro)
                    log(f"{name} TRL, {micro} answers per micro-step: {tried[micro]['s_per_opt_step']:.3f} s/step")
                best = min(tried, key=lambda m: tried[m]["s_per_opt_step"])
                t.append(tried[best])
            else:
                t.append(trl_run(best))
            log(f"{name} run {i + 1}: grpokit {g[-1]['s_per_opt_step']:.3f} s/step, TRL {t[-1]['s_per_opt_step']:.3f}")
        gs, ts = (statistics.median(r["s_per_opt_step"] for r in runs) for runs in (g, t))
        rows[name] = {"grpokit_s": gs, "trl_s": ts, "speedup": ts / gs, "trl_micro": best,
                      "trl_first_run": {m: round(r["s_per_opt_step"], 4) for m, r in tried.items()},
                      "others_cores_max": max(r["others_cores"] for r in g + t),
                      "grpokit_all": [round(r["s_per_opt_step"], 4) for r in g],
                      "trl_all": [round(r["s_per_opt_step"], 4) for r in t]}
        medians = lambda runs: {k: median_of(runs, k) for k in ("rollout_s", "train_s", "s_per_opt_step")}  # noqa: E731
        phases.append({"config": name, "bound": bound_of(spec, peak, read_bw), "grpokit": medians(g),
                       "trl": medians(t)})
        rows[name]["bound"] = phases[-1]["bound"]
    report = {"machine": machine(), "load_start": start_load, "load_end": load(), "rows": rows,
              "peak_gflops": peak, "read_gb_s": read_bw, "op_costs_us": costs, "seconds": time.perf_counter() - started}
    out = HERE / "out" / f"quick-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=1))
    m = report["machine"]
    print(f"\n{m['cpu']} ({m['isa']}), {m['cores']} cores, torch {m['torch']}, TRL {m['trl']}; "
          f"load {start_load} -> {report['load_end']}; {report['seconds']:.0f} s; per-operation costs (us, "
          f"2 threads): {json.dumps(costs['2 threads'])}")
    print("| config | grpokit s / step | TRL s / step (gc off, allocator setting) | TRL answers per micro-step "
          "(first run: s / step each) | speed-up | others' load |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        tried = ", ".join(f"{m}: {v:.3f}" for m, v in r["trl_first_run"].items())
        print(f"| {name} | {r['grpokit_s']:.4f} | {r['trl_s']:.4f} | {r['trl_micro']} ({tried}) "
              f"| **{r['speedup']:.2f}x** | {r['others_cores_max']:.2f} |")
    print()
    print(bounds_table(phases, peak, read_bw))
    print(f"raw: {out}")


if __name__ == "__main__":
    main()
