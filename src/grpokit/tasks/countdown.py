"""Countdown (TinyZero): reach a target from given numbers with + - * / and parentheses.

Prompt: the numbers, then the target, compactly: "3 7 25 -> 75:". Completion:
an arithmetic expression such as "3*25". Each given number may be used at most
once (TinyZero requires all of them; "at most" keeps small instances solvable
more often); no other numbers may appear.

The generator builds a random expression tree over a random subset of at least
two of the numbers (non-negative, exact intermediate results), and keeps it
when its value is a whole number in [1, max_target]; that expression is the
row's "answer" and the SFT target. Any other valid expression scores the same.

The verifier (`rewards/verifiers.py`, reward name "countdown") parses the expression
without evaluating code and computes with exact fractions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Collection

from grpokit.rewards.core import RewardSpec
from grpokit.rewards.graders import answer_span, completion_text
from grpokit.rewards.verifiers import countdown_reward_fn, score_expression
from grpokit.tasks.base import check_split, sample_rows

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def _render(node, parent: int = 0, right_of: str = "") -> str:
    if isinstance(node, int):
        return str(node)
    op, left, right = node
    p = _PREC[op]
    text = f"{_render(left, p)}{op}{_render(right, p, op)}"
    # Parenthesise a lower-precedence child, and an equal-precedence right child of - or /.
    needs = p < parent or (p == parent and right_of in ("-", "/"))
    return f"({text})" if needs else text


@dataclass(frozen=True)
class CountdownTask:
    num_numbers: int = 3
    max_number: int = 25
    max_target: int = 100
    format_score: float = 0.0
    eval_fraction: float = 0.1
    name: ClassVar[str] = "countdown"

    def __post_init__(self):
        for field, v, lo in (("num_numbers", self.num_numbers, 2), ("max_number", self.max_number, 2),
                             ("max_target", self.max_target, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"countdown: {field} must be an integer >= {lo}, got {v!r}")
        if self.num_numbers > 6:
            raise ValueError(f"countdown: num_numbers must be at most 6, got {self.num_numbers}")
        countdown_reward_fn(self.format_score)  # validates format_score
        check_split("eval", self.eval_fraction)

    def _solution(self, numbers: list[int], rng: random.Random):
        """A random expression tree over >= 2 of `numbers` with a whole value in [1, max_target], or None."""
        pool = [(n, n) for n in rng.sample(numbers, rng.randint(2, len(numbers)))]  # (tree, value)
        while len(pool) > 1:
            (ta, a), (tb, b) = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
            if a < b:
                (ta, a), (tb, b) = (tb, b), (ta, a)
            choices = ["+", "*"] + (["-"] if a > b else []) + (["/"] if b > 1 and a % b == 0 else [])
            op = rng.choice(choices)
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
            pool.append(((op, ta, tb), value))
        tree, value = pool[0]
        return (tree, value) if 1 <= value <= self.max_target else None

    def _row(self, rng: random.Random) -> dict:
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            found = self._solution(numbers, rng)
            if found is not None:
                tree, target = found
                return {"prompt": f"{' '.join(map(str, numbers))} -> {target}:", "answer": _render(tree),
                        "numbers": numbers, "target": target}

    def generate(self, n: int, seed: int, *, split: str | None = None,
                 exclude: Collection[str] = ()) -> list[dict]:
        return sample_rows(self._row, n, seed, split=split, eval_fraction=self.eval_fraction,
                           exclude=exclude, task=self.name)

    def reward_functions(self) -> list[RewardSpec]:
        return [RewardSpec(self.name, countdown_reward_fn(self.format_score))]

    def is_correct(self, completion: str, row: dict) -> bool:
        return score_expression(answer_span(completion_text(completion)), row["numbers"], row["target"]) == 1.0

    def sft_target(self, row: dict, rng: random.Random | None = None) -> str:
        return str(row["answer"])
