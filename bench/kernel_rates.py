"""What fp32 matmuls sustain on this CPU, against the peak bench/ divides by, and which kernel is faster at L's
training shapes: the measurements behind "the bound is a burst" (BENCHMARKS.md, 2026-12-07).

    .venv/bin/python bench/kernel_rates.py      # about 90 s, 2 threads; run it alone

bench/flops.matmul_peak takes the best of 12 short blocks of a 2048^3 product: on a host whose clock drops under
sustained vector load, that is a burst. Here the same product runs product by product for a while (best, median,
slowest), then each of L's training products (2560 rows: forward, input gradient, weight gradient) through aten
and through oneDNN's `_linear_pointwise`, the two kernels `train.onednn_linear` chooses between.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import matmul_peak  # noqa: E402

# L (Qwen2.5-0.5B's shapes): q/o, k/v, gate/up, down; 2560 rows = a micro-batch of 8 x (64 + 256) tokens
L_SHAPES = [(2560, 896, 896), (2560, 896, 128), (2560, 896, 4864), (2560, 4864, 896)]


def rates(fn, flops: float, seconds: float) -> tuple[float, float, float]:
    """(best, median, slowest) GFLOP/s of `fn` called back to back for `seconds`."""
    fn()
    per, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        per.append(flops / (time.perf_counter() - t) / 1e9)
    return max(per), statistics.median(per), min(per)


def median_rate(fn, flops: float, seconds: float = 1.5) -> float:
    """Median GFLOP/s of `fn` called back to back for `seconds`."""
    return rates(fn, flops, seconds)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the 2048^3 product runs (default: 30)")
    args = parser.parse_args()
    if args.seconds <= 0:
        parser.error(f"--seconds: must be more than 0, got {args.seconds:g}")
    torch.set_num_threads(2)
    n = 2048
    a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    print(f"bench/flops.matmul_peak (best of 12 blocks): {matmul_peak(2):.0f} GFLOP/s")
    best, median, slowest = rates(lambda: torch.mm(a, b, out=out), 2 * n ** 3, args.seconds)
    print(f"2048^3, product by product for {args.seconds:g} s: best {best:.0f}, median {median:.0f}, "
          f"slowest {slowest:.0f} GFLOP/s")
    linear = torch.ops.mkldnn._linear_pointwise
    print("| L's product | forward aten / oneDNN | input gradient aten / oneDNN | weight gradient aten |")
    print("|---|---|---|---|")
    for rows, k, n_out in L_SHAPES:
        x, w, g = torch.randn(rows, k), torch.randn(n_out, k), torch.randn(rows, n_out)
        wt, flops = w.t().contiguous(), 2 * rows * k * n_out
        fwd = (median_rate(lambda: F.linear(x, w), flops),  # noqa: B023
               median_rate(lambda: linear(x, w, None, "none", [], ""), flops))  # noqa: B023
        dx = (median_rate(lambda: g.mm(w), flops),  # noqa: B023
              median_rate(lambda: linear(g, wt, None, "none", [], ""), flops))  # noqa: B023
        dw = median_rate(lambda: g.t().mm(x), flops)  # noqa: B023
        print(f"| [{rows}, {k}] x [{k}, {n_out}] | {fwd[0]:.0f} / {fwd[1]:.0f} | {dx[0]:.0f} / {dx[1]:.0f} | "
              f"{dw:.0f} |")


if __name__ == "__main__":
    main()
