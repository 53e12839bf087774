"""Does asynchronous rollout learn as well as sync? The demos' held-out accuracy, sync against async.

    .venv/bin/python bench/async_learning.py tools 0 1 2        # the tool demo, seeds 0-2, every mode
    .venv/bin/python bench/async_learning.py addition 0 --modes async1

Each run is the demo as `grpokit demo` runs it (its warm start, its GRPO schedule, its held-out
evaluation before and after, same sampling settings), with the GRPO stage in one of the modes below;
its summary (before / after, seconds) is appended to bench/out/async-learning.jsonl with the machine
and the load. Wall times are only comparable between runs on a quiet machine (the load is recorded).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import load, machine  # noqa: E402

MODES = {"sync": {}, "async1": {"mode": "async", "max_staleness": 1}, "async4": {"mode": "async", "max_staleness": 4}}


def main() -> None:
    args = sys.argv[1:]
    demo, rest = args[0], args[1:]
    modes = rest[rest.index("--modes") + 1].split(",") if "--modes" in rest else list(MODES)
    seeds = [int(a) for a in rest if a.isdigit()] or [0]
    if demo == "tools":
        from grpokit.demo_tools import run_tool_demo as run_demo
    else:
        from grpokit.demo import run_demo
    out = HERE / "out" / "async-learning.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        for mode in modes:
            start_load = load()
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                summary = run_demo(Path(tmp) / "demo", seed=seed, rollout=MODES[mode])
                steps = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
                row = {"demo": demo, "seed": seed, "mode": mode, "rollout": MODES[mode], "before": summary["before"],
                       "after": summary["after"], "seconds": time.perf_counter() - t0,
                       "grpo_steps": summary["grpo_steps"], "grpo_seconds": sum(r["time/step"] for r in steps),
                       "staleness_mean": sum(r.get("async/staleness_mean", 0) for r in steps) / len(steps),
                       "load_start": start_load, "load_end": load(),
                       "machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{demo} seed {seed} {mode}: accuracy {row['before']['accuracy']:.3f} -> "
                  f"{row['after']['accuracy']:.3f} in {row['seconds']:.0f} s, GRPO {row['grpo_seconds']:.0f} s "
                  f"(load {start_load})", flush=True)


if __name__ == "__main__":
    main()
