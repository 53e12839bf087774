"""`tools.history = "split"` with `rollout.mode = "async"`: a worker process samples conversations that fork
and sends their training rows, each tagged with the policy version of the weights that sampled its answer.

The model and template are test_history_split.py's (Qwen3-style: every tool round rewrites the conversation,
so every answer forks); the scripted calls reach the worker through tests/async_split_hooks.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

import async_split_hooks as hooks
from conftest import comparable, make_config
from grpokit.config.schema import ToolsConfig
from grpokit.models.loading import load_model, load_tokenizer
from grpokit.observe.tracking import read_metrics
from grpokit.rollout import engines
from grpokit.training.loop import train
from grpokit.training.split_rows import split_rows, with_policy_version
from test_history_split import THINK_TEMPLATE, _batch, _model_dir, _sample


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("think-model"), THINK_TEMPLATE)


@pytest.fixture()
def scripted(monkeypatch):
    """The scripted calls in this process (a sync run's sampler) and in every worker it spawns."""
    monkeypatch.setattr(engines, "sample_conversations", hooks.scripted_conversations)
    monkeypatch.setenv(hooks.SCRIPTED, "1")


def _config(think_dir, out, *, steps=3, rollout=None, **kw):
    config = make_config(think_dir, out, steps=steps, max_new_tokens=40, prompts_per_step=2,
                         rollout=rollout, train={"num_threads": 1}, **kw)
    return dataclasses.replace(config, tools=ToolsConfig(history="split", max_calls=2))


def _run(config):
    return read_metrics(train(config, reward_functions=[hooks.final_parity], tools=[hooks.add]))


def test_tagging_a_forked_batch_gives_every_training_row_its_answers_version(think_dir):
    tiny = load_model(think_dir, device="cpu").eval(), load_tokenizer(think_dir)
    rollout, stats = _sample(tiny)
    batch, _ = split_rows(_batch(rollout), tiny[1].pad_token_id)
    assert batch.rows is not None and batch.num_rows == sum(stats.turns) > rollout.num_sequences
    tagged = with_policy_version(batch, 7)
    assert torch.equal(tagged.draw.rollout.policy_version, torch.full((rollout.num_sequences,), 7))  # [N] answers
    assert torch.equal(tagged.rollout.policy_version, torch.full((batch.num_rows,), 7))  # [R] what the update trains
    assert torch.equal(tagged.rollout.completion_ids, batch.rollout.completion_ids)  # the rows themselves unchanged
    assert tagged.draw.rollout.num_sequences == rollout.num_sequences  # the answers stay the answers
    plain = with_policy_version(_batch(rollout), 3)  # nothing split: the answers are the rows
    assert plain.rows is None and torch.equal(plain.rollout.policy_version, torch.full((rollout.num_sequences,), 3))


def test_async_split_history_with_max_staleness_0_is_the_sync_loop(think_dir, tmp_path, scripted):
    sync = _config(think_dir, tmp_path / "sync")
    run = _config(think_dir, tmp_path / "async", rollout={"mode": "async", "max_staleness": 0})
    a, b = comparable(_run(sync)), comparable(_run(run))
    assert len(a) == len(b) == 3
    assert all(m["tools/rows_per_answer"] > 1 and m["tools/fork_frac"] == 1.0 for m in a)  # every answer forked
    for x, y in zip(a, b):
        assert y["async/staleness_max"] == 0 and y["sampling/logprob_gap_max"] < 1e-4
        for key in x:  # the async rows add their own keys (async/*, sampling/*)
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), key
    w_sync = load_file(tmp_path / "sync" / "checkpoint-3" / "model.safetensors")
    w_async = load_file(tmp_path / "async" / "checkpoint-3" / "model.safetensors")
    assert w_sync.keys() == w_async.keys()
    for name in w_sync:
        torch.testing.assert_close(w_async[name], w_sync[name], rtol=1e-4, atol=1e-6)
    initial = load_file(think_dir / "model.safetensors")
    assert any(not torch.equal(w_async[n], initial[n]) for n in w_async if n in initial)  # it trained


def test_forked_rows_carry_the_version_that_sampled_them_and_the_lag_is_corrected(think_dir, tmp_path, scripted):
    """weight_sync_every = 2, max_staleness = 1: steps 1-2 are sampled by version 0 (lag 0, 1), steps 3-4 by
    version 2 (lag 0, 1). Where the lag is 0 the rows' sampler log-probs are the trainer's own (each row
    recomputed from its own prompt); where it is 1 the correction weights move."""
    got = _run(_config(think_dir, tmp_path / "run", steps=4, learning_rate=1e-2,
                       rollout={"mode": "async", "max_staleness": 1, "weight_sync_every": 2}))
    assert all(m["tools/rows_per_answer"] > 1 for m in got)
    assert [m["async/staleness_max"] for m in got] == [0, 1, 0, 1]
    assert [m["async/staleness_mean"] for m in got] == [0, 1, 0, 1]
    assert all(m["async/dropped"] == 0 for m in got)
    for m in got:
        assert (m["sampling/logprob_gap_max"] > 1e-4) == (m["async/staleness_max"] > 0), m
