"""Realistic answer lengths, forced identically on grpokit and on TRL.

On math and code tasks a group's answers end at EOS after anything from tens to thousands of tokens, and a
trainer pays for padding wherever it batches them. A random-init benchmark model almost never samples EOS,
so the benchmark decides the lengths: each generation batch gets N target lengths from a seeded,
heavy-tailed (log-normal) distribution clipped to [lo, hi], the same list on both systems for the same
batch index, and each system's sampler is made to end answer i at exactly its target with EOS:

- grpokit: the built-in sampler's token draw (`grpokit.rollout.decode.sample_tokens`) is wrapped; at decode
  step t the rows whose target is t + 1 emit EOS (with its true log-prob) and no other row may. grpokit
  drops finished rows from the batch; the wrapper follows which original rows are still decoding, so
  answer i ends at target i on both systems.
- TRL: `model.generate` gets a logits processor that masks EOS before a row's target and everything but
  EOS at it (transformers keeps finished rows in the batch, padding them, until the last row ends).

Tokens are otherwise drawn from the model as usual (temperature 1), so every other cost is real.
"""

from __future__ import annotations

import math
import random


def target_lengths(n: int, batch_index: int, *, lo: int, hi: int, median: float, sigma: float,
                   seed: int = 0) -> list[int]:
    """N answer lengths for generation batch `batch_index`: log-normal (median, sigma) clipped to [lo, hi]."""
    rng = random.Random(f"{seed}-{batch_index}")
    return [min(hi, max(lo, round(math.exp(rng.gauss(math.log(median), sigma))))) for _ in range(n)]


def expected_tokens(n: int, batches: int, **dist) -> list[list[int]]:
    return [target_lengths(n, b, **dist) for b in range(batches)]


def force_grpokit(dist: dict, n_rows: int, eos_id: int) -> None:
    """Wrap grpokit's token draw so that generation batch b ends answer i at `target_lengths(n_rows, b)[i]`,
    the row TRL's answer i gets (both order a batch's rows prompt by prompt, G answers each)."""
    from grpokit.rollout import decode

    draw = decode.sample_tokens
    state: dict = {"batch": -1, "alive": []}

    def forced(logits, **kw):
        n = logits.shape[0]
        if not state["alive"]:  # a new generation batch: its first decode step
            assert n == n_rows, f"forced lengths expect {n_rows} rows, the sampler has {n}"
            state["batch"] += 1
            state["t"], state["targets"] = 0, target_lengths(n_rows, state["batch"], **dist)
            state["alive"] = list(range(n_rows))  # the original rows still decoding, in the sampler's order
        assert n == len(state["alive"]), "the sampler dropped rows the forced lengths did not end"
        tok, lp = draw(logits, **kw)  # the real draw: its cost stays in the measurement
        tok = tok.masked_fill(tok == eos_id, (eos_id + 1) % logits.shape[1])  # EOS only where forced
        ends = [j for j, row in enumerate(state["alive"]) if state["targets"][row] == state["t"] + 1]
        if ends:
            z = logits[ends].float() / (kw.get("temperature") or 1.0)
            tok[ends] = eos_id
            lp[ends] = z[:, eos_id] - z.logsumexp(-1)
            ended = set(ends)  # the sampler drops them from its batch, keeping the others' order
            state["alive"] = [row for j, row in enumerate(state["alive"]) if j not in ended]
        state["t"] += 1
        return tok, lp

    decode.sample_tokens = forced


def force_trl(model, dist: dict, n_rows: int, eos_id: int) -> None:
    """Give TRL's `model.generate` a logits processor that ends generation batch b's answers at its targets."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    generate = model.generate
    batches = {"index": -1}

    class ForceLengths(LogitsProcessor):
        def __init__(self, targets: list[int], prompt_len: int, device):
            self.targets = torch.tensor(targets, device=device)  # [N]
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores):  # input_ids [N, P + t], scores [N, V]
            t = input_ids.shape[1] - self.prompt_len  # tokens generated so far
            end = self.targets == t + 1  # [N]
            scores[~end, eos_id] = float("-inf")
            keep = scores[end, eos_id].clone()
            scores[end] = float("-inf")
            scores[end, eos_id] = torch.where(keep.isfinite(), keep, torch.zeros_like(keep))
            return scores

    def forced_generate(*args, **kwargs):
        ids = kwargs["input_ids"]
        assert ids.shape[0] == n_rows, f"forced lengths expect {n_rows} rows, generate has {ids.shape[0]}"
        batches["index"] += 1
        targets = target_lengths(n_rows, batches["index"], **dist)
        procs = LogitsProcessorList([ForceLengths(targets, ids.shape[1], ids.device)])
        return generate(*args, logits_processor=procs, **kwargs)

    model.generate = forced_generate
