"""What makes grpokit's small-model step (S) depend on the host: its per-operation costs, measured.

S (a 2-layer, 64-wide model; 32 answers of 16 tokens) runs at 3-5x its FLOP and bandwidth bound
(bench/quick.py prints the bounds): its step is thousands of small tensor operations, each paying a fixed
cost that the machine's peak does not show: torch's dispatch, and for an operation above torch's grain size
(32768 elements) a fork and join of the OpenMP threads, whose wake-up latency depends on the host (a KVM
guest's vCPUs, what else runs on the physical cores). TRL's step on S is mostly single-threaded Python
around `generate`, which moves less between hosts. This script measures both sides on the host it runs on:

1. per-operation costs (`op_costs`, in a process of its own with 2 threads and with 1): an add below the
   grain size (dispatch only), an add above it (dispatch + fork/join), a [32, 64] x [64, 64] matmul and S's
   decode-step head product ([32, 64] x [64, 32000], oneDNN on the packed weight, as the decode runs it);
2. grpokit on S in four thread settings, alternating, 3 runs each: 2 threads (the default), 1 thread,
   2 threads with `GOMP_SPINCOUNT=0` (a thread sleeps at once after each parallel region, so every region
   pays a wake-up) and with `OMP_WAIT_POLICY=active` (threads spin between regions).

A host whose wake-ups are slow shows it in the fork/join cost and in the gap between the default and the
sleeping setting; compare S's figures across hosts together with these costs (bench/quick.py records them).

    .venv/bin/python bench/host_sensitivity.py        # about 3 minutes; run it alone
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

OP_COSTS_CODE = """
import json, time, torch
torch.set_num_threads({threads})
def per_call(f, reps):
    for _ in range(200): f()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps): f()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6
small, big = torch.randn(1024), torch.randn(262144)
out_s, out_b = torch.empty_like(small), torch.empty_like(big)
x, w = torch.randn(32, 64), torch.randn(64, 64)
head = torch.ops.mkldnn._reorder_linear_weight(torch.randn(32000, 64), 32)  # packed, as the decode runs it
linear = torch.ops.mkldnn._linear_pointwise
print(json.dumps({{
    "add_1k_us": per_call(lambda: torch.add(small, small, out=out_s), 20000),
    "add_256k_us": per_call(lambda: torch.add(big, big, out=out_b), 2000),
    "matmul_32x64x64_us": per_call(lambda: x @ w, 20000),
    "packed_head_32x64x32000_us": per_call(lambda: linear(x, head, None, "none", [], ""), 500),
}}))
"""


def op_costs(threads: int) -> dict:
    """Microseconds per call of four small operations with `threads` threads (a process of its own: the
    thread count is fixed at torch's first parallel region)."""
    from run import PY

    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    out = subprocess.run([PY, "-c", OP_COSTS_CODE.format(threads=threads)], check=True, capture_output=True,
                         text=True, env=env).stdout
    return {k: round(v, 2) for k, v in json.loads(out.splitlines()[-1]).items()}


def host_costs() -> dict:
    """The per-operation costs with 2 threads and 1 (bench/quick.py records them with its figures)."""
    return {"2 threads": op_costs(2), "1 thread": op_costs(1)}


SETTINGS = [("2 threads (default)", {}, {}), ("1 thread", {"threads": 1}, {}),
            ("2 threads, GOMP_SPINCOUNT=0 (sleep after each region)", {}, {"GOMP_SPINCOUNT": "0"}),
            ("2 threads, OMP_WAIT_POLICY=active (spin)", {}, {"OMP_WAIT_POLICY": "active"})]


def main() -> None:
    import run
    from run import CONFIGS, load, log, machine, run_worker, spec_for

    run.QUIET_WAIT_S = 30.0
    started, start_load = time.perf_counter(), load()
    run.wait_quiet()
    costs = host_costs()
    log(f"per-operation costs (us): {json.dumps(costs)}")
    s = spec_for("S", steps=CONFIGS["S"]["steps"])
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in SETTINGS}
    for i in range(3):
        for label, changes, env in SETTINGS:
            r = run_worker("grpokit", {**s, **changes}, extra_env=env, tries=2)
            runs[label].append(r)
            log(f"S run {i + 1}, {label}: {r['s_per_opt_step']:.3f} s/step (rollout {r['rollout_s']:.3f}, "
                f"train {r['train_s']:.3f})")
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    rows = {label: {"s_per_opt_step": med(rs, "s_per_opt_step"), "rollout_s": med(rs, "rollout_s"),
                    "train_s": med(rs, "train_s"), "all": [round(r["s_per_opt_step"], 4) for r in rs],
                    "others_cores_max": max(r["others_cores"] for r in rs)} for label, rs in runs.items()}
    report = {"machine": machine(), "load_start": start_load, "load_end": load(), "op_costs_us": costs,
              "rows": rows, "seconds": time.perf_counter() - started}
    out = HERE / "out" / f"host-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(report, indent=1))
    m = report["machine"]
    print(f"\n{m['cpu']} ({m['isa']}), {m['cores']} cores, torch {m['torch']}; load {start_load} -> "
          f"{report['load_end']}; {report['seconds']:.0f} s")
    print("| operation | us per call, 2 threads | 1 thread |\n|---|---|---|")
    for k in costs["2 threads"]:
        print(f"| {k} | {costs['2 threads'][k]:.2f} | {costs['1 thread'][k]:.2f} |")
    base = rows[SETTINGS[0][0]]["s_per_opt_step"]
    print("\n| grpokit on S | s / step (3 runs) | rollout s | train s | against the default | others' load |")
    print("|---|---|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['s_per_opt_step']:.4f} ({', '.join(f'{x:.3f}' for x in r['all'])}) "
              f"| {r['rollout_s']:.4f} | {r['train_s']:.4f} | {r['s_per_opt_step'] / base:.2f}x "
              f"| {r['others_cores_max']:.2f} |")
    print(f"raw: {out}")


if __name__ == "__main__":
    main()
