"""Findings of the adversarial review of the code_execution grading rewrite and the new code (issue 26 point 0).

Each test reproduces one confirmed bug. While a bug is open its test is marked xfail(strict=True), so that
it fails the suite once it starts passing, prompting removal of the mark; a fixed one says "Fixed (how)".
One documents a limit instead (an `_exit` bound before grpokit was imported, which needs tools.isolation).
"""

from __future__ import annotations

import pytest

from grpokit.rewards.core import compute_rewards
from grpokit.rewards.registry import reward_specs
from grpokit.rewards.sandbox import code_execution_reward

WRONG = "def add(a, b):\n    return 0\n"
GOOD = "def add(a, b):\n    return a + b\n"

# The answer reaches the harness's private helper namespace through its caller's frame (answer()'s locals).
DROP_CHECK_LINES = ("import sys\np = sys._getframe(1).f_locals['private']\nw = p['write']\n"
                    "def filt(fd, data):\n    if b' check ' in data:\n        return len(data)\n"
                    "    return w(fd, data)\np['write'] = filt\n")
PATCH_PRISTINE = ("import sys\npr = sys._getframe(1).f_locals['pristine']\n"
                  "pr['sorted'] = lambda *a, **k: ['same']\npr['abs'] = lambda *a: 0.0\n")


def _reward():
    return code_execution_reward(time_limit=3.0, memory_mb=256, workers=4, sandbox="none")


def test_humaneval_style_check_function_cannot_be_forged():
    """Fixed (the tests run in a judge process the answer never ran in): asserts under def/if/try used to be
    'runs any', and an answer that dropped its check lines (via the harness's private dict reached from its
    frame) passed HumanEval-style tests."""
    tests = ["def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(1, 1) == 2\ncheck(add)",
             "if True:\n    assert add(2, 3) == 5"]
    assert _reward()([DROP_CHECK_LINES + WRONG, GOOD], [tests] * 2) == [0.0, 1.0]


def test_the_tests_builtins_cannot_be_patched_through_the_harness_frame():
    """Fixed (the tests' builtins are the judge's own): the per-test builtins came from a `pristine` dict the
    answer could reach through sys._getframe(1).f_locals."""
    code = PATCH_PRISTINE + "def add(a, b):\n    return 'same' if isinstance(a, int) else 7.0\n"
    tests = ["assert [add(2, 3)] == sorted([5])", "assert abs(add(0.1, 0.2) - 0.3) < 1e-9"]
    assert _reward()([code, GOOD], [tests] * 2) == [0.0, 1.0]


def test_math_isclose_patched_by_the_answer_does_not_pass():
    """Fixed (`math` in the tests is the judge's own module): a truthy assert on math.isclose was evaluated in
    the answer's interpreter, where the answer had patched the module."""
    code = "import math\nmath.isclose = lambda *a, **k: True\n" + WRONG
    tests = ["import math\nassert math.isclose(add(0.1, 0.2), 0.3)"]
    assert _reward()([code, GOOD], [tests] * 2) == [0.0, 1.0]


OVERFLOW = ("import sys\np = sys._getframe(1).f_locals['private']\n"
            "p['dumps'] = lambda x: '[{\"f\": \"0x1p99999\"}]'\n" + WRONG)


def test_an_overflowing_float_in_a_forged_report_does_not_stop_training():
    """Fixed (judge() scores any report it cannot decode 0.0): float.fromhex's OverflowError used to
    escape it, and the reward raised, which (on_error='raise') stopped the run."""
    specs = reward_specs(["code_execution"], args={"code_execution": {
        "time_limit": 3.0, "memory_mb": 256, "sandbox": "none"}})
    _, total = compute_rewards(specs, ["p"] * 2, [OVERFLOW, GOOD], [[1]] * 2,
                               {"tests": [["assert add(2, 3) == 5"]] * 2})
    assert total.tolist() == [0.0, 1.0]


def test_an_answer_cannot_rebind_the_tests_loop_variable():
    """Fixed (the tests' globals live in the judge): the tests ran in the answer's globals, so a wrong add that
    rebound the loop variable made the non-literal expected side `a + 1` equal its return value."""
    tests = ["assert add(2, 3) == 5", "assert add(-1, 4) == 3", "for a in range(3):\n    assert add(a, 1) == a + 1"]
    rebind = "def add(x, y):\n    globals()['a'] = 0\n    return 1\n"
    assert _reward()([rebind, GOOD], [tests] * 2) == [0.0, 1.0]


@pytest.mark.parametrize("rows", [
    pytest.param(['{"step": 1, "reward": 1e308, "entropy": 1e308}', '{"step": 2, "reward": -1e308, "entropy": 0}'],
                 id="finite-values-whose-range-overflows"),
    pytest.param(['{"step": 1, "reward": 1' + "0" * 400 + '}'], id="an-integer-too-large-for-a-float"),
])
def test_report_on_extreme_metrics_is_no_traceback(tmp_path, rows):
    """Fixed (charts.finite_value leaves out numbers past 1e300 in size): a range of +-1e308 or an int past
    float's range used to raise OverflowError in `grpokit report`."""
    import subprocess
    import sys

    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    r = subprocess.run([sys.executable, "-m", "grpokit.cli", "report", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert "Traceback" not in r.stderr and r.returncode in (0, 2), r.stderr[-500:]


_TOOL_EXIT = '''
import os, signal, sys, threading
from os import _exit as early_exit, kill as early_kill  # bound when the tool module loads, before grpokit
from grpokit.rollout.tools import ToolBox, ToolCall
from os import _exit as late_exit  # bound after grpokit was imported (a tool module the CLI loads)
HOW, ISOLATION = {how!r}, {isolation!r}

def t(x: int) -> str:
    """A tool.

    Args:
        x: anything
    """
    if HOW == "thread":  # a thread the tool starts is not a guarded thread
        th = threading.Thread(target=os._exit, args=(7,)); th.start(); th.join()
    elif HOW == "early":
        early_exit(7)
    elif HOW == "late":
        late_exit(7)
    elif HOW == "early_kill":
        early_kill(os.getpid(), signal.SIGKILL)
    else:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGKILL)
    return "ok"

if __name__ == "__main__":
    box = ToolBox([t], timeout_s=5)
    if ISOLATION == "process":
        from grpokit.rollout.tool_workers import ToolHost, ToolWorkers
        box.workers, box.answer = ToolWorkers(ToolHost([__file__ + ":t"], {{}}, 5, 100_000), 1), 0
    result = box.run([ToolCall("t", {{"x": 1}})])[0]
    print(result.failed, flush=True)
    print(result.content, file=sys.stderr, flush=True)
'''


def _tool_exit(tmp_path, how, isolation="none"):
    import subprocess
    import sys

    script = tmp_path / f"tool_exit_{how}_{isolation}.py"
    script.write_text(_TOOL_EXIT.format(how=how, isolation=isolation))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("how", ["thread", "pthread_kill", "late", "early_kill"])
def test_tool_exits_the_guard_does_not_see_do_not_end_the_trainer(tmp_path, how):
    """Fixed (exit_guard.py): threads a tool starts inherit its guard, and an audit hook stops
    os.kill / os.killpg / signal.pthread_kill however they were bound; `from os import _exit` in a module
    loaded after grpokit binds the guarded one. The exit used to end the trainer."""
    r = _tool_exit(tmp_path, how)
    assert r.returncode == 0 and r.stdout.strip() == "True", (r.returncode, r.stdout, r.stderr[-300:])
    assert "would end the trainer" in r.stderr or "to a thread of the trainer" in r.stderr or \
        "to the trainer's own process" in r.stderr, r.stderr[-300:]


@pytest.mark.parametrize("isolation", ["none", "process"])
def test_an_exit_bound_before_grpokit_was_imported_needs_process_isolation(tmp_path, isolation):
    """The limit, documented in exit_guard.py and docs/TOOLS.md: `from os import _exit` taken before
    grpokit was imported is the real C function, which raises no audit event, so nothing in-process can stop
    it; it ends the trainer. Under tools.isolation = "process" the tool runs in a worker: a failed call."""
    r = _tool_exit(tmp_path, "early", isolation)
    if isolation == "none":
        assert r.returncode == 7 and r.stdout == "", (r.returncode, r.stdout, r.stderr[-300:])
    else:
        assert r.returncode == 0 and r.stdout.strip() == "True", (r.returncode, r.stdout, r.stderr[-300:])
        # the worker imports grpokit before the tool's module, so there even this _exit is the guarded one
        assert "os._exit(7)" in r.stderr or "worker process died (exit code 7)" in r.stderr, r.stderr[-300:]


@pytest.mark.parametrize("test", ["assert add(2, 3) == 5 and add(1, 1) == 2",
                                  "assert all(add(a, 1) == a + 1 for a in range(3))",
                                  "assert (add(2, 3) == 5) is True"])
def test_an_object_whose_eq_says_yes_fails_nested_comparisons(test):
    """Fixed (an answer's object is a handle in the judge, unequal to any plain value): only a top-level
    Compare kept its literal, so a comparison nested in and/all()/`is True` trusted a lying __eq__."""
    liar = "class A:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return A()\n"
    assert _reward()([liar, GOOD], [[test]] * 2) == [0.0, 1.0]


def test_a_correct_answer_to_a_long_assert_loop_scores_one():
    """Fixed (no report size cap: each call is a request to the answer's process): every assert run sent one
    line, and 100000 of them passed the old 8 MiB cap and scored 0.0 as a forged report."""
    reward = code_execution_reward(time_limit=10.0, memory_mb=512, sandbox="none")
    assert reward(["def sq(x):\n    return x * x\n"], [["for i in range(100000):\n    assert sq(i) == i * i"]]) == [1.0]


def test_a_correct_answer_returning_an_object_passes_is_not_none():
    """Fixed (identity is the judge's: a handle is not None): `x is not None` used to need x as plain data,
    so a correct answer returning its own object failed."""
    code = "class Node:\n    def __init__(self, v):\n        self.v = v\ndef build(v):\n    return Node(v)\n"
    assert _reward()([code], [["assert build(1) is not None", "assert build(2).v == 2"]]) == [1.0]


def test_an_environment_reset_raising_keyboardinterrupt_is_an_environment_fault():
    """Fixed (call_within turns a KeyboardInterrupt from its thread into an error naming it): reset's own
    KeyboardInterrupt used to read as a Ctrl-C (exit 130, naming nothing)."""
    from grpokit.errors import EnvironmentFault
    from grpokit.rollout.environments import Environments

    class Env:
        def reset(self, **row):
            raise KeyboardInterrupt

        def t(self, x: int) -> str:
            """A tool.

            Args:
                x: anything
            """
            return "x"

    try:  # a KeyboardInterrupt escaping a test would stop pytest's whole session
        Environments(Env).start([{"prompt": "p"}])
        raised = None
    except BaseException as e:  # noqa: BLE001
        raised = e
    assert isinstance(raised, EnvironmentFault), repr(raised)


def test_resume_from_a_checkpoint_with_damaged_tensor_data_is_no_traceback(tiny_model_dir, tmp_path):
    """Fixed (training/checkpoint.py checks the tensors it reads at resume for NaN): a newest checkpoint whose
    model.safetensors data bytes were damaged (NaN weights, the header intact) was resumed, and sampling
    ended in a traceback (rollout/sampling.py: 'index -1 is out of bounds'). Now one error line naming the
    file, the tensor and the checkpoint to continue from."""
    from fault_harness import assert_user_error, run_cli, write_train_config

    run = tmp_path / "run"
    assert run_cli("train", write_train_config(tmp_path, tiny_model_dir, run, steps=2)).returncode == 0
    weights = run / "checkpoint-2" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100:] = b"\xff" * 100  # the last tensor's bytes: NaN, the header intact
    weights.write_bytes(bytes(data))
    r = run_cli("train", write_train_config(tmp_path, tiny_model_dir, run, steps=3), "--resume")
    line = assert_user_error(r, str(run / "checkpoint-2"), "model.safetensors", "holds NaN values",
                             "--resume again to continue from checkpoint-1")
    assert line.count("error:") == 1
