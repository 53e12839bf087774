"""Where a bench/ configuration's training phase spends its time: torch.profiler around one optimizer step
(the second: the first warms up), self time per operator, matmuls summed apart.

    .venv/bin/python bench/profile_train.py M       # M: about 1 minute; L: about 3 minutes, 15 GB

The profiler adds its own cost (L's phase: 37 s profiled against 32.5 s in bench/run.py), so read shares, not
seconds. Run it alone, with the environment bench/run.py gives grpokit (OMP_NUM_THREADS=2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as bench_run  # noqa: E402

MATMUL = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", choices=sorted(bench_run.CONFIGS), help="a configuration of bench/run.py")
    parser.add_argument("--top", type=int, default=20, help="operators to list (default: 20)")
    args = parser.parse_args()
    import run_grpokit
    import torch.profiler as tp

    import grpokit.training.loop as loop

    optimize, calls = loop.optimize, []

    def profiled(*a, **k):
        calls.append(1)
        if len(calls) < 2:
            return optimize(*a, **k)
        with tp.profile(activities=[tp.ProfilerActivity.CPU]) as prof:
            out = optimize(*a, **k)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ops) / 1e6
        matmul = sum(e.self_cpu_time_total for e in ops if e.key in MATMUL) / 1e6
        print(f"{args.config}'s training phase, profiled: {total:.2f} s, of which matmuls {matmul:.2f} s", flush=True)
        for e in ops[:args.top]:
            print(f"  {e.key[:60]:60s} {e.self_cpu_time_total / 1e6:7.3f} s  {e.count} calls", flush=True)
        return out

    loop.optimize = profiled
    run_grpokit.main(bench_run.spec_for(args.config, steps=1))


if __name__ == "__main__":
    main()
