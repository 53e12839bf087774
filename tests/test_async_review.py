"""An adversarial review of asynchronous rollout (rollout.mode = "async"): each test is one fault found by
trying to break it. Those marked xfail(strict=True) document a bug still open (they fail the suite once it
is fixed, so the mark is removed with the fix); the others pin a fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import make_config, parity
from grpokit.errors import RolloutWorkerError
from grpokit.training import rollout_source
from grpokit.training.loop import train


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def config(model_dir, out, *, steps=3, rollout=None, **kw):
    return make_config(model_dir, out, steps=steps, rollout={"mode": "async", **(rollout or {})},
                       train={"num_threads": 1, **kw.pop("train", {})}, **kw)


def test_no_batch_is_ordered_past_the_last_step_so_the_workers_stop_cleanly(tiny_model_dir, tmp_path, monkeypatch):
    """max_staleness = 1, weight_sync_every = 2, 4 steps: step 5's order would wait for weights of step 3, which
    are never sent (no sync after step 3, none after the last); the worker sat in that wait until close() killed
    it 5 s later (SIGKILL, so nothing of its own closed). Orders stop at train.steps."""
    ordered, exits = [], []
    order, close = rollout_source.AsyncRollouts._order, rollout_source.AsyncRollouts.close

    def spy_order(self, step):
        ordered.append(step)
        return order(self, step)

    def spy_close(self):
        close(self)
        exits.extend(p.exitcode for p in self.procs)

    monkeypatch.setattr(rollout_source.AsyncRollouts, "_order", spy_order)
    monkeypatch.setattr(rollout_source.AsyncRollouts, "close", spy_close)
    train(config(tiny_model_dir, tmp_path / "run", steps=4, rollout={"max_staleness": 1, "weight_sync_every": 2}),
          reward_functions=[parity])
    assert ordered == [1, 2, 3, 4]
    assert exits == [0]  # the None order reached it: it returned, it was not killed


def test_a_worker_lost_during_a_weight_transfer_keeps_the_finished_step(tiny_model_dir, tmp_path, monkeypatch):
    """The worker dies while the trainer updates step 2 (the OOM killer), so the weight transfer after it fails.
    The update of step 2 finished: its metrics row and checkpoint are kept and the error says how to continue,
    as for a worker lost while the trainer waits for a batch (before: no row, no checkpoint at all, no hint)."""
    publish = rollout_source.AsyncRollouts.publish

    def killed_before_step_2s_transfer(self, model, step):
        if step == 2:
            os.kill(self.procs[0].pid, signal.SIGKILL)
            self.procs[0].join()
        return publish(self, model, step)

    monkeypatch.setattr(rollout_source.AsyncRollouts, "publish", killed_before_step_2s_transfer)
    out = tmp_path / "run"
    with pytest.raises(RolloutWorkerError) as err:
        train(config(tiny_model_dir, out, steps=4, rollout={"max_staleness": 1, "worker_timeout_s": 20}),
              reward_functions=[parity])
    words = str(err.value)
    assert "rollout worker 0 was killed by signal 9" in words and "weight transfer" in words, words
    assert "step 2 is saved" in words and "Continue with: train(config, resume=True)" in words, words
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == [1, 2]
    assert (out / "checkpoint-2").is_dir()
    monkeypatch.setattr(rollout_source.AsyncRollouts, "publish", publish)
    train(config(tiny_model_dir, out, steps=3), reward_functions=[parity], resume=True)
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == [1, 2, 3]


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from conftest import make_config, parity
from grpokit.training.loop import train
train(make_config({model!r}, {out!r}, steps=1000, rollout={{"mode": "async"}}, train={{"num_threads": 1}}),
      reward_functions=[parity])
"""


def _children(pid: int) -> list[int]:
    return [int(x) for x in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


def test_ctrl_c_while_a_worker_starts_is_a_graceful_stop(tiny_model_dir, tmp_path):
    """A terminal's Ctrl-C reaches the whole process group. A worker only ignores SIGINT once it has imported
    torch and reached worker_main; before that it died of it, and the run ended in "rollout worker 0 was killed
    by signal 2" instead of finishing its step, saving and stopping."""
    script, out = tmp_path / "run.py", tmp_path / "run"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), model=str(tiny_model_dir), out=str(out)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _children(proc.pid) and time.monotonic() < deadline:  # the worker is spawned: it imports
            time.sleep(0.05)
        time.sleep(0.3)
        logged = out / "metrics.jsonl"
        assert not logged.exists() or not logged.stat().st_size, "too late: a step was already logged"
        os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "killed by signal 2" not in output, output[-3000:]
    assert proc.returncode == 0, output[-3000:]
    assert "SIGINT: stopped after step 1" in output
    assert (out / "checkpoint-1").is_dir()


def test_a_given_model_unlike_model_path_is_refused_by_the_worker_before_any_transfer(tiny_model_dir, tmp_path):
    """train(model=...) with resized token embeddings (what a TRL user does after adding a pad token): the
    worker loads model.path, so the flat buckets of the first transfer differ in size. Before: gloo aborted the
    worker (SIGABRT) and the run said "rollout worker 0 was killed by signal 6"; with equal sizes but other
    shapes the weights would have been scrambled silently. Now each end's parameter shapes are compared first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    vocab = model.config.vocab_size
    model.resize_token_embeddings(vocab + 8)
    with pytest.raises(RolloutWorkerError) as err:
        train(config(tiny_model_dir, tmp_path / "run", steps=2, rollout={"max_staleness": 0, "worker_timeout_s": 30}),
              reward_functions=[parity], model=model)
    words = str(err.value)
    assert "rollout worker 0: the trainer's model and the rollout workers' differ" in words, words
    assert f"model.embed_tokens.weight is [{vocab + 8}, 32] torch.float32 in the trainer's model, [{vocab}, 32]" \
        in words and "signal" not in words and "\n" not in words


def test_a_reward_that_raises_while_the_trainer_updates_is_said_in_its_own_words(tiny_model_dir, tmp_path):
    """max_staleness = 1 (the default): step 2's batch is graded while the trainer updates step 1, so the worker
    reports its reward's error and exits during the weight transfer after step 1. Before: the run said only
    "the weight transfer of step 1 ... failed (... Connection closed by peer ...)", and the reward's error stayed
    unread in the queue."""
    from test_async import raises_on_second_batch

    out = tmp_path / "run"
    with pytest.raises(RolloutWorkerError) as err:
        train(config(tiny_model_dir, out, steps=4, rollout={"max_staleness": 1, "worker_timeout_s": 20}),
              reward_functions=[raises_on_second_batch])
    words = str(err.value)
    assert words.startswith("rollout worker 0: reward function 'raises_on_second_batch'"), words
    assert "the grader's database is gone" in words and "Connection closed" not in words, words
    assert "step 1 is saved" in words and (out / "checkpoint-1").is_dir()


def test_a_batch_sent_before_the_workers_error_is_still_trained(tiny_model_dir, tmp_path, monkeypatch):
    """The trainer reaches step 1's batch only after the worker failed on step 2's: the batch's tensors live in the
    worker's memory, and a worker that exited at once after its error took them along (the run ended at step 1
    with nothing saved). It stays until the trainer stops it, so step 1 trains and is saved."""
    from test_async import raises_on_second_batch

    get = rollout_source.AsyncRollouts._get

    def late(self, **kwargs):
        if kwargs.get("what") == "batch for step 1":
            time.sleep(8)  # the worker has sampled both batches and failed on the second meanwhile
        return get(self, **kwargs)

    monkeypatch.setattr(rollout_source.AsyncRollouts, "_get", late)
    out = tmp_path / "run"
    with pytest.raises(RolloutWorkerError) as err:
        train(config(tiny_model_dir, out, steps=4, rollout={"max_staleness": 1, "worker_timeout_s": 30}),
              reward_functions=[raises_on_second_batch])
    words = str(err.value)
    assert "the grader's database is gone" in words and "step 1 is saved" in words, words
    assert (out / "checkpoint-1").is_dir()


def slow_parity(completions, **kwargs):
    time.sleep(1.5)  # a grader slower than the trainer's update
    return parity(completions)


def test_a_worker_samples_with_the_newest_weights_it_holds_within_the_bound(tiny_model_dir, tmp_path, monkeypatch):
    """One config, max_staleness = 2 (docs/ASYNC.md: which version samples which step depends on the speeds):
    with a slow trainer the worker runs 2 orders ahead and samples with old weights (lags 0, 1, 2, 2, 2); with a
    slow grader it waits behind the trainer and samples with the newest ones (lag at most 1). Never past 2."""
    publish = rollout_source.AsyncRollouts.publish

    def slow_publish(self, model, step):
        time.sleep(1.5)  # an update slower than the worker's batch
        return publish(self, model, step)

    lags = {}
    for name, reward in (("slow grader", slow_parity), ("slow trainer", parity)):
        if name == "slow trainer":
            monkeypatch.setattr(rollout_source.AsyncRollouts, "publish", slow_publish)
        run = train(config(tiny_model_dir, tmp_path / name.replace(" ", "-"), steps=5,
                           rollout={"max_staleness": 2}), reward_functions=[reward])
        lags[name] = [r["async/staleness_max"] for r in rows(run / "metrics.jsonl")]
    assert lags["slow trainer"] == [0, 1, 2, 2, 2], lags
    assert len(lags["slow grader"]) == 5 and max(lags["slow grader"]) <= 1, lags


def _prompts_by_step(run_dir: Path) -> dict[int, set[str]]:
    by: dict[int, set[str]] = {}
    for row in rows(run_dir / "completions.jsonl"):
        by.setdefault(row["step"], set()).add(json.dumps(row["prompt"]))
    return by


def test_a_resume_with_two_workers_takes_the_next_prompts_not_the_last_steps_again(tiny_model_dir, tmp_path):
    """workers = 2, saved after step 4 (worker 1's batch): the checkpoint held the stream where worker 0 left it,
    one batch behind, so the resumed step 5 trained on step 4's prompts again. Now it holds where the last batch
    taken left it and the resumed workers take turns from there: the uninterrupted run's prompts, step by step."""
    def cfg(out, steps):
        return config(tiny_model_dir, out, steps=steps, rollout={"workers": 2, "max_staleness": 1},
                      output={"save_every": 2, "completions_every": 1})

    whole = _prompts_by_step(train(cfg(tmp_path / "whole", 6), reward_functions=[parity]))
    train(cfg(tmp_path / "resumed", 4), reward_functions=[parity])
    resumed = _prompts_by_step(train(cfg(tmp_path / "resumed", 6), reward_functions=[parity], resume=True))
    assert not resumed[4] & resumed[5]
    assert resumed == whole
