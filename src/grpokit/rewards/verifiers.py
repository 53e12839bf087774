"""The exact verifiers of the built-in tasks (tasks/), as reward functions.

- `addition`: 1.0 when the stripped completion equals the sum, else 0.0.
- `countdown` (TinyZero): the completion is an arithmetic expression over the given numbers,
  each used at most once, with + - * / and parentheses. It is never evaluated as code: it is
  parsed with `ast`, only integer literals and those operators are accepted, and it is computed
  with exact fractions. 1.0 for a correct expression; `format_score` (default 0.0; TinyZero
  uses 0.1) for a well-formed expression that misses the target or misuses the numbers
  (division by zero included); 0.0 for anything else.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

from grpokit.rewards.graders import answer_span, completion_text


def addition_reward(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer exactly."""
    return [1.0 if completion_text(c).strip() == str(a).strip() else 0.0
            for c, a in zip(completions, answer, strict=True)]


MAX_EXPRESSION_CHARS = 100
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/() ]+")
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def parse_expression(text: str, *, negation: bool = False) -> tuple[Fraction | None, list[int]] | None:
    """(value, integers used) of an expression of integers, + - * / and parentheses (and a leading
    minus, `-3*4`, with `negation`); None if not one.

    The value is None when the expression divides by zero (it is still well formed).
    """
    text = text.strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS or not _ALLOWED_CHARS.fullmatch(text):
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    leaves: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            op = _OPS[type(node.op)]
            if op == "+":
                return left + right
            if op == "-":
                return left - right
            if op == "*":
                return left * right
            return left / right  # ZeroDivisionError propagates
        if negation and isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            leaves.append(node.value)
            return Fraction(node.value)
        raise _NotAllowed

    try:
        value = walk(tree.body)
    except _NotAllowed:
        return None
    except ZeroDivisionError:
        return None, leaves
    return value, leaves


class _NotAllowed(Exception):
    pass


def _numbers(value) -> list[int]:
    if isinstance(value, str):  # e.g. "3 7 25" from a CSV column
        return [int(x) for x in re.findall(r"\d+", value)]
    return [int(x) for x in value]


def score_expression(text: str, numbers, target, format_score: float = 0.0) -> float:
    """1.0 if `text` reaches `target` using each of `numbers` at most once, `format_score` if it is
    a well-formed expression that does not, 0.0 otherwise."""
    parsed = parse_expression(text)
    if parsed is None:
        return 0.0
    value, used = parsed
    fits = not (Counter(used) - Counter(_numbers(numbers)))
    return 1.0 if fits and value is not None and value == int(target) else format_score


class countdown_reward_fn:  # noqa: N801  (a factory to its users; a class so that it pickles)
    """The countdown verifier as a TRL-style reward function reading the `numbers` and `target` columns."""

    __name__ = "countdown_reward"

    def __init__(self, format_score: float = 0.0):
        if not 0.0 <= format_score < 1.0:
            raise ValueError(f"countdown: format_score must be in [0, 1), got {format_score}")
        self.format_score = format_score

    def __call__(self, completions: list, numbers: list, target: list, **kwargs) -> list[float]:
        return [score_expression(answer_span(completion_text(c)), ns, t, self.format_score)
                for c, ns, t in zip(completions, numbers, target, strict=True)]
