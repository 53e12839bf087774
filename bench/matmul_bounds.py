"""What the matmuls of configuration M can reach on this CPU: the bound on M's MFU.

    .venv/bin/python bench/matmul_bounds.py        # about 30 s, 2 threads

MFU (bench/run.py) divides M's model FLOPs by the fp32 peak of a 2048^3 matmul. The step's matmuls
are not that shape: a decode step multiplies the 64 active answers ([64, 256]) by every weight, and
training multiplies 1280-row micro-batches by 256-wide weights. This times each of M's matmul shapes
alone, with the kernel grpokit uses for it (the packed oneDNN weight in the decode, oneDNN for the
training forward and input gradient, aten for weight gradients and the fused head), and prints the
MFU the step would have if every FLOP ran at its shape's measured speed and nothing else cost time:
an upper bound no system reaches with these kernels on this CPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import matmul_peak  # noqa: E402

H, INTER, KV, V, LAYERS = 256, 1024, 128, 32000, 6  # M: bpe 256 wide, 6 layers, 2 of 4 heads for k/v
N, PROMPT, T, MICRO_ROWS, HEAD_CHUNK = 64, 32, 128, 8 * (32 + 128), 1024


def _time(fn, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _shape(rows: int, k: int, n: int, kind: str) -> float:
    """GFLOP/s of x [rows, k] @ W [k, n] with the kernel grpokit uses for `kind`."""
    x, w = torch.randn(rows, k), torch.randn(n, k)  # w as nn.Linear stores it: [out, in]
    if kind == "packed":  # the decode: oneDNN on a weight reordered once
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        fn = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
    elif kind == "onednn":  # training forward / input gradient
        fn = lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    else:  # aten: weight gradients, the fused head
        out = torch.empty(rows, n)
        fn = lambda: torch.mm(x, w.t(), out=out)  # noqa: E731
    return 2 * rows * k * n / _time(fn) / 1e9


def main() -> None:
    torch.set_num_threads(2)
    peak = matmul_peak(2)
    body = [(H, H), (H, KV), (H, KV), (H, H), (H, INTER), (H, INTER), (INTER, H)]  # q k v o gate up down
    rows = []  # (phase, shape, kind, FLOPs per step, GFLOP/s)
    decode_tokens, train_tokens, head_tokens = N * T, N * (PROMPT + T), N * T
    for k, n in body:
        f = 2 * k * n * LAYERS * decode_tokens
        rows.append(("decode", f"[{N},{k}]x[{k},{n}]", "packed", f, _shape(N, k, n, "packed")))
        # training: forward (oneDNN) + input gradient (oneDNN, the transposed shape) + weight gradient (aten)
        f = 2 * k * n * LAYERS * train_tokens
        rows.append(("train fwd", f"[{MICRO_ROWS},{k}]x[{k},{n}]", "onednn", f, _shape(MICRO_ROWS, k, n, "onednn")))
        rows.append(("train dx", f"[{MICRO_ROWS},{n}]x[{n},{k}]", "onednn", f, _shape(MICRO_ROWS, n, k, "onednn")))
        rows.append(("train dW", f"[{n},{MICRO_ROWS}]x[{MICRO_ROWS},{k}]", "aten", f, _shape(n, MICRO_ROWS, k, "aten")))
    rows.append(("decode", f"[{N},{H}]x[{H},{V}] head", "packed", 2 * H * V * decode_tokens, _shape(N, H, V, "packed")))
    f = 2 * H * V * head_tokens
    rows.append(("train head fwd", f"[{HEAD_CHUNK},{H}]x[{H},{V}]", "aten", f, _shape(HEAD_CHUNK, H, V, "aten")))
    rows.append(("train head dh", f"[{HEAD_CHUNK},{V}]x[{V},{H}]", "aten", f, _shape(HEAD_CHUNK, V, H, "aten")))
    rows.append(("train head dW", f"[{V},{HEAD_CHUNK}]x[{HEAD_CHUNK},{H}]", "aten", f,
                 _shape(V, HEAD_CHUNK, H, "aten")))
    total_flops = sum(r[3] for r in rows)
    total_s = sum(r[3] / (r[4] * 1e9) for r in rows)
    print(f"fp32 matmul peak (2048^3, 2 threads): {peak:.1f} GFLOP/s")
    print("| phase | shape | kernel | share of M's matmul FLOPs | GFLOP/s | of peak |")
    print("|---|---|---|---|---|---|")
    for phase, shape, kind, f, g in rows:
        print(f"| {phase} | {shape} | {kind} | {f / total_flops:.1%} | {g:.0f} | {g / peak:.0%} |")
    bound = total_flops / total_s / 1e9
    print(f"matmul time at these speeds: {total_s:.2f} s per step; bound on MFU: {bound / peak:.0%} "
          f"({bound:.0f} GFLOP/s over {total_flops / 1e9:.0f} GFLOP; attention scores, softmax, exp, norms and "
          "the optimizer not counted)")
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    result = {"peak_gflops": peak, "bound_mfu": bound / peak, "rows": rows}
    (out / "matmul_bounds.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
