"""Addition: "12+34=" → "46".

The prompt is compact because the demo trains a ~1M-parameter character-level
model: every character is a token. Operands are uniform in [0, 10**digits).
The verifier is an exact match of the stripped completion with the sum: 1.0
or 0.0; no partial credit, no extra text.

Two options change how the numbers are written (the eval split, drawn by prompt text, then holds other pairs):
`zero_pad` writes every operand with `digits` digits and the sum with
`digits + 1` ("07+45=" -> "052"), so each digit sits at the same position in
every example; `reverse_answer` writes the sum least-significant digit first
("052" -> "250"), the order in which the carries are computed. Together they
let a small transformer learn addition several times faster (Lee et al. 2023,
"Teaching Arithmetic to Small Transformers"): the demo uses both.
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
    zero_pad: bool = False  # "07+45=" -> "052": operands with `digits` digits, the sum with digits + 1
    reverse_answer: bool = False  # the sum least-significant digit first: "52" -> "25" ("052" -> "250")
    eval_fraction: float = 0.1  # share of the prompt space reserved for split="eval"
    name: ClassVar[str] = "addition"

    def __post_init__(self):
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or not 1 <= self.digits <= 18:
            raise ValueError(f"addition: digits must be an integer from 1 to 18, got {self.digits!r}")
        for option in ("zero_pad", "reverse_answer"):
            if not isinstance(getattr(self, option), bool):
                raise ValueError(f"addition: {option} must be true or false, got {getattr(self, option)!r}")
        check_split("eval", self.eval_fraction)

    def render_sum(self, total: int) -> str:
        """How an answer writes the sum `total` (also a deliberately wrong one: the demo's noisy targets)."""
        text = str(total).zfill(self.digits + 1) if self.zero_pad else str(total)
        return text[::-1] if self.reverse_answer else text

    @staticmethod
    def total(row: dict) -> int:
        """The sum a row asks for, read from its prompt ("07+45=" -> 52)."""
        a, b = row["prompt"].rstrip("=").split("+")
        return int(a) + int(b)

    def _row(self, rng: random.Random) -> dict:
        hi = 10 ** self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        width = self.digits if self.zero_pad else 0
        return {"prompt": f"{str(a).zfill(width)}+{str(b).zfill(width)}=", "answer": self.render_sum(a + b)}

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
