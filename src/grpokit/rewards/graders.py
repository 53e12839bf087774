"""Built-in graders, each a TRL-style reward function (or a factory returning one).

- `numeric_match`: the final number of the completion equals the `answer` column.
- `math_equivalence`: mathematical equivalence through `math-verify` (extra `grpokit[math]`).
- `format_reward(pattern)`: the completion fully matches a regex (default: R1's think/answer tags).
- `soft_overlong_penalty(max_len, buffer)`: DAPO's soft overlong punishment on token length.

Graders that read an answer look inside the last `<answer>...</answer>` block
when the completion has one, and at the whole text otherwise. An `answer`
that cannot be read (no number, unparseable LaTeX) gives None: the sample is
skipped, not punished for a dataset problem.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Any

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


# A number: an optional minus (not a binary minus right after a digit or ")"),
# digits with optional thousands commas, an optional decimal part.
_NUMBER = re.compile(r"(?<![\d)\]])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\d)\]])-?\.\d+")


DEFAULT_FORMAT = r"^<think>.*?</think>\s*<answer>.*?</answer>$"


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the content of TRL's `[{"role": "assistant", ...}]`."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, (list, tuple)) and completion:
        return completion_text(completion[-1])
    return "" if completion is None or completion == [] else str(completion)


def answer_span(text: str) -> str:
    """The content of the last `<answer>...</answer>` block, or the whole text without one."""
    found = _ANSWER_TAG.findall(text)
    return found[-1] if found else text


def final_number(text: str) -> Fraction | None:
    """The last number in `text` as an exact Fraction ("1,000" and "1000.0" are both 1000)."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def _as_number(answer: Any) -> Fraction | None:
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return Fraction(answer)
    if isinstance(answer, float):
        return Fraction(repr(answer)) if answer == answer and abs(answer) != float("inf") else None
    return final_number(str(answer)) if answer is not None else None


def numeric_match(completions: list, answer: list, **kwargs) -> list[float | None]:
    """1.0 when the completion's final number equals `answer` exactly, else 0.0.

    The number is read from the `<answer>` block if there is one. `answer` may
    be a number or a string ("72", "1,000", "#### 72": its last number). None
    for a sample whose `answer` has no number.
    """
    out: list[float | None] = []
    for c, a in zip(completions, answer, strict=True):
        gold = _as_number(a)
        if gold is None:
            out.append(None)
            continue
        pred = final_number(answer_span(completion_text(c)))
        out.append(1.0 if pred == gold else 0.0)
    return out


def _math_verify():
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ImportError("the 'math_equivalence' reward needs the math-verify package: "
                          "pip install 'grpokit[math]'") from e
    return parse, verify


def math_equivalence(completions: list, answer: list, **kwargs) -> list[float | None]:
    """1.0 when the completion is mathematically equivalent to `answer` (math-verify), else 0.0.

    math-verify bounds each parse and comparison with `signal.alarm`, which only
    works in the main thread; elsewhere (a thread pool, a dataloader worker
    thread) the timeout is switched off rather than failing. None for a sample
    whose `answer` math-verify cannot parse.
    """
    parse, verify = _math_verify()
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    out: list[float | None] = []
    for c, a in zip(completions, answer, strict=True):
        a = str(a)
        gold = parse(a, parsing_timeout=timeout) or parse(f"${a}$", parsing_timeout=timeout)
        if not gold:
            out.append(None)
            continue
        pred = parse(answer_span(completion_text(c)), parsing_timeout=timeout)
        out.append(1.0 if pred and verify(gold, pred, timeout_seconds=timeout) else 0.0)
    return out


class format_reward:  # noqa: N801  (a factory to its users; a class so that it pickles)
    """A reward function giving 1.0 when the whole completion matches `pattern`, else 0.0.

    The default is DeepSeek-R1's `<think>...</think> <answer>...</answer>` layout.
    Surrounding whitespace of the completion is ignored.
    """

    __name__ = "format_reward"

    def __init__(self, pattern: str = DEFAULT_FORMAT, flags: int = re.DOTALL):
        try:
            self.regex = re.compile(pattern, flags)
        except re.error as e:
            raise ValueError(f"format reward: invalid regular expression {pattern!r}: {e}") from e

    def __call__(self, completions: list, **kwargs) -> list[float]:
        return [1.0 if self.regex.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]

    def __repr__(self) -> str:
        return f"format_reward(pattern={self.regex.pattern!r})"


def overlong_penalty_value(length: int, max_completion_length: int, overlong_buffer: int) -> float:
    """DAPO's soft overlong punishment (Eq. 13) for one completion of `length` tokens."""
    start = max_completion_length - overlong_buffer
    if length <= start:
        return 0.0
    if length <= max_completion_length:
        return (start - length) / overlong_buffer
    return -1.0


class soft_overlong_penalty:  # noqa: N801
    """DAPO's soft overlong punishment on the completion's token count L (from `completion_ids`).

    0 for L <= max - buffer; a linear ramp (max - buffer - L) / buffer down to -1
    at L = max; -1 beyond max. buffer = 0 is a hard -1 beyond max (as TRL's
    `get_soft_overlong_punishment`, which this matches value for value).
    """

    __name__ = "soft_overlong_penalty"

    def __init__(self, max_completion_length: int, overlong_buffer: int):
        for name, v, lo in (("max_completion_length", max_completion_length, 1),
                            ("overlong_buffer", overlong_buffer, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"soft_overlong_penalty: {name} must be an integer >= {lo}, got {v!r}")
        if overlong_buffer > max_completion_length:
            raise ValueError(f"soft_overlong_penalty: overlong_buffer ({overlong_buffer}) must be <= "
                             f"max_completion_length ({max_completion_length})")
        self.max_completion_length, self.overlong_buffer = max_completion_length, overlong_buffer

    def __call__(self, completion_ids: list, **kwargs) -> list[float]:
        return [overlong_penalty_value(len(ids), self.max_completion_length, self.overlong_buffer)
                for ids in completion_ids]

    def __repr__(self) -> str:
        return f"soft_overlong_penalty({self.max_completion_length}, {self.overlong_buffer})"
