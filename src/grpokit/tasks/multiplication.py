"""Multiplication with a calculator tool: "47*86=" -> "4042".

A task a ~1M-parameter character model cannot do in its head but can do with a tool: it must
call `calculator` with the right expression (copying the operands from the prompt) and then
give the tool's result as its answer. The task brings its tool: a run with `data.task =
"multiplication"` and no `[tools]` section of its own gets `calculator`.

The verifier is an exact match of the final answer (the last assistant message of the
conversation, stripped) with the product: 1.0 or 0.0.

`tool_trace` writes warm-start conversations for `sft`: the call and the answer are trained, the
tool's result is context (masked out of the loss), as in the GRPO update.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar, Collection

from grpokit.rewards.core import RewardSpec
from grpokit.rewards.verifiers import addition_reward, parse_expression
from grpokit.tasks.base import check_split, sample_rows


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Integers with + - * / and parentheses, for example "47*86" or "-3*(4+5)/2".
    """
    parsed = parse_expression(expression, negation=True)  # parsed with `ast`, never run as code
    if parsed is None:
        raise ValueError(f"not an arithmetic expression of integers: {expression!r}")
    value = parsed[0]
    if value is None:
        raise ZeroDivisionError("division by zero")
    return exact_text(value)


def exact_text(value: Fraction) -> str:
    """An integer as itself, a terminating decimal in full ("3.5"), any other fraction as "p/q"."""
    if value.denominator == 1:
        return str(value.numerator)
    places = 0
    while (value * 10 ** places).denominator != 1 and places <= 4 * value.denominator.bit_length():
        places += 1
    scaled = value * 10 ** places
    if scaled.denominator != 1:  # not a terminating decimal (a factor other than 2 and 5)
        return f"{value.numerator}/{value.denominator}"
    digits = str(abs(scaled.numerator)).rjust(places + 1, "0")
    return f"{'-' if value < 0 else ''}{digits[:-places]}.{digits[-places:]}"


@dataclass(frozen=True)
class MultiplicationTask:
    digits: int = 2
    eval_fraction: float = 0.1  # share of the prompt space reserved for split="eval"
    name: ClassVar[str] = "multiplication"

    def __post_init__(self):
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or not 1 <= self.digits <= 9:
            raise ValueError(f"multiplication: digits must be an integer from 1 to 9, got {self.digits!r}")
        check_split("eval", self.eval_fraction)

    def _range(self) -> tuple[int, int]:
        """Operands have exactly `digits` digits (0-9 for one)."""
        return 10 ** (self.digits - 1) if self.digits > 1 else 0, 10 ** self.digits - 1

    def _row(self, rng: random.Random) -> dict:
        lo, hi = self._range()
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        return {"prompt": f"{a}*{b}=", "answer": str(a * b)}

    def generate(self, n: int, seed: int, *, split: str | None = None,
                 exclude: Collection[str] = ()) -> list[dict]:
        return sample_rows(self._row, n, seed, split=split, eval_fraction=self.eval_fraction,
                           exclude=exclude, task=self.name)

    def reward_functions(self) -> list[RewardSpec]:
        return [RewardSpec(self.name, addition_reward)]  # exact match of the final answer

    def tools(self) -> list:
        return [calculator]

    def is_correct(self, completion, row: dict) -> bool:
        return addition_reward([completion], [row["answer"]])[0] == 1.0

    def sft_target(self, row: dict, rng: random.Random | None = None) -> str:
        """The answer without the tool (what `grpokit sft --task multiplication` teaches)."""
        return str(row["answer"])

    def tool_trace(self, row: dict, rng: random.Random, *, no_call: float = 0.0,
                   wrong_argument: float = 0.0) -> tuple[list[dict], str]:
        """A warm-start conversation for `row`: (assistant/tool messages, final answer).

        With probability `no_call` the answer is a guess without the tool (near the product); with
        probability `wrong_argument` the call has one operand off by one (the answer is the tool's
        result, so wrong); otherwise the right call and the right answer."""
        a, b = self.operands(row)
        u = rng.random()
        if u < no_call:
            miss = rng.choice([-100, -10, -1, 1, 10, 100])
            return [], str(a * b + miss if a * b + miss >= 0 else a * b - miss)  # never the product
        if u < no_call + wrong_argument:
            lo, hi = self._range()
            off = lambda x, d: x + d if lo <= x + d <= hi else x - d  # noqa: E731 - stays a valid operand
            d = rng.choice([-1, 1])
            a, b = (off(a, d), b) if rng.random() < 0.5 else (a, off(b, d))
        expression = f"{a}*{b}"
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        messages = [{"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "calculator", "content": calculator(expression)}]
        return messages, calculator(expression)

    @staticmethod
    def operands(row: dict) -> tuple[int, int]:
        a, _, b = row["prompt"].rstrip("=").partition("*")
        return int(a), int(b)


def call_text(messages: list[dict]) -> str:
    """The text an assistant turn with `tool_calls` is generated as (Hermes format, as the tiny tool
    template renders it)."""
    return "".join(f"<tool_call>{json.dumps(c['function'])}</tool_call>"
                   for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or [])
