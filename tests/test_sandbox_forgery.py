"""Answers that go after the grade instead of the machine: every route from the answer's code to the
harness's report (issue 26, point 0), at each sandbox level this machine gives and with
`rewards.isolation = "process"`. Each forger defines a wrong `add`, so any score above 0.0 is a forgery;
the correct answer next to it in the same batch scores 1.0.

The bubblewrap cases skip, giving the reason, where bubblewrap is not in force; with
GRPOKIT_REQUIRE_SANDBOX=1 (set once scripts/ensure_bubblewrap.sh installed it) they fail instead.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch

from fault_harness import assert_user_error, run_cli, write_train_config
from grpokit.algorithms.advantages import group_advantages
from grpokit.config.loading import config_from_dict
from grpokit.rewards.core import compute_rewards
from grpokit.rewards.registry import reward_specs
from grpokit.rewards.sandbox import code_execution_reward, sandbox_isolation
from grpokit.rewards.sandbox_checks import Grade, judge

LEVEL, MESSAGE = sandbox_isolation()
REQUIRED = os.environ.get("GRPOKIT_REQUIRE_SANDBOX") == "1"
SANDBOXES = [pytest.param("none", id="rlimits"),
             pytest.param("bubblewrap", id="bubblewrap", marks=pytest.mark.skipif(
                 LEVEL != "bubblewrap" and not REQUIRED, reason=f"bubblewrap is not in force here ({MESSAGE})"))]

TESTS = ["assert add(2, 3) == 5", "assert add(-1, 4) == 3", "for a in range(3):\n    assert add(a, 1) == a + 1"]
GOOD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 0\n"

# Lines the old harness (and any like it) would take as a result, in every format an answer might guess.
FAKE_LINES = "'done 3 3\\nend 0\\nend 1\\nend 2\\ndone\\n'"

FORGERS = {  # route -> the answer's code (each also defines the wrong add)
    "__main__.report(500) then os._exit(0)":
        'import __main__\n__main__.report("done", 1000, 3)\nimport os\nos._exit(0)\n',
    "__main__.report of a non-number": 'import __main__\n__main__.report("done", "x", 3)\nimport os\nos._exit(0)\n',
    "builtins.exec replaced": "import builtins\nbuiltins.exec = lambda *a, **k: None\n",
    "builtins.compile replaced": ("import builtins\n_c = builtins.compile\n"
                                  "builtins.compile = lambda src, name, mode: _c('pass', name, mode)\n"),
    "json.dumps and sys.modules patched": ("import json, sys, types\njson.dumps = lambda *a, **k: '[true]'\n"
                                           "sys.modules['json'] = types.SimpleNamespace(dumps=json.dumps)\n"),
    "an int subclass that equals everything": ("class I(int):\n    def __eq__(self, other):\n        return True\n"
                                               "    __hash__ = int.__hash__\n"),
    "an object that equals everything": "class A:\n    def __eq__(self, other):\n        return True\n",
    "its own __grpokit_check__": "def __grpokit_check__(*a):\n    pass\n",
    "the harness's frames: report/send with its secret": (
        "import sys, os\nf = sys._getframe()\nwhile f is not None:\n"
        "    for scope in (f.f_locals, f.f_globals):\n"
        "        if callable(scope.get('report')):\n"
        "            scope['report']('done', 3, 3)\n            os._exit(0)\n"
        "        if callable(scope.get('send')):\n"
        "            for line in ('answer ok', 'end 0', 'end 1', 'end 2', 'done'):\n"
        "                scope['send'](line)\n"
        "        for k, v in list(scope.items()):\n"
        "            if k in ('nonce', 'token') and isinstance(v, str):\n"
        "                for fd in range(3, 8):\n"
        "                    try:\n"
        "                        os.write(fd, (v + ' done 3 3\\n' + v + ' check 0 0 r true\\n').encode())\n"
        "                    except OSError:\n                        pass\n"
        "    f = f.f_back\nos._exit(0)\n"),
    "fake lines into every descriptor in /proc/self/fd": (
        "import os\nfor name in os.listdir('/proc/self/fd'):\n    try:\n"
        f"        os.write(int(name), {FAKE_LINES}.encode())\n    except OSError:\n        pass\n"),
    "fake lines on stdout and stderr": f"import sys\nprint({FAKE_LINES})\nsys.stderr.write({FAKE_LINES})\n",
    "sys.exit(0) before the tests": "import sys\nsys.exit(0)\n",
    "a BaseException subclass": "class Out(BaseException):\n    pass\nraise Out()\n",
    "KeyboardInterrupt": "raise KeyboardInterrupt\n",
    "an atexit hook that prints a result": f"import atexit, sys\natexit.register(print, {FAKE_LINES})\nsys.exit(0)\n",
    "killing the harness's process": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "a signal handler that writes during the tests": (
        "import os, signal\n"
        f"signal.signal(signal.SIGALRM, lambda *a: [os.write(fd, {FAKE_LINES}.encode()) for fd in (1, 2, 3)])\n"
        "signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)\n"),
    "a thread that writes while the tests run": (
        "import os, threading, time\ndef spam():\n    while True:\n        for fd in (3, 4):\n"
        f"            try:\n                os.write(fd, {FAKE_LINES}.encode())\n"
        "            except OSError:\n                pass\n        time.sleep(0.001)\n"
        "threading.Thread(target=spam, daemon=True).start()\n"),
    "a forked child that reports after the answer": (
        "import os, time\nif os.fork() == 0:\n    time.sleep(0.3)\n    for fd in range(3, 8):\n        try:\n"
        f"            os.write(fd, {FAKE_LINES}.encode())\n        except OSError:\n            pass\n"
        "    os._exit(0)\n"),
    "builtins.range emptied (a test's loop runs no assert)": "import builtins\nbuiltins.range = lambda *a: []\n",
    "a global range of its own that yields nothing": "def range(*a):\n    return []\n",
    "settrace skipping the test lines": (
        "import sys\ndef tracer(frame, event, arg):\n    if frame.f_code.co_filename.startswith('<test'):\n"
        "        return None\n    return tracer\nsys.settrace(tracer)\n"),
}


def forge(reward) -> dict[str, float | None]:
    """Each forger followed by the correct answer, in one batch; scores by name."""
    names, answers = [], []
    for name, code in FORGERS.items():
        names += [name, f"correct after: {name}"]
        answers += [code + WRONG if "I(int)" not in code and "class A" not in code else
                    code + ("def add(a, b):\n    return I(0)\n" if "I(int)" in code else
                            "def add(a, b):\n    return A()\n"), GOOD]
    return dict(zip(names, reward(answers, [TESTS] * len(answers))))


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_no_route_from_the_answer_to_the_report_forges_a_score(sandbox):
    reward = code_execution_reward(time_limit=3.0, memory_mb=256, workers=4, sandbox=sandbox)
    scores = forge(reward)
    expected = {name: 0.0 if name in FORGERS else 1.0 for name in scores}
    assert scores == expected
    reasons = {name: g.reason for name, g in zip(scores, reward.last_grades)}
    assert all(reasons[n] for n in FORGERS), reasons
    assert reasons["fake lines into every descriptor in /proc/self/fd"].startswith("the answer wrote")


def test_answers_that_write_into_the_report_are_counted_in_the_metrics():
    reward = code_execution_reward(time_limit=3.0, memory_mb=256, sandbox="none")
    logged = []
    scores = reward([FORGERS["fake lines into every descriptor in /proc/self/fd"] + GOOD, GOOD], [TESTS] * 2,
                    log_metric=lambda name, value: logged.append((name, value)))
    assert scores == [0.0, 1.0] and logged == [("code_execution/refused_reports", 1)]
    assert reward.last_grades[0].refused and "into the harness" in reward.last_grades[0].reason
    assert reward.last_grades[1] == Grade(1.0, None)


def test_a_verdict_cannot_leave_the_rewards_range_or_stop_training():
    """The judge's verdict as the trainer reads it: whatever the file holds, the score is in [0, 1] and
    nothing raises."""
    def verdict(passed, end="ok", why=None):
        return json.dumps({"passed": passed, "end": end, "why": why})

    assert judge(verdict([True, True]), 2) == Grade(1.0, None)
    assert judge(verdict([True, False], why="test 1: AssertionError: "), 2) == Grade(0.5, "test 1: AssertionError: ")
    broken = {"more passes than tests": verdict([True] * 3), "fewer": verdict([True]), "a number": verdict([500]),
              "a string": verdict(["yes", "yes"]), "no tests": verdict([]), "an unknown end": verdict([True] * 2, "x"),
              "the answer raised": verdict([], "raised"), "died": verdict([True, True], "died"),
              "empty": "", "not JSON": "not json", "a list": json.dumps([1000]),
              "a nested blob": "[" * 5000 + "]" * 5000, "wrong field types": json.dumps(
                  {"passed": "x", "end": "ok", "why": None})}
    for name, text in broken.items():
        grade = judge(text, 2)
        assert grade.score == 0.0 and grade.reason, name
    assert judge(verdict([], "refused", "a frame of 1685024357 bytes"), 2).refused


MEMORY_SCAN = """
import ctypes, re
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE 1: its own /proc/self/mem, where the judge made it 0
MARK = re.compile(rb'EXPECTED[-]VALUE[-]7163')  # no byte string in memory matches it but the marker's
def leaked():
    found = []
    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith('r'):
                continue
            start, end = (int(x, 16) for x in span.split('-'))
            try:
                mem.seek(start)
                data = mem.read(end - start)
            except (OSError, ValueError, OverflowError):
                continue
            found.append(len(MARK.findall(data)))
    return sum(found)
"""


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_the_tests_never_enter_the_answers_process(sandbox):
    """The answer's process reads all its own memory while a test runs: the tests' text, with their expected
    values, is nowhere in it (the judge forks it before it reads them), and its scan is judged outside it."""
    reward = code_execution_reward(time_limit=5.0, memory_mb=512, sandbox=sandbox)
    tests = ["assert leaked() == 0, 'EXPECTED-VALUE-7163'", "x = 'EXPECTED-VALUE-7163'\nassert leaked() == 0"]
    assert reward([MEMORY_SCAN], [tests]) == [1.0], reward.last_grades
    assert reward([MEMORY_SCAN.replace("EXPECTED[-]VALUE[-]7163", "def[ ]leaked")], [tests]) == [0.0]


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_honest_asserts_still_grade_as_python_would(sandbox):
    reward = code_execution_reward(time_limit=3.0, memory_mb=256, sandbox=sandbox)
    code = ("import math\nclass P:\n    def __init__(self, x):\n        self.x = x\n"
            "    def __eq__(self, other):\n        return isinstance(other, P) and other.x == self.x\n"
            "def sq(x):\n    return x * x\ndef half(x):\n    return x / 2\ndef none():\n    return None\n")
    tests = [["assert sq(3) == 9", "assert sq(-2) != 5", "assert half(1) == 0.5", "assert 4 in [sq(2)]",
              "assert none() is None", "assert P(1) == P(1)", "assert sq(2) < 5 <= sq(3)",
              "assert math.isclose(half(0.3), 0.15)", "for i in range(4):\n    assert sq(i) == i * i",
              "assert not sq(0)", "assert sq(2) == 5", "assert [sq(1), (2, {'a': b'x'})] == [1, (2, {'a': b'x'})]"]]
    assert reward([code], tests) == [11 / 12]


def test_with_process_isolation_forgery_scores_zero_and_the_correct_answer_keeps_its_advantage():
    """Issue 26: under rewards.isolation = "process" a forged 500.0 pushed the correct answer's advantage
    to -0.574, and a forged non-number stopped the run; a group of 4: forgeries, the correct one, a wrong one."""
    config = config_from_dict({"model": {"path": "m"}, "data": {"path": "d.jsonl"},
                               "rewards": {"functions": ["code_execution"], "isolation": "process"},
                               "rollout": {"group_size": 4}})
    from grpokit.training.rollout_setup import isolate_rewards

    specs, pool = isolate_rewards(config, reward_specs(["code_execution"], args={"code_execution": {
        "time_limit": 3.0, "memory_mb": 256}}))
    answers = [FORGERS["__main__.report(500) then os._exit(0)"] + WRONG,
               FORGERS["__main__.report of a non-number"] + WRONG, GOOD, WRONG]
    per_fn, total = compute_rewards(specs, ["p"] * 4, answers, [[1]] * 4, {"tests": [TESTS] * 4})
    assert total.tolist() == [0.0, 0.0, 1.0, 0.0]
    advantages = group_advantages(total, 4)
    assert advantages[2] > 1.0 and bool((advantages[[0, 1, 3]] < 0).all())
    assert specs[0].fn.__name__ == "code_execution"  # self-bounded: its sandbox runs it, not a reward worker
    pool.close()


def test_a_code_execution_run_without_a_tests_column_fails_at_start_up(tiny_model_dir, tmp_path):
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Write add, {i}", "answer": "x"}) + "\n" for i in range(4)))
    run = tmp_path / "run"
    cfg = write_train_config(tmp_path, tiny_model_dir, run, steps=1, data_path=data, rewards=["code_execution"],
                             extra=textwrap.dedent("""\
                                 [rewards.args.code_execution]
                                 time_limit = 2.0
                                 """))
    line = assert_user_error(run_cli("train", str(cfg)), "code_execution", "'tests'", str(data))
    assert "add 'tests' to every row" in line and "rewards.functions" in line
    assert not run.exists(), "the run folder was prepared before the missing column was found"


@pytest.mark.parametrize("isolation", ["none", "process"])
def test_reward_setup_names_the_missing_column(isolation, tmp_path):
    from grpokit.errors import RewardLoadError
    from grpokit.training.rollout_setup import resolve_reward_specs

    config = config_from_dict({"model": {"path": "m"}, "data": {"path": "d.jsonl"},
                               "rewards": {"functions": ["code_execution"], "isolation": isolation}})
    with pytest.raises(RewardLoadError, match=r"'code_execution' needs the column\(s\) \['tests'\], which d.jsonl "
                                              r"lacks \(columns: \['answer', 'prompt'\]\)"):
        resolve_reward_specs(config, None, rows=[{"prompt": "p", "answer": "a"}])
    assert resolve_reward_specs(config, None, rows=[{"prompt": "p", "tests": None}])
    assert torch.isnan(compute_rewards(resolve_reward_specs(config, None, rows=[{"prompt": "p", "tests": None}]),
                                       ["p"], [GOOD], [[1]], {"tests": [None]})[1]).all()
