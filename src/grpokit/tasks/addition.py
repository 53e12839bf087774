"""Addition: "12+34=" → "46".

The prompt is compact because the demo trains a ~1M-parameter character-level
model: every character is a token. Operands are uniform in [0, 10**digits).
The verifier is an exact match of the stripped completion with the sum: 1.0
or 0.0; no partial credit, no extra text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Collection

from grpokit.rewards.core import RewardSpec
from grpokit.rewards.verifiers import addition_reward
from grpokit.tasks.base import check_split, sample_rows


@dataclass(frozen=True)
class AdditionTask:
    digits: int = 2
    eval_fraction: float = 0.1  # share of the prompt space reserved for split="eval"
    name: ClassVar[str] = "addition"

    def __post_init__(self):
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or not 1 <= self.digits <= 18:
            raise ValueError(f"addition: digits must be an integer from 1 to 18, got {self.digits!r}")
        check_split("eval", self.eval_fraction)

    def _row(self, rng: random.Random) -> dict:
        hi = 10 ** self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}

    def generate(self, n: int, seed: int, *, split: str | None = None,
                 exclude: Collection[str] = ()) -> list[dict]:
        return sample_rows(self._row, n, seed, split=split, eval_fraction=self.eval_fraction,
                           exclude=exclude, task=self.name)

    def reward_functions(self) -> list[RewardSpec]:
        return [RewardSpec(self.name, addition_reward)]

    def is_correct(self, completion: str, row: dict) -> bool:
        return addition_reward([completion], [row["answer"]])[0] == 1.0

    def sft_target(self, row: dict, rng: random.Random | None = None) -> str:
        return str(row["answer"])
