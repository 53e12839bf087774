"""The trainer's half of grading a `code_execution` answer: what the sandbox is told, and how its report is judged.

    instrument(test) -> (code sent to the sandbox, the checks the trainer keeps)
    judge(report, checks per test) -> Grade(score in [0, 1], reason, refused)

The answer runs in the same interpreter as its tests, so anything that interpreter says could be the
answer speaking. The grade therefore rests on what the answer cannot know:

- Every `assert` of a test becomes `__grpokit_check__(k, ops, *values)`: the sandbox evaluates the
  expressions and sends their values back as plain data (None, bool, int, float, complex, str, bytes,
  list, tuple, dict, set, frozenset; numpy values via `tolist()`). The expected side stays here:
  `assert add(2, 3) == 5` sends `add(2, 3)`, and 5, the operator and the assert's polarity
  (`assert f(x)` and `assert not f(x)` look the same in the sandbox) never enter it. The comparison
  runs here, on decoded values, so an object with a lying `__eq__` is no help (a value that is not
  plain data fails such a check). Comparisons with no literal side send every side: compared here when
  all are plain data, failed when some are and some are not (an object that "equals" a plain value),
  judged by the answer's own objects in the sandbox only when none is (`P(1) == P(1)`); `is` against
  anything but None/True/False, and the truth of a value that is not plain data, are judged there too.
- A test passes when its end was reported, each top-level assert was checked exactly once (one in a
  loop at least once) and every check held. The score is passes / tests, never outside [0, 1].
- A report that is not what the harness writes (a line without the run's token, a malformed line,
  a value that does not decode, more than `REPORT_CAP` bytes) scores the whole answer 0.0 with the
  reason, `refused` set: only the answer could have written it.

Deviation, on purpose: a failing assert no longer stops its test (the sandbox cannot tell that it
failed); the rest of the test runs, and the test fails here.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import operator
from dataclasses import dataclass
from typing import Sequence

__all__ = ["CHECK", "REPORT_CAP", "Check", "Grade", "instrument", "judge"]


CHECK = "__grpokit_check__"


REPORT_CAP = 8 * 2**20  # bytes the answer's process may send the relay


_OPS = {ast.Eq: "eq", ast.NotEq: "ne", ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge",
        ast.Is: "is", ast.IsNot: "is_not", ast.In: "in", ast.NotIn: "not_in"}


_APPLY = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
          "ge": operator.ge, "is": operator.is_, "is_not": operator.is_not,
          "in": lambda a, b: a in b, "not_in": lambda a, b: a not in b}


_SINGLETONS = (None, True, False)


_LOOPS = (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith)  # a check inside runs at least once


_BRANCHES = (ast.If, ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Match, ast.Lambda,
             getattr(ast, "TryStar", ast.Try))  # a check inside may rightly not run


@dataclass(frozen=True)
class Check:
    """One assert, as the trainer keeps it: `kind` "truthy" / "falsy" (one value sent) or "compare"
    (`ops` between `operands`, each ("lit", value) kept here or ("sent", j), the j-th value sent)."""

    kind: str
    runs: str  # "once" at the test's top level, "some" (>= 1) inside loops only, "any" under if/try/def/...
    ops: tuple[str, ...] = ()
    operands: tuple = ()
    strict: bool = True  # the values must come back as plain data (a kept literal is involved)


@dataclass(frozen=True)
class Grade:
    score: float  # in [0, 1]
    reason: str | None  # why it is below 1.0, when it is
    refused: bool = False  # the report was not the harness's: the answer wrote into it


def _literal(node: ast.AST):
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _classify(test: ast.expr, runs: str) -> tuple[Check, str | list[str] | None, list[ast.expr]]:
    """(the check kept here, the `ops` argument the sandbox gets, the expressions it evaluates)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return Check("falsy", runs, strict=False), "truth", [test.operand]
    if isinstance(test, ast.Compare) and all(type(op) in _OPS for op in test.ops):
        nodes = [test.left, *test.comparators]
        literals = [_literal(n) for n in nodes]
        ops = tuple(_OPS[type(op)] for op in test.ops)
        identity_ok = all(any(lit[0] and any(lit[1] is s for s in _SINGLETONS) for lit in literals[i:i + 2])
                          for i, op in enumerate(ops) if op in ("is", "is_not"))
        kept = any(is_lit for is_lit, _ in literals)
        if identity_ok and kept and not all(is_lit for is_lit, _ in literals):
            sent, operands = [], []
            for node, (is_lit, value) in zip(nodes, literals):
                operands.append(("lit", value) if is_lit else ("sent", len(sent)))
                if not is_lit:
                    sent.append(node)
            return Check("compare", runs, ops, tuple(operands)), None, sent
        if identity_ok and not kept:
            return (Check("compare", runs, ops, tuple(("sent", j) for j in range(len(nodes))), strict=False),
                    list(ops), nodes)
    return Check("truthy", runs, strict=False), "truth", [test]


class _Rewrite(ast.NodeTransformer):
    def __init__(self):
        self.checks: list[Check] = []
        self.loops = self.branches = 0

    def generic_visit(self, node):
        loop, branch = isinstance(node, _LOOPS), isinstance(node, _BRANCHES)
        self.loops, self.branches = self.loops + loop, self.branches + branch
        try:
            return super().generic_visit(node)
        finally:
            self.loops, self.branches = self.loops - loop, self.branches - branch

    def visit_Assert(self, node: ast.Assert) -> ast.stmt:  # noqa: N802 (ast's naming)
        runs = "any" if self.branches else "some" if self.loops else "once"
        check, ops, sent = _classify(node.test, runs)
        self.checks.append(check)
        args = [ast.Constant(len(self.checks) - 1), ast.Constant(ops) if not isinstance(ops, list)
                else ast.List([ast.Constant(o) for o in ops], ast.Load()), *sent]
        call = ast.Call(ast.Name(CHECK, ast.Load()), args, [])
        return ast.copy_location(ast.Expr(call), node)


@functools.lru_cache(maxsize=4096)  # the same tests come back for each of a group's answers
def instrument(test: str) -> tuple[str, tuple[Check, ...]]:
    """`test` with each assert turned into a check call, and the checks; a test that does not parse is
    sent as it is (it fails in the sandbox with its SyntaxError)."""
    try:
        tree = ast.parse(test)
        rewrite = _Rewrite()
        tree = ast.fix_missing_locations(rewrite.visit(tree))
        return ast.unparse(tree), tuple(rewrite.checks)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return test, ()


def _decode(x, depth: int = 0):
    """A value as the harness encodes it (`sandbox_harness`), or ValueError/TypeError."""
    if x is None or x is True or x is False:
        return x
    if depth > 60 or type(x) is not dict or len(x) != 1:
        raise ValueError("not an encoded value")
    (tag, v), = x.items()
    if tag in ("i", "f", "s", "b") and type(v) is not str:
        raise ValueError(f"{tag}: not a string")
    if tag == "i":
        return int(v)
    if tag == "f":
        return float.fromhex(v)
    if tag == "s":
        return v
    if tag == "b":
        return bytes.fromhex(v)
    if type(v) is not list:
        raise ValueError(f"{tag}: not a list")
    if tag == "c" and len(v) == 2 and all(type(p) is str for p in v):
        return complex(float.fromhex(v[0]), float.fromhex(v[1]))
    if tag == "d":
        return {_decode(k, depth + 1): _decode(w, depth + 1) for k, w in (_pair(p) for p in v)}
    kinds = {"l": list, "t": tuple, "S": set, "F": frozenset}
    if tag not in kinds:
        raise ValueError(f"unknown tag {tag!r}")
    return kinds[tag](_decode(w, depth + 1) for w in v)


def _pair(p):
    if type(p) is not list or len(p) != 2:
        raise ValueError("a dict item is not a pair")
    return p


def _holds(check: Check, payload: str) -> tuple[bool, str | None]:
    """(whether one check record holds, why not); ValueError when the record is malformed."""
    kind, _, data = payload.partition(" ")
    value = json.loads(data)
    if kind == "x":
        return False, f"an assert's value could not be sent ({str(value)[:100]})"
    if kind == "r":
        if check.strict or type(value) is not bool:
            raise ValueError("a result where a value was due")
        return (not value if check.kind == "falsy" else value), None
    if kind != "v" or type(value) is not list:
        raise ValueError("not a value record")
    values = [_decode(v) for v in value]
    if check.kind in ("truthy", "falsy"):
        if len(values) != 1:
            raise ValueError("one value expected")
        return bool(values[0]) is (check.kind == "truthy"), None
    operands = [v if how == "lit" else values[v] for how, v in check.operands]
    if len(values) != sum(how == "sent" for how, _ in check.operands):
        raise ValueError("wrong number of values")
    try:
        return all(_APPLY[op](a, b) for op, a, b in zip(check.ops, operands, operands[1:])), None
    except (TypeError, ValueError, ArithmeticError, RecursionError):
        return False, None


def judge(report: str, checks: Sequence[Sequence[Check]]) -> Grade:
    """The grade of one answer from the relay's JSON `report`, against the checks kept for each test."""
    try:
        summary = json.loads(report)
        lines, stray, status = summary["lines"], summary["stray"], summary["status"]
        if type(lines) is not list or not all(type(line) is str for line in lines) or type(stray) is not int:
            raise ValueError("wrong types")
    except Exception:  # noqa: BLE001 - whatever the report holds, it scores: a model's output never stops training
        return Grade(0.0, "the harness wrote no readable result", refused=True)
    if summary.get("overflow"):
        return Grade(0.0, f"the answer's process sent the harness over {REPORT_CAP >> 20} MiB", refused=True)
    if stray:
        return Grade(0.0, f"the answer wrote {stray} line(s) of its own into the harness's pipe", refused=True)
    if lines[:1] == ["answer raised"]:
        return Grade(0.0, "the answer's code raised")
    if lines[:1] != ["answer ok"] or lines[-1:] != ["done"] or status != 0:
        return Grade(0.0, "the program did not run to its end (a crash, a signal, an early exit or a hang)")
    try:
        passed, why = _tests_passed(lines[1:-1], checks)
    except Exception as e:  # noqa: BLE001 - e.g. OverflowError from a float the answer made too large to decode
        return Grade(0.0, f"a malformed report ({type(e).__name__}: {str(e)[:100]}): only the answer writes such "
                          f"lines", refused=True)
    score = min(1.0, max(0.0, passed / len(checks))) if checks else 0.0
    return Grade(score if math.isfinite(score) else 0.0, why)


def _tests_passed(lines: list[str], checks: Sequence[Sequence[Check]]) -> tuple[int, str | None]:
    """How many tests passed, from the report's lines in the order the harness writes them."""
    current, ok, counts, why, passed = 0, True, [0] * len(checks[0]) if checks else [], None, 0
    for line in lines:
        word, _, rest = line.partition(" ")
        if current >= len(checks):
            raise ValueError("a line after the last test")
        if word == "check":
            i, k, payload = rest.split(" ", 2)
            if int(i) != current or not 0 <= int(k) < len(checks[current]):
                raise ValueError(f"a check of test {i} during test {current}")
            counts[int(k)] += 1
            holds, reason = _holds(checks[current][int(k)], payload)
            ok, why = ok and holds, why or (None if holds else reason or f"test {current}: an assert failed")
            continue
        if word not in ("end", "raised") or int(rest) != current:
            raise ValueError(f"unexpected {word!r} in test {current}")
        ran = all(n == 1 if c.runs == "once" else n >= 1 if c.runs == "some" else True
                  for c, n in zip(checks[current], counts))
        if word == "end" and ok and ran:
            passed += 1
        elif why is None:
            why = f"test {current}: " + ("raised" if word == "raised" else "an assert did not run as often as it must")
        current += 1
        ok, counts = True, [0] * len(checks[current]) if current < len(checks) else []
    if current != len(checks):
        raise ValueError(f"{len(checks) - current} test(s) not reported")
    return passed, why
