"""rewards.isolation = "process" in a real run: the same numbers as in-process, and a reward function that
hangs or crashes in native code is killed (its answers ungraded with on_error = "skip", or one error line)
while training goes on. The pool itself is tested in test_reward_isolation.py."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import PARITY_SOURCE, comparable, make_config
from grpokit.config.schema import RewardConfig
from grpokit.errors import RewardTimeoutError
from grpokit.training.loop import train

REWARDS = PARITY_SOURCE + '''

def hangs(completions, **kwargs):
    import time
    time.sleep(1000)


def crashes(completions, **kwargs):
    import ctypes
    return [ctypes.string_at(0)] * len(completions)  # a segfault in native code
'''


@pytest.fixture
def rewards_file(tmp_path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _config(model_dir, out, rewards_file, functions, **rewards):
    config = make_config(model_dir, out, steps=2)
    return replace(config, rewards=RewardConfig(functions=tuple(f if f == "addition" else f"{rewards_file}:{f}"
                                                               for f in functions), **rewards))


def test_isolated_rewards_give_the_numbers_of_in_process_ones(tiny_model_dir, tmp_path, rewards_file):
    one = train(_config(tiny_model_dir, tmp_path / "none", rewards_file, ["parity", "addition"]))
    # the same functions named from Python (a reference and a built-in name among reward_functions)
    two = train(_config(tiny_model_dir, tmp_path / "process", rewards_file, [], isolation="process", workers=2),
                reward_functions=[f"{rewards_file}:parity", "addition"])
    assert comparable(_rows(two)) == comparable(_rows(one))
    assert _rows(one)[0]["rewards/parity/std"] > 0  # something to compare


def test_a_hung_or_crashing_reward_is_killed_and_training_goes_on(tiny_model_dir, tmp_path, rewards_file):
    config = _config(tiny_model_dir, tmp_path / "skip", rewards_file, ["hangs", "crashes", "addition"],
                     isolation="process", timeout_s=0.5, on_error="skip")
    run = train(config)
    for row in _rows(run):
        assert row["rewards/hangs/ungraded"] == 16 and row["rewards/crashes/ungraded"] == 16
        assert row["rewards/addition/mean"] == row["rewards/addition/mean"]  # graded: not NaN
    assert (run / "checkpoint-2").is_dir()
    assert not [p for p in _children(os.getpid())]  # every worker gone with the run

    config = _config(tiny_model_dir, tmp_path / "raise", rewards_file, ["hangs"], isolation="process",
                     timeout_s=0.5)
    with pytest.raises(RewardTimeoutError, match="hangs.*0.5"):
        train(config)


def _children(pid: int) -> list[int]:
    """Live (not zombie) child processes of `pid`, but multiprocessing's resource tracker: one per interpreter, started
    by the first spawned process that shares a lock or queue (an async run earlier in this pytest process) and kept
    until the interpreter exits, by design; this test asks after what the run itself started."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z" and b"multiprocessing.resource_tracker" not in command:
                out.append(int(entry.name))
    return out


def test_skip_with_a_grader_that_always_fails_stops_after_max_consecutive_skips(tiny_model_dir, tmp_path,
                                                                                rewards_file, capsys):
    """rewards.on_error = "skip" and the only reward crashing on every answer: the run used to go on to its
    last step (exit 0) having learned nothing, its only diagnostic blaming the prompts. Now it stops after
    train.max_consecutive_skips such steps with one error naming the function; the steps before it are saved."""
    from grpokit.errors import RewardError

    config = _config(tiny_model_dir, tmp_path / "run", rewards_file, ["crashes"], isolation="process",
                     on_error="skip")
    config = replace(config, train=replace(config.train, steps=8, max_consecutive_skips=3),
                     output=replace(config.output, save_every=1))
    with pytest.raises(RewardError, match=r"no answer was graded in 3 steps in a row: reward function 'crashes' "
                                          r"failed on every answer .*newest checkpoint is .*checkpoint-2"):
        train(config)
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["frac_reward_zero_std"] is None for r in rows)  # no graded group: not "the prompts are too easy"
    assert "too easy or too hard" not in capsys.readouterr().out
    # a step with any graded answer resets the count: the same grader beside one that works trains on
    mixed = _config(tiny_model_dir, tmp_path / "mixed", rewards_file, ["crashes", "addition"], isolation="process",
                    on_error="skip")
    train(replace(mixed, train=replace(mixed.train, steps=4, max_consecutive_skips=2)))
    assert [r["step"] for r in _rows(tmp_path / "mixed")] == [1, 2, 3, 4]


@pytest.mark.parametrize("exit_call, said", [
    ("os._exit(3)", "reward function 'exits' called os._exit(3), which would end the trainer"),
    ("sys.exit(0)", "reward function 'exits' called sys.exit(0), which would end the run as if it had finished"),
])
def test_a_reward_that_calls_os_exit_in_the_trainer_is_one_error_naming_it(tiny_model_dir, tmp_path, exit_call,
                                                                           said):
    """Issue 43.9, fixed (exit_guard.py guards reward functions run in the trainer's process): a reward function
    calling os._exit(3) with rewards.isolation = "none" (sync mode) ended `grpokit train` with exit 3 and no word.
    Now the run stops with one error naming the function and rewards.isolation = "process"."""
    import subprocess
    import sys

    (tmp_path / "exits.py").write_text(f"import os\nimport sys\n\n\ndef exits(completions, **kwargs):\n"
                                       f"    {exit_call}\n")
    (tmp_path / "run.toml").write_text(
        f'[model]\npath = "{tiny_model_dir}"\n[data]\ntask = "addition"\nnum_prompts = 8\n'
        f'[rollout]\ngroup_size = 2\nmax_new_tokens = 3\n[rewards]\nfunctions = ["{tmp_path / "exits.py"}:exits"]\n'
        f'[train]\nsteps = 2\nprompts_per_step = 2\n[output]\ndir = "{tmp_path / "run"}"\nconsole = false\n')
    r = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(tmp_path / "run.toml")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode not in (0, 3), (r.returncode, r.stderr[-500:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-500:]
    assert said in errors[0], errors
    assert 'rewards.isolation = "process"' in errors[0] or exit_call.startswith("sys"), errors
