"""Shared pieces of the benchmark workers: the reward, the prompts, timing and memory helpers."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = HERE / "out" / "models"


def letter_fraction(completions, **kwargs) -> list[float]:
    """A cheap continuous reward (share of letters in the text): groups almost never tie,
    so every answer carries an advantage and no system can skip work on this benchmark."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else c[-1]["content"]
        out.append(sum(ch.isalpha() for ch in text) / max(len(text), 1))
    return out


def half_unsolvable(completions, solvable, **kwargs) -> list[float]:
    """The ablation reward: half the prompts are 'too hard' (reward 0 for every answer, so their
    group's advantage is 0), as in real GRPO runs where many groups tie; the others as above."""
    base = letter_fraction(completions)
    return [b if s else 0.0 for b, s in zip(base, solvable)]


def digit_mean(completions, **kwargs) -> list[float]:
    """letter_fraction's counterpart for the addition demo's answers (digits): their mean digit / 9."""
    out = []
    for c in completions:
        digits = [int(ch) for ch in (c if isinstance(c, str) else c[-1]["content"]) if ch.isdigit()]
        out.append(sum(digits) / (9 * len(digits)) if digits else 0.0)
    return out


REWARDS = {"letter_fraction": letter_fraction, "half_unsolvable": half_unsolvable, "digit_mean": digit_mean}


def load_rows(n: int, model: str = "", prompt_tokens: int | None = None) -> list[dict]:
    """The first `n` prompts: the model folder's own prompts.json where it has one (the demo model's
    addition prompts), else the shared ones cut to the BPE models' prompt length (32 tokens), or to their
    first `prompt_tokens` tokens (a short-prompt configuration)."""
    own = MODELS / model / "prompts.json"
    rows = json.loads((own if model and own.is_file() else MODELS / "prompts.json").read_text())[:n]
    prompts = [r["prompt"] for r in rows]
    if prompt_tokens:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(MODELS / model))
        prompts = [tok.decode(tok(p).input_ids[:prompt_tokens]) for p in prompts]
    return [{"prompt": p, "solvable": i % 2 == 1} for i, p in enumerate(prompts)]


def peak_rss_mb() -> float:
    """This process's peak resident memory (MB): VmHWM, the high-water mark of its own address space.
    (getrusage's ru_maxrss is kept across execve on Linux, so a worker would report its parent's peak if
    that was higher.)"""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def read_spec() -> dict:
    return json.loads(sys.argv[1])


def emit(result: dict) -> None:
    """The worker's one result line, tagged so the driver can find it among library logs."""
    sys.stdout.write("BENCH_RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (and atexit hooks of libraries): nothing left to save
