"""The trainer's half of grading a `code_execution` answer: the judge's verdict as a score.

    judge(report, n_tests) -> Grade(score in [0, 1], reason, refused)

The tests run in the sandbox's judge process, which the answer's code never ran in
(`sandbox_harness`); the judge writes one JSON object, `{"passed": [bool per test], "end": how
grading ended, "why": the first failure's reason}`. Reading it is strict all the same: the score is
passes / tests, never outside [0, 1], and whatever the file holds (nothing, a partial write, a wrong
type, more passes than tests) scores 0.0 with a reason and never raises, since a model's output must
never be able to stop training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["Grade", "judge"]


@dataclass(frozen=True)
class Grade:
    score: float  # in [0, 1]
    reason: str | None  # why it is below 1.0, when it is
    refused: bool = False  # the answer wrote into the harness's channel what the harness did not ask for


_ENDS = {
    "raised": "the answer's code raised",
    "died": "the program did not run to its end (a crash, a signal, an early exit or a hang)",
}


def judge(report: str, n_tests: int) -> Grade:
    """The grade of one answer from the judge's JSON `report`, for `n_tests` tests."""
    try:
        verdict = json.loads(report)
        passed, end, why = verdict["passed"], verdict["end"], verdict["why"]
        if (type(passed) is not list or not all(type(p) is bool for p in passed) or type(end) is not str
                or not (why is None or type(why) is str)):
            raise ValueError("wrong types")
    except Exception:  # noqa: BLE001 - whatever the file holds, it scores: a model's output never stops training
        return Grade(0.0, "the harness wrote no readable result")
    if end == "refused":
        return Grade(0.0, f"the answer wrote into the harness's channel what the harness did not ask for "
                          f"({(why or '')[:200]})", refused=True)
    if end != "ok":
        return Grade(0.0, _ENDS.get(end, "the harness wrote no readable result") + (f": {why[:200]}" if why else ""))
    if len(passed) != n_tests or n_tests < 1:
        return Grade(0.0, f"the harness reported {len(passed)} test(s) of {n_tests}")
    score = min(1.0, max(0.0, sum(passed) / n_tests))
    return Grade(score, None if score == 1.0 else why or "a test failed")
