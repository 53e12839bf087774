"""A reward function that ends its rollout worker's process (issue 52), in asynchronous rollout.

With `rewards.isolation = "none"` a reward function runs in the rollout worker's own process, so `os._exit(3)` in it
ends the worker. The trainer said only "rollout worker 0 exited with code 3 ... start again with the same command",
which fails the same way; sync mode names the function (tests/test_isolation_in_training.py). The worker now records
which reward function it is running, and the trainer names it, with the exit code, and the fix before the command.
"""

from __future__ import annotations

import os

import pytest

from conftest import make_config, parity
from grpokit.errors import RolloutWorkerError
from grpokit.training.loop import train

_calls = {"n": 0}


def exits_at_once(completions, **kwargs):
    os._exit(3)


def exits_on_second_batch(completions, **kwargs):
    _calls["n"] += 1
    if _calls["n"] == 2:
        os._exit(3)
    return parity(completions)


def _config(model_dir, out, steps: int):
    return make_config(model_dir, out, steps=steps, rollout={"mode": "async", "max_staleness": 0,
                                                             "worker_timeout_s": 30}, train={"num_threads": 1})


@pytest.mark.parametrize("reward, then", [
    (exits_at_once, "no checkpoint was written yet: once that is fixed, start again with the same command"),
    (exits_on_second_batch, "step 1 is saved ({run}/checkpoint-1). Once that is fixed, continue with: "
                            "train(config, resume=True)"),
])
def test_a_reward_that_exits_its_rollout_worker_is_named_with_the_exit_code(tiny_model_dir, tmp_path, reward, then):
    with pytest.raises(RolloutWorkerError) as err:
        train(_config(tiny_model_dir, tmp_path / "run", steps=3), reward_functions=[reward])
    said = str(err.value)
    assert said.startswith(f"rollout worker 0 exited with code 3 in reward function '{reward.__name__}'"), said
    assert 'rewards.isolation = "process"' in said, said  # the fix, as sync mode says it
    assert said.endswith(then.format(run=tmp_path / "run")), said
    assert "\n" not in said
