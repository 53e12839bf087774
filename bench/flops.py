"""Model FLOPs of one GRPO step, and the machine's fp32 matmul peak.

Model FLOPs count what the algorithm needs, not what a system happens to do:

    forward FLOPs of a token = 2 * P_body + 2 * P_head (only where logits are needed)
                               + 4 * L * H_attn * ctx   (QKᵀ and AV over the ctx positions it attends to)
    P_body = L * (q, k, v, o projections + gate, up, down)     (matmul weights; norms and biases ignored)
    P_head = V * H                                             (the output projection; the tied input
                                                                embedding is a lookup, 0 FLOPs)

    generation  = prefill of B prompts (P tokens each, once per prompt) + N*T decode tokens with logits
    training    = 3x forward (forward + backward) over N sequences of P + T tokens, logits on the T
    reference   = 1x forward over N sequences, logits on the T         (only when beta > 0)
    per generation batch: generation + reference + mu * training;  per optimizer step: that / mu

Old log-probs (mu > 1) are not counted: the policy's first pass computes them (exactly), so a
separate pass is work a system chooses to do, not work the algorithm needs.
"""

from __future__ import annotations

import time


def model_shape(path: str) -> dict:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    H, L, V, inter = c.hidden_size, c.num_hidden_layers, c.vocab_size, c.intermediate_size
    head_dim = getattr(c, "head_dim", None) or H // c.num_attention_heads
    q_dim, kv_dim = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    attn = H * q_dim + 2 * H * kv_dim + q_dim * H
    return {"L": L, "H": H, "V": V, "H_attn": q_dim, "KV": kv_dim, "P_body": L * (attn + 3 * H * inter),
            "P_head": V * H}


def _forward(shape: dict, seqs: int, prompt: int, completion: int, logits_on: int) -> float:
    """Forward FLOPs of `seqs` causal sequences of prompt + completion tokens, logits on `logits_on` per seq."""
    n_tok = prompt + completion
    ctx_sum = n_tok * (n_tok + 1) / 2  # token i attends to i + 1 positions
    return seqs * (2 * shape["P_body"] * n_tok + 2 * shape["P_head"] * logits_on
                   + 4 * shape["L"] * shape["H_attn"] * ctx_sum)


def step_flops(shape: dict, *, B: int, G: int, P: int, T: int, beta: float, mu: int,
               lengths: list[int] | None = None) -> dict:
    """Model FLOPs of one generation batch (and per optimizer step); `lengths`: each answer's length (N of
    them) where answers end at EOS, else all N have T tokens."""
    N = B * G
    lengths = lengths or [T] * N
    prefill = _forward(shape, B, P, 0, 1)
    decode = sum(_forward(shape, 1, P, t, t) - _forward(shape, 1, P, 0, 0) for t in lengths)  # new tokens, context
    generation = prefill + decode
    train = 3 * sum(_forward(shape, 1, P, t, t) for t in lengths)
    ref = train / 3 if beta > 0 else 0.0
    per_generation = generation + ref + mu * train
    return {"generation": generation, "prefill": prefill, "decode": decode, "train_pass": train, "reference": ref,
            "per_generation": per_generation, "per_opt_step": per_generation / mu}


def phase_bounds(shape: dict, *, B: int, G: int, P: int, lengths: list[int], beta: float, mu: int,
                 peak_gflops: float, read_gb_s: float) -> dict:
    """Each phase's least possible time on this machine, per optimizer step (seconds).

    rollout: the prefill's FLOPs at the fp32 matmul peak, then per decode step the larger (roofline) of its
             FLOPs at the peak and its bytes at the read bandwidth: every weight once (fp32) plus the KV
             cache of the rows still decoding (2 x layers x KV width x context, fp32); a row of length t
             runs t - 1 decode steps (its last token is never fed back).
    train:   forward + backward FLOPs at the peak, mu passes (and the reference forward when beta > 0): each
             prompt once (its G answers share it: grpokit's shared prompt forward), each answer's tokens with
             their attention to the prompt and logits. (MFU's model FLOPs count the prompt once per answer, as
             the earlier figures did; the bound counts the least work.)
    """
    peak, bw = peak_gflops * 1e9, read_gb_s * 1e9
    weight_bytes = 4 * (shape["P_body"] + shape["P_head"])
    kv_per_position = 2 * shape["L"] * shape["KV"] * 4
    per_token = 2 * shape["P_body"] + 2 * shape["P_head"]
    decode = 0.0
    for step in range(1, max(lengths)):
        contexts = [P + step for t in lengths if t > step]  # the rows still decoding and their context
        flops = len(contexts) * per_token + 4 * shape["L"] * shape["H_attn"] * sum(contexts)
        decode += max(flops / peak, (weight_bytes + kv_per_position * sum(contexts)) / bw)
    fl = step_flops(shape, B=B, G=G, P=P, T=max(lengths), beta=beta, mu=mu, lengths=lengths)
    rollout = (fl["prefill"] / peak + decode) / mu
    forward = _forward(shape, B, P, 0, 0) + fl["decode"]  # the prompts once, the answers with their logits
    train = (3 * forward * mu + (forward if beta > 0 else 0.0)) / peak / mu
    return {"rollout": rollout, "train": train, "step": rollout + train, "decode": decode / mu}


def mean_phase_bounds(shape: dict, batches: list[list[int]], **kw) -> dict:
    """phase_bounds averaged over the measured generation batches (each its answers' lengths); `kw` as
    phase_bounds takes them, but `lengths`."""
    bounds = [phase_bounds(shape, lengths=lengths, **kw) for lengths in batches]
    return {k: sum(b[k] for b in bounds) / len(bounds) for k in bounds[0]}


def matmul_peak(threads: int, n: int = 2048, repeats: int = 12) -> float:
    """Best fp32 GFLOP/s of an n x n matmul with `threads` threads (best of `repeats` timed blocks)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(3):
            torch.mm(a, b, out=out)
        best = min(best, (time.perf_counter() - t) / 3)
    return 2 * n ** 3 / best / 1e9


def copy_bandwidth(threads: int, mb: int = 1024, repeats: int = 6) -> float:
    """Best GB/s (bytes read + bytes written) of copying an `mb`-MB fp32 tensor with `threads` threads:
    the memory-bandwidth bound of a decode step, which reads every weight once."""
    import torch

    torch.set_num_threads(threads)
    src = torch.randn(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def read_bandwidth(threads: int, mb: int = 1024, repeats: int = 6) -> float:
    """Best GB/s of summing an `mb`-MB fp32 tensor with `threads` threads: the bound for a stream that only
    reads, as a decode step does (a copy also writes, and a copy's bytes read + written count both)."""
    import torch

    torch.set_num_threads(threads)
    src = torch.randn(mb * 2**20 // 4)
    src.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best / 1e9
