"""Sync against asynchronous rollout on this CPU, side by side in one invocation: time per optimizer step
and each side's idle share, on the demo's model (D), S and M (bench/run.py's configurations).

    .venv/bin/python bench/async_rollout.py            # D, S, M; waits up to 30 s for a quiet machine per run
    .venv/bin/python bench/async_rollout.py D S 0      # only D and S, no waiting

Each configuration runs: sync with 2 threads (the loop takes turns: sample, then train, each on both
cores), async with max_staleness 1 (one worker process with 1 thread samples while the trainer, with 1
thread, updates), and async with max_staleness 0 (the same split, but each batch waits for the newest
weights: what the process split alone costs). 3 runs each, alternating, each in its own process; the
first steps are warm-up (the worker starts, the pipeline fills) and are not counted. The CPU, its
vector instructions and the load are printed with the figures.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run  # noqa: E402
from quick import build_demo_model, specs  # noqa: E402
from run import PY, ROOT, load, log, machine, run_worker, spec_for  # noqa: E402

RUNS = 3
MODES = {  # label -> spec changes
    "sync (2 threads)": {"threads": 2},
    "async K=1 (1 + 1 threads)": {"threads": 2, "grpokit_train": {"num_threads": 1},
                                  "grpokit_rollout": {"mode": "async", "max_staleness": 1, "worker_threads": 1}},
    "async K=0 (1 + 1 threads)": {"threads": 2, "grpokit_train": {"num_threads": 1},
                                  "grpokit_rollout": {"mode": "async", "max_staleness": 0, "worker_threads": 1}},
}


def configurations(names: list[str]) -> dict[str, dict]:
    d = specs()["D"]
    every = {"D": {**d, "steps": 12, "warmup": 3}, "S": {**spec_for("S"), "steps": 12, "warmup": 3},
             "M": {**spec_for("M"), "steps": 5, "warmup": 2}}
    return {n: every[n] for n in names}


def with_changes(spec: dict, changes: dict) -> dict:
    out = dict(spec)
    for k, v in changes.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def main() -> None:
    args = sys.argv[1:]
    names = [a for a in args if a in ("D", "S", "M")] or ["D", "S", "M"]
    waits = [a for a in args if a not in names]
    run.QUIET_WAIT_S = float(waits[0]) if waits else 30.0
    started, start_load = time.perf_counter(), load()
    subprocess.run([PY, str(HERE / "build_models.py")], check=True, capture_output=True,
                   env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    build_demo_model()
    table = {}
    for name, spec in configurations(names).items():
        results = {label: [] for label in MODES}
        for i in range(RUNS):
            for label, changes in MODES.items():
                results[label].append(run_worker("grpokit", with_changes(spec, changes), tries=2))
                r = results[label][-1]
                log(f"{name} run {i + 1} {label}: {r['s_per_opt_step']:.3f} s/step (trainer idle "
                    f"{r['trainer_idle_s']:.3f} s, sampler idle {r['sampler_idle_s']:.3f} s)")
        table[name] = {}
        for label, rs in results.items():
            step = statistics.median(r["s_per_opt_step"] for r in rs)
            table[name][label] = {
                "s_per_step": step, "all": [round(r["s_per_opt_step"], 4) for r in rs],
                "rollout_s": statistics.median(r["rollout_s"] for r in rs),
                "trainer_idle_share": statistics.median(r["trainer_idle_s"] / r["s_per_opt_step"] for r in rs),
                "sampler_idle_share": statistics.median(r["sampler_idle_s"] / r["s_per_opt_step"] for r in rs),
                "others_cores_max": max(r["others_cores"] for r in rs),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in rs)}
        base = table[name]["sync (2 threads)"]["s_per_step"]
        for label in MODES:
            table[name][label]["speedup_vs_sync"] = base / table[name][label]["s_per_step"]
    report = {"machine": machine(), "load_start": start_load, "load_end": load(), "table": table,
              "seconds": time.perf_counter() - started}
    out = HERE / "out" / f"async-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=1))
    m = report["machine"]
    print(f"\n{m['cpu']} ({m['isa']}), {m['cores']} cores, torch {m['torch']}; load {start_load} -> "
          f"{report['load_end']}; {report['seconds']:.0f} s; {out}")
    print(f"{'config':6} {'mode':28} {'s/step':>8} {'vs sync':>8} {'trainer idle':>13} {'sampler idle':>13} "
          f"{'others':>7}")
    for name, rows in table.items():
        for label, r in rows.items():
            print(f"{name:6} {label:28} {r['s_per_step']:8.3f} {r['speedup_vs_sync']:7.2f}x "
                  f"{r['trainer_idle_share']:12.0%} {r['sampler_idle_share']:12.0%} {r['others_cores_max']:7.2f}")


if __name__ == "__main__":
    main()
