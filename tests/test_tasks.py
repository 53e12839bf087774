"""Tasks: deterministic generators, disjoint splits, verifiers that accept the SFT targets and nothing wrong."""

from __future__ import annotations

import json
import random

import pytest

from grpokit.data.files import load_prompts
from grpokit.data.prompts import columns_of
from grpokit.rewards.core import compute_rewards
from grpokit.rewards.verifiers import parse_expression, score_expression
from grpokit.tasks import get_task
from grpokit.tasks.addition import AdditionTask
from grpokit.tasks.base import Task
from grpokit.tasks.countdown import CountdownTask


@pytest.mark.parametrize("name", ["addition", "countdown"])
def test_tasks_follow_the_protocol_and_are_deterministic(name):
    task = get_task(name)
    assert isinstance(task, Task) and task.name == name
    assert task.generate(50, seed=1) == task.generate(50, seed=1)
    assert task.generate(50, seed=1) != task.generate(50, seed=2)
    assert task.generate(0, seed=1) == []


@pytest.mark.parametrize("name, kwargs", [("addition", {}), ("addition", {"digits": 4}),
                                          ("countdown", {}), ("countdown", {"num_numbers": 4})])
def test_verifier_accepts_every_sft_target_through_compute_rewards(name, kwargs):
    task = get_task(name, **kwargs)
    rows = task.generate(300, seed=0)
    rng = random.Random(0)
    targets = [task.sft_target(row, rng) for row in rows]
    assert all(task.is_correct(t, row) for t, row in zip(targets, rows))
    assert all(all(32 <= ord(ch) < 127 for ch in row["prompt"] + t) for row, t in zip(rows, targets))
    per_fn, total = compute_rewards(task.reward_functions(), [r["prompt"] for r in rows], targets,
                                    [[0] * len(t) for t in targets], columns_of(rows))
    assert total.tolist() == [1.0] * len(rows)


def test_splits_are_disjoint_and_exclude_works():
    task = AdditionTask(digits=2)
    train = {r["prompt"] for r in task.generate(2000, seed=0, split="train")}
    held = task.generate(200, seed=5, split="eval")
    assert not train & {r["prompt"] for r in held}
    more = task.generate(300, seed=0, exclude=train)
    assert not train & {r["prompt"] for r in more}
    cd = CountdownTask()
    a = {r["prompt"] for r in cd.generate(300, seed=0, split="train")}
    assert not a & {r["prompt"] for r in cd.generate(100, seed=0, split="eval")}


def test_a_too_small_prompt_space_is_reported():
    task = AdditionTask(digits=1)  # 100 prompts
    everything = {f"{a}+{b}=" for a in range(10) for b in range(10)}
    with pytest.raises(ValueError, match=r"addition: found only 0 of 3 prompts outside `exclude`"):
        task.generate(3, seed=0, exclude=everything)


def test_addition_rows_and_verifier():
    row = {"prompt": "12+34=", "answer": "46"}
    task = AdditionTask()
    assert task.is_correct("46", row) and task.is_correct(" 46\n", row)
    for wrong in ["45", "046", "4 6", "46=46", "", "x46", "The answer is 46", "46\n46"]:
        assert not task.is_correct(wrong, row), wrong
    for r in task.generate(100, seed=3):
        a, b = r["prompt"].rstrip("=").split("+")
        assert r["answer"] == str(int(a) + int(b)) and 0 <= int(a) <= 99 and r["prompt"].endswith("=")
        assert not task.is_correct(str(int(r["answer"]) + 1), r)


def test_addition_zero_padded_and_reversed_answers():
    """zero_pad fixes every digit's position; reverse_answer writes the sum from its last digit (the demo's form)."""
    padded, both = AdditionTask(zero_pad=True), AdditionTask(zero_pad=True, reverse_answer=True)
    assert padded.render_sum(52) == "052" and both.render_sum(52) == "250" and both.render_sum(198) == "891"
    assert AdditionTask(reverse_answer=True).render_sum(52) == "25" and AdditionTask().render_sum(7) == "7"
    assert AdditionTask(digits=3, zero_pad=True).render_sum(52) == "0052"
    rows = both.generate(200, seed=1)
    for r in rows:
        a, b = r["prompt"].rstrip("=").split("+")
        assert len(a) == len(b) == 2 and len(r["answer"]) == 3  # every example the same shape
        assert int(r["answer"][::-1]) == int(a) + int(b) == AdditionTask.total(r)
        assert both.is_correct(r["answer"], r) and not both.is_correct(str(int(a) + int(b)).zfill(3), r) \
            or r["answer"] == r["answer"][::-1]  # a palindrome (e.g. 101) reads the same both ways
    assert any(r["prompt"].startswith("0") for r in rows)  # one-digit operands are padded
    assert AdditionTask.total({"prompt": "07+45="}) == 52 == AdditionTask.total({"prompt": "7+45="})
    # the held-out split stays disjoint from the training one in every form
    train, held = both.generate(2000, seed=0, split="train"), both.generate(200, seed=0, split="eval")
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}


def test_countdown_rows_are_compact_and_consistent():
    for r in CountdownTask(num_numbers=4).generate(100, seed=0):
        assert r["prompt"] == f"{' '.join(map(str, r['numbers']))} -> {r['target']}:"
        assert len(r["numbers"]) == 4 and 1 <= r["target"] <= 100
        value, used = parse_expression(r["answer"])
        assert value == r["target"] and len(used) >= 2


ROW = {"prompt": "3 7 25 -> 75:", "numbers": [3, 7, 25], "target": 75, "answer": "3*25"}


@pytest.mark.parametrize("completion", ["3*25", " 25*3\n", "(3)*(25)", "((25))*3",
                                        "<think>hm</think><answer>3*25</answer>"])
def test_countdown_accepts_correct_expressions(completion):
    assert CountdownTask().is_correct(completion, ROW)


@pytest.mark.parametrize("completion, why", [
    ("25*3*3/3", "reuses 3"),
    ("25+25+25", "reuses 25"),
    ("75", "a number not given"),
    ("3*25+0", "an extra number"),
    ("3*25*1", "an extra number"),
    ("25*3+7", "wrong value"),
    ("25*3+7-7", "reuses 7"),
    ("3 * 25 = 75", "not an expression"),
    ("-3*-25", "unary minus"),
    ("3**2", "power"),
    ("25//1*3", "floor division"),
    ("__import__('os').system('true')", "code"),
    ("(lambda: 75)()", "code"),
    ("3.0*25", "float"),
    ("25*3/(7-7)", "division by zero"),
    ("(" * 60 + "3" + ")" * 60, "too long"),
    ("", "empty"),
])
def test_countdown_rejects(completion, why):
    assert not CountdownTask().is_correct(completion, ROW), why


def test_countdown_reward_scores_and_format_score():
    fn = get_task("countdown", format_score=0.1).reward_functions()[0].fn
    got = fn(["3*25", "3+25", "25*25*25", "oops", "25/(7-7)"], numbers=[[3, 7, 25]] * 5, target=[75] * 5)
    assert got == [1.0, 0.1, 0.1, 0.0, 0.1]
    assert score_expression("3*25", "3 7 25", "75") == 1.0  # columns read back from CSV as strings
    assert score_expression("7*3", [3, 7, 25], 75) == 0.0


def test_countdown_rows_survive_jsonl(tmp_path):
    task = CountdownTask()
    rows = task.generate(20, seed=0)
    path = tmp_path / "cd.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_prompts(path)
    assert loaded == rows
    assert all(task.is_correct(task.sft_target(r, random.Random(0)), r) for r in loaded)


@pytest.mark.parametrize("call, pattern", [
    (lambda: get_task("modulo"),
     r"unknown task 'modulo'; known tasks: addition, countdown, gridworld, multiplication, shapes"),
    (lambda: get_task("addition", digit=3), r"task 'addition' got arguments \['digit'\].*accepts: digits"),
    (lambda: get_task("addition", digits=0), r"addition: digits must be an integer from 1 to 18, got 0"),
    (lambda: get_task("addition", zero_pad="yes"), r"addition: zero_pad must be true or false, got 'yes'"),
    (lambda: get_task("addition", reverse_answer=1), r"addition: reverse_answer must be true or false, got 1"),
    (lambda: get_task("countdown", num_numbers=1), r"countdown: num_numbers must be an integer >= 2, got 1"),
    (lambda: get_task("countdown", format_score=1.0), r"countdown: format_score must be in \[0, 1\)"),
    (lambda: AdditionTask().generate(5, 0, split="test"), r"split must be one of \(None, 'train', 'eval'\)"),
    (lambda: AdditionTask().generate(-1, 0), r"addition: n must be a non-negative integer"),
])
def test_task_errors(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()
