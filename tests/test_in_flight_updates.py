"""In-flight weight updates (`rollout.in_flight_updates`, docs/ASYNC.md): weights that land between two decode
steps, inside an answer, with each token's version recorded; the kept KV cache; the async run; the refusals."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from conftest import make_config, parity
from grpokit.config.schema import RolloutConfig
from grpokit.errors import ConfigError, RolloutWorkerError, SetupError
from grpokit.models.forward import position_ids_from_mask
from grpokit.models.tiny import build_tiny_model
from grpokit.rollout import DecodeSpeed, RolloutRequest, SamplingParams, sample_groups
from grpokit.training.loop import train
from test_vllm_server import get, server, server_config, stand_in  # noqa: F401 - fixtures

SPEEDS = {"layer loop, preallocated cache": DecodeSpeed(),
          "transformers' forward, DynamicCache": DecodeSpeed(layer_loop=False, preallocate_kv_cache=False)}


class SwitchAt:
    """A `between_steps` hook: holds version 1, and at its `at`-th call (0 = before the prefill; k = before the
    forward whose logits give token k) copies `new` into the model in place and holds version 2."""

    def __init__(self, model, new: dict[str, torch.Tensor], at: int):
        self.model, self.new, self.at, self.calls, self.version = model, new, at, 0, 1

    def __call__(self) -> int:
        if self.calls == self.at:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(self.new[name])
            self.version = 2
        self.calls += 1
        return self.version


def _state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _load(model, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state[n])


def _chosen(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) [N, T, V] at tokens [N, T] -> [N, T]."""
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens[..., None])[..., 0]


@torch.no_grad()
def recompute(model, r, temperature: float) -> torch.Tensor:
    """A clean teacher-forced recompute of every completion token under the model's weights now -> [N, T]."""
    P, T = r.prompt_ids.shape[1], r.completion_ids.shape[1]
    mask = r.sequence_mask
    logits = model(input_ids=r.sequence_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    return _chosen(logits[:, P - 1:P + T - 1], r.completion_ids, temperature)


@torch.no_grad()
def replay(model, r, old: dict, new: dict, switch: int, temperature: float) -> torch.Tensor:
    """What the sampler computed when the weights changed before token `switch` with the cache kept -> [N, T]:
    the prompt and tokens 0..switch-2 run under `old` (their keys/values cached), then tokens switch-1.. run
    under `new` over that cache (transformers' own forward and DynamicCache, not the sampler's code)."""
    from transformers import DynamicCache

    P, T = r.prompt_ids.shape[1], r.completion_ids.shape[1]
    ids, mask = r.sequence_ids, r.sequence_mask  # [N, P+T]
    positions = position_ids_from_mask(mask)  # [N, P+T]
    cut = P + switch - 1  # the first position the new weights run
    cache = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values":
             DynamicCache(config=model.config)}  # transformers 5.x's name, or the older one
    _load(model, old)
    first = model(input_ids=ids[:, :cut], attention_mask=mask[:, :cut], position_ids=positions[:, :cut],
                  use_cache=True, **cache).logits  # [N, cut, V]
    _load(model, new)
    second = model(input_ids=ids[:, cut:], attention_mask=mask, position_ids=positions[:, cut:],
                   use_cache=True, **cache).logits  # [N, P+T-cut, V]
    logits = torch.cat([first[:, P - 1:], second], dim=1)[:, :T]  # [N, T]: position P-1+t predicts token t
    return _chosen(logits, r.completion_ids, temperature)


def _spanning_rollout(speed: DecodeSpeed, switch: int, temperature: float = 0.9):
    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seed=3)
    model.eval()
    old = _state(model)
    g = torch.Generator().manual_seed(0)
    new = {n: t + 0.05 * t.std() * torch.randn(t.shape, generator=g) for n, t in old.items()}  # an "update"
    hook = SwitchAt(model, new, at=switch)
    prompts = [tok("12+34=")["input_ids"], tok("5+6=")["input_ids"]]  # different lengths: left padding
    sampling = SamplingParams(max_new_tokens=12, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                              temperature=temperature, ignore_eos=True)
    r = sample_groups(model, RolloutRequest(prompts, 3, sampling, torch.Generator().manual_seed(1)),
                      speed=DecodeSpeed(**{**speed.__dict__, "between_steps": hook}))
    return model, r, old, new


@pytest.mark.parametrize("speed", SPEEDS.values(), ids=SPEEDS.keys())
def test_each_token_has_the_log_prob_of_the_weights_recorded_for_it_over_the_kept_cache(speed):
    """The key check: tokens before the switch are a recompute under v1; tokens after it are v2's weights over
    v1's cached keys/values (a replay with transformers' own forward), which a clean recompute under v2 is not."""
    switch, temperature = 5, 0.9
    model, r, old, new = _spanning_rollout(speed, switch, temperature)
    assert r.token_version[:, :switch].eq(1).all() and r.token_version[:, switch:].eq(2).all()
    assert r.policy_version.tolist() == [1] * 6  # the oldest token's
    recorded = r.logprobs  # [N, T]
    _load(model, old)
    under_v1 = recompute(model, r, temperature)
    _load(model, new)
    under_v2 = recompute(model, r, temperature)
    replayed = replay(model, r, old, new, switch, temperature)
    torch.testing.assert_close(recorded[:, :switch], under_v1[:, :switch], atol=2e-5, rtol=0)
    torch.testing.assert_close(recorded[:, switch:], replayed[:, switch:], atol=2e-5, rtol=0)
    assert (recorded[:, switch:] - under_v1[:, switch:]).abs().max() > 1e-3  # the weights did change mid-answer
    gap = (recorded[:, switch:] - under_v2[:, switch:]).abs()  # the kept cache's price
    assert gap.max() > 1e-5
    print(f"\nrecorded vs a clean recompute under v2, tokens after the switch: mean {gap.mean():.2e}, "
          f"max {gap.max():.2e}")


def test_without_the_hook_nothing_changes_and_a_hook_that_never_swaps_changes_no_sample():
    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seed=3)
    prompts = [tok("12+34=")["input_ids"], tok("5+6=")["input_ids"]]
    sampling = SamplingParams(max_new_tokens=10, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    plain = sample_groups(model, RolloutRequest(prompts, 4, sampling, torch.Generator().manual_seed(2)))
    assert plain.token_version is None and plain.policy_version is None
    calls = []
    hooked = sample_groups(model, RolloutRequest(prompts, 4, sampling, torch.Generator().manual_seed(2)),
                           speed=DecodeSpeed(between_steps=lambda: calls.append(1) or 7))
    for name in ("completion_ids", "completion_mask", "logprobs", "truncated"):
        assert torch.equal(getattr(hooked, name), getattr(plain, name)), name
    assert len(calls) == int(plain.completion_mask.sum(-1).max())  # before the prefill and each decode step
    assert torch.equal(hooked.token_version, torch.where(plain.completion_mask.bool(), 7, -1))


# ---- the asynchronous run ------------------------------------------------------------------------------------


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


VERSION_KEYS = ("async/versions_per_answer_max", "async/token_lag_mean", "async/token_lag_max",
                "async/answers_spanning_versions")


@pytest.mark.parametrize("in_flight", [True, False], ids=["in-flight", "between batches"])
def test_an_async_run_with_in_flight_updates_trains_with_answers_spanning_versions(tiny_model_dir, tmp_path,
                                                                                  in_flight):
    """Long answers, a fast trainer: the weights pushed after step s can land while the worker samples a batch."""
    # a 256-token decode is one step per token, the update one batched pass: the trainer pushes while the worker
    # is still sampling the next batch on most steps (96 tokens: 2 of 6), so one of 6 spanning is a safe bound
    steps = 6
    cfg = make_config(tiny_model_dir, tmp_path / "run", steps=steps, max_new_tokens=256, prompts_per_step=4,
                      learning_rate=1e-2, train={"num_threads": 1},
                      rollout={"mode": "async", "max_staleness": 1, "ignore_eos": True, "in_flight_updates": in_flight})
    rows = _rows(train(cfg, reward_functions=[parity]))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert all(k in r for k in VERSION_KEYS), r
        assert r["async/token_lag_max"] <= 1  # max_staleness bounds the oldest token
        assert r["async/staleness_max"] <= 1
        assert r["async/token_lag_mean"] <= r["async/staleness_mean"] + 1e-9  # newer tokens lag less
    spanning = [r["async/answers_spanning_versions"] for r in rows]
    if in_flight:
        assert max(spanning) > 0, spanning
        assert max(r["async/versions_per_answer_max"] for r in rows) >= 2
    else:
        assert spanning == [0.0] * steps
        assert all(r["async/versions_per_answer_max"] == 1 for r in rows)
        assert all(r["async/token_lag_mean"] == r["async/staleness_mean"] for r in rows)


# ---- refusals ------------------------------------------------------------------------------------------------


def test_in_flight_updates_need_async_mode_and_a_sampler_that_can_take_weights_mid_answer():
    with pytest.raises(ConfigError, match=r'^rollout.in_flight_updates: needs rollout.mode = "async"'):
        RolloutConfig(in_flight_updates=True)
    with pytest.raises(ConfigError, match=r"^rollout.in_flight_updates: a colocated vLLM engine"):
        RolloutConfig(in_flight_updates=True, mode="async", engine="vllm")
    assert RolloutConfig(in_flight_updates=True, mode="async").in_flight_updates


def test_in_flight_updates_with_tools_are_refused_before_a_worker_starts(tool_model_dir, tmp_path):
    cfg = make_config(tool_model_dir, tmp_path / "run", rollout={"mode": "async", "in_flight_updates": True})
    cfg = type(cfg)(**{**cfg.__dict__, "data": type(cfg.data)(task="multiplication", num_prompts=16)})
    with pytest.raises(SetupError, match=r"^rollout.in_flight_updates: multi-turn rollouts") as e:
        train(cfg, reward_functions=[parity])
    assert "\n" not in str(e.value)


_calls = {"n": 0}


def exits_on_second_batch(completions, **kwargs):
    _calls["n"] += 1
    if _calls["n"] == 2:
        import os

        os._exit(3)
    return parity(completions)


def test_a_worker_that_dies_while_taking_weights_mid_answer_is_one_error(tiny_model_dir, tmp_path):
    """The worker exits in its second batch's grading, the trainer's push of step 1 in flight or done: one
    error naming it, the finished steps kept (as without in-flight updates, tests/test_async.py)."""
    cfg = make_config(tiny_model_dir, tmp_path / "run", steps=4, max_new_tokens=64, train={"num_threads": 1},
                      rollout={"mode": "async", "max_staleness": 1, "ignore_eos": True, "in_flight_updates": True,
                               "worker_timeout_s": 4})
    with pytest.raises(RolloutWorkerError) as e:
        train(cfg, reward_functions=[exits_on_second_batch])
    assert "rollout worker 0 exited with code 3" in str(e.value) and "\n" not in str(e.value)
    assert "step 1 is saved" in str(e.value)
    assert (tmp_path / "run" / "checkpoint-1").is_dir()


# ---- a vLLM server -------------------------------------------------------------------------------------------


class _Inner:
    def __init__(self):
        self.pushed: list[int] = []

    def publish(self, model, step: int) -> float:
        self.pushed.append(step)
        return 0.0


@pytest.mark.parametrize("in_flight", [True, False])
def test_a_server_push_waits_for_the_batch_only_without_in_flight_updates(in_flight):
    """Without in-flight updates the push waits for the worker's lock (held while a batch is sampled); with them
    it goes at once, the server's own pause (mode=keep) freezing the batch's requests."""
    import multiprocessing

    from grpokit.rollout.vllm.weights import LockedPublisher, ServerSubscriber

    lock, version, inner = multiprocessing.Lock(), multiprocessing.Value("q", 0), _Inner()
    publisher = LockedPublisher(inner, 0.3, lock, version, holds=0, in_flight=in_flight)
    subscriber = ServerSubscriber(lock, version, served=None, adapter_prefix=None, in_flight=in_flight)
    with subscriber.holding():  # the worker samples a batch
        if in_flight:
            publisher.publish(None, 1)
            assert inner.pushed == [1] and subscriber.newest() == 1
        else:
            with pytest.raises(RuntimeError, match="kept the vLLM server busy"):
                publisher.publish(None, 1)
            assert inner.pushed == [] and subscriber.newest() == 0
    publisher.publish(None, 2)
    assert inner.pushed[-1] == 2 and subscriber.newest() == 2


def test_in_flight_updates_with_lora_on_a_server_are_refused(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fake_vllm"))  # the stand-in: "vllm" is installed
    with pytest.raises(ConfigError, match=r"^rollout.in_flight_updates: with model.lora each push"):
        make_config(tiny_model_dir, tmp_path, model={"lora": {"r": 4}},
                    rollout={"engine": "vllm", "vllm": {"server": "http://127.0.0.1:8000"}, "mode": "async",
                             "in_flight_updates": True})


def test_async_in_flight_through_the_stand_in_server_pushes_while_requests_run(tiny_model_dir, tmp_path,
                                                                               server):  # noqa: F811
    """The stand-in counts pushes that arrive while a request is sampled (0 without in-flight updates,
    tests/test_vllm_server.py); with them the push goes without waiting for the batch."""
    run = train(server_config(tiny_model_dir, tmp_path / "run", server, steps=5, max_new_tokens=96,
                              rollout={"mode": "async", "max_staleness": 1, "ignore_eos": True,
                                       "in_flight_updates": True}), reward_functions=[parity])
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["async/staleness_max"] <= 1 and "async/server_versions_during_batch" in r for r in rows)
    stats = get(f"{server}/stand_in_stats")
    assert stats["pause_mode"] == "keep"
    assert stats["updates_during_sampling"] >= 1 or max(r["async/server_versions_during_batch"] for r in rows) >= 1
