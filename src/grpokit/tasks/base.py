"""The `Task` protocol: a generator of prompts with checkable answers, and their verifier.

A task row is a dict with "prompt" and "answer" plus any extra columns its
verifier reads; rows are plain data so they can be written to JSONL and loaded
back with `grpokit.data.load_prompts`.

Held-out prompts: `generate(..., split="train" | "eval")` keeps only prompts
whose stable hash falls on that side of `eval_fraction`, so a training set and
an evaluation set are disjoint whatever their sizes and seeds. `exclude` drops
any further prompts (e.g. ones already used).
"""

from __future__ import annotations

import random
import zlib
from typing import Callable, Collection, Protocol, runtime_checkable

from grpokit.rewards.core import RewardSpec

SPLITS = (None, "train", "eval")


@runtime_checkable
class Task(Protocol):
    name: str

    def generate(self, n: int, seed: int) -> list[dict]:
        """`n` rows with "prompt", "answer" and the verifier's columns; the same seed gives the same rows."""

    def reward_functions(self) -> list[RewardSpec]:
        """The task's verifier(s) as TRL-style reward functions."""

    def is_correct(self, completion: str, row: dict) -> bool:
        """True when `completion` solves the task of `row`."""

    def sft_target(self, row: dict, rng: random.Random) -> str:
        """A correct completion for `row`, without EOS (the caller appends it)."""


def in_split(prompt: str, split: str | None, eval_fraction: float) -> bool:
    """Whether `prompt` belongs to `split` under a stable (process-independent) hash."""
    if split is None:
        return True
    is_eval = zlib.crc32(prompt.encode()) % 10_000 < eval_fraction * 10_000
    return is_eval if split == "eval" else not is_eval


def check_split(split: str | None, eval_fraction: float) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if split is not None and not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1) to split, got {eval_fraction}")


def sample_rows(make_row: Callable[[random.Random], dict], n: int, seed: int, *, split: str | None,
                eval_fraction: float, exclude: Collection[str], task: str) -> list[dict]:
    """`n` rows from `make_row(rng)`, filtered by split and `exclude`; deterministic in `seed`."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{task}: n must be a non-negative integer, got {n!r}")
    check_split(split, eval_fraction)
    rng = random.Random(f"{task}:{seed}")
    exclude = set(exclude)
    rows: list[dict] = []
    budget = 100 * n + 1000
    while len(rows) < n and budget > 0:
        budget -= 1
        row = make_row(rng)
        if row["prompt"] not in exclude and in_split(row["prompt"], split, eval_fraction):
            rows.append(row)
    if len(rows) < n:
        raise ValueError(f"{task}: found only {len(rows)} of {n} prompts outside `exclude` in split {split!r}; "
                         f"the task's prompt space is too small for this request (make the task larger, "
                         f"or ask for fewer rows)")
    return rows
