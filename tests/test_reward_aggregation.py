"""rewards.aggregation = "normalize_then_sum" (GDPO): `decoupled_advantages` by hand, against TRL 1.16's
arithmetic, through a training run, and the config checks that keep it from meeting options it ignores."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from conftest import make_config
from grpokit.algorithms.advantages import decoupled_advantages, group_advantages
from grpokit.config.loading import config_from_dict
from grpokit.config.schema import RewardConfig
from grpokit.errors import ConfigError
from grpokit.observe.tracking import read_metrics
from grpokit.training.loop import train

NAN = math.nan
F64 = torch.float64


# ---------------------------------------------------------------- golden, by hand


def test_golden_two_groups_of_three_two_functions():
    # Population std (the default), eps = 0 so the arithmetic stays exact; weights w = [1, 2].
    per_fn = torch.tensor([
        [1.0, 3.0],  # group A, a0
        [NAN, 3.0],  # group A, a1: f1 returned None
        [0.0, 3.0],  # group A, a2
        [0.0, 2.0],  # group B, b0
        [0.0, 0.0],  # group B, b1
        [NAN, NAN],  # group B, b2: unscorable (every function returned None)
    ], dtype=F64)
    # Group A, f1: valid 1, 0 -> mean 0.5, population std 0.5 -> z1 = +1, (NaN: adds 0), -1
    #          f2: 3, 3, 3 -> no signal -> z2 = 0, 0, 0
    #          s = 1*z1 + 2*z2 = +1, 0, -1
    # Group B, f1: valid 0, 0 -> no signal -> z1 = 0, 0
    #          f2: valid 2, 0 -> mean 1, population std 1 -> z2 = +1, -1
    #          s = +2, -2, (b2 unscorable: left out)
    # Batch over the 5 scorable answers: s = 1, 0, -1, 2, -2 -> mean 0,
    #   population variance (1 + 0 + 1 + 4 + 4) / 5 = 2 -> std sqrt(2)
    # A = s / sqrt(2) = 1/sqrt(2), 0, -1/sqrt(2), sqrt(2), -sqrt(2), and 0 for b2
    r = 1 / math.sqrt(2)
    expected = torch.tensor([r, 0.0, -r, 2 * r, -2 * r, 0.0], dtype=F64)
    adv = decoupled_advantages(per_fn, [1.0, 2.0], 3, eps=0.0)
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    # With the default eps = 1e-4 in both denominators: off by about 1e-4 relative, no more.
    torch.testing.assert_close(decoupled_advantages(per_fn, [1.0, 2.0], 3), expected, atol=5e-4, rtol=0)
    # The weighted total would rank group A's a1 (f1 missing counts 0: total 6) with a2 (total 6), and
    # sum_then_normalize gives a1 a negative advantage; GDPO gives it 0 (f2 says nothing in group A).
    total = torch.nansum(per_fn * torch.tensor([1.0, 2.0], dtype=F64), dim=1)  # 7 6 6 4 0 0
    total[5] = NAN
    assert group_advantages(total, 3)[1] < -0.5


def test_sample_std_by_hand():
    # std="sample" (TRL's): group [0, 1, 2] -> mean 1, sample std 1 -> z = -1, 0, +1 ; second group flat -> 0.
    # Batch: s = -1, 0, 1, 0, 0, 0 -> mean 0, sample variance 2 / 5 -> A = s / sqrt(0.4)
    per_fn = torch.tensor([[0.0], [1.0], [2.0], [5.0], [5.0], [5.0]], dtype=F64)
    adv = decoupled_advantages(per_fn, [1.0], 3, std="sample", eps=0.0)
    expected = torch.tensor([-1, 0, 1, 0, 0, 0], dtype=F64) / math.sqrt(0.4)
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)


def test_one_function_is_grpo_rescaled_over_the_batch():
    # One function: A = sign(w) * g / (std(g) + eps/|w|) with g = group_advantages(r) (z has batch mean 0).
    gen = torch.Generator().manual_seed(3)
    r = torch.rand(6 * 4, generator=gen, dtype=F64)
    r[8:12] = 0.5  # a group without signal
    r[13] = NAN
    g = group_advantages(r, 4)
    scorable = ~torch.isnan(r)
    sd = g[scorable].std(unbiased=False)
    for w in (1.0, 3.0, -0.5):
        adv = decoupled_advantages(r[:, None], [w], 4)
        expected = math.copysign(1.0, w) * g / (sd + 1e-4 / abs(w))
        torch.testing.assert_close(adv, expected, atol=1e-9, rtol=0)


def test_equal_totals_can_still_carry_signal():
    # f1 = 2, 0, 1 (population std sqrt(2/3)) -> z1 = +sqrt(1.5), -sqrt(1.5), 0
    # f2 = 0, 1, 0.5 (population std sqrt(1/6)) -> z2 = -sqrt(1.5), +sqrt(1.5), 0
    # weights 1, 2: totals 2, 2, 2 (no signal for sum_then_normalize), but s = z1 + 2 z2 = -sqrt(1.5), +sqrt(1.5), 0
    # batch (this one group): mean 0, population std sqrt((1.5 + 1.5) / 3) = 1 -> A = s
    per_fn = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.5]], dtype=F64)
    adv = decoupled_advantages(per_fn, [1.0, 2.0], 3, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0], dtype=F64) * math.sqrt(1.5), atol=1e-12, rtol=0)
    assert group_advantages(per_fn @ torch.tensor([1.0, 2.0], dtype=F64), 3).tolist() == [0.0] * 3


def test_groups_without_signal_get_exactly_zero_in_float32():
    # 0.1 is not exact in float32: the group mean of 0.1, 0.1, 0.1 may be a ulp off, and a ulp / eps is
    # not 0. Each function of group 0 is flat (or has a single valid value): every advantage there is 0.0.
    per_fn = torch.tensor([[0.1, 0.7], [0.1, NAN], [0.1, NAN],
                           [0.3, 0.2], [0.9, 0.1], [0.1, 0.4]], dtype=torch.float32)
    adv = decoupled_advantages(per_fn, [1.0, 0.5], 3)
    assert adv.dtype == torch.float32
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[3:].abs().min() > 0.1
    # A zero weight silences its function; every weight 0: no advantage at all.
    assert decoupled_advantages(per_fn, [0.0, 0.0], 3).tolist() == [0.0] * 6


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"per_fn must have shape \[N, F\]"):
        decoupled_advantages(torch.zeros(6), [1.0], 3)
    with pytest.raises(ValueError, match="not divisible by group_size"):
        decoupled_advantages(torch.zeros(5, 2), [1.0, 1.0], 3)
    with pytest.raises(ValueError, match="weights must have shape"):
        decoupled_advantages(torch.zeros(6, 2), [1.0], 3)
    with pytest.raises(ValueError, match="std must be one of"):
        decoupled_advantages(torch.zeros(6, 2), [1.0, 1.0], 3, std="bessel")


# ---------------------------------------------------------------- TRL 1.16 parity


def _trl_normalize_then_sum(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor,
                            num_generations: int) -> torch.Tensor:
    """TRL 1.16 trl/trainer/grpo_trainer.py lines 2759, 2790-2799 and 2810
    (``multi_objective_aggregation="normalize_then_sum"``, in ``_generate_and_score_completions``).

    That code is not reachable as a function; this is its arithmetic line for line, with TRL's
    own ``nanstd`` (``len(self.reward_funcs)`` is ``rewards_per_func.shape[1]``).
    """
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    num_funcs = rewards_per_func.shape[1]
    grouped = rewards_per_func.view(-1, num_generations, num_funcs)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = (grouped - mean_k) / (std_k + 1e-4)
    reward_k = reward_k.view(-1, num_funcs)
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def test_matches_trl_normalize_then_sum_with_sample_std():
    pytest.importorskip("trl")
    gen = torch.Generator().manual_seed(11)
    per_fn = torch.rand(6 * 4, 3, generator=gen, dtype=F64)  # B = 6 groups of G = 4, F = 3 functions
    per_fn[0:4, 1] = 0.3  # group 0: function 1 flat
    per_fn[5, :] = NAN  # group 1: an unscorable answer
    per_fn[6, 2] = NAN  # group 1: function 2 skipped one answer
    per_fn[8:11, 0] = NAN  # group 2: function 0 has a single valid reward
    per_fn[12:16, 2] = NAN  # group 3: function 2 graded none of it
    per_fn[16:20] = torch.tensor([0.2, 0.9, 0.5], dtype=F64)  # group 4: no function varies
    per_fn[20:24, 0] = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=F64)  # group 5: a 0/1 function
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=F64)
    ours = decoupled_advantages(per_fn, weights, 4, std="sample")
    theirs = _trl_normalize_then_sum(per_fn, weights, 4)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert ours[5] == 0 and ours[16:20].tolist() == [0.0] * 4  # unscorable; no signal: exactly 0
    assert ours[20:24].abs().min() > 0.1  # not a degenerate batch


# ---------------------------------------------------------------- through a training run

REWARDS = '''
def parity(completions, **kwargs):  # in [0, 1]
    return [0.0 if p.startswith(("3", "4")) else sum(ord(ch) % 2 == 0 for ch in c) / max(1, len(c))
            for p, c in zip(kwargs["prompts"], completions)]


def upper(completions, **kwargs):  # 0 to 5: another scale; None (NaN) when the answer starts in lower case
    return [1.0 if p.startswith(("3", "4")) else None if c[:1].islower() else float(sum(ch.isupper() for ch in c))
            for p, c in zip(kwargs["prompts"], completions)]
'''


@pytest.mark.parametrize("dynamic_sampling", [False, True])
def test_training_uses_the_decoupled_advantages(tiny_model_dir, tmp_path, dynamic_sampling):
    # Both functions are flat on prompts starting with 3 or 4: groups without signal (0 advantages) that
    # dynamic sampling drops.
    (tmp_path / "rewards.py").write_text(REWARDS)
    refs = (f"{tmp_path / 'rewards.py'}:parity", f"{tmp_path / 'rewards.py'}:upper")
    weights = (1.0, 0.5)
    cfg = make_config(tiny_model_dir, tmp_path / "run", output={"completions_every": 1},
                      algorithm={"dynamic_sampling": dynamic_sampling, "max_resample_rounds": 6})
    cfg = dataclasses.replace(cfg, rewards=RewardConfig(functions=refs, weights=weights,
                                                        aggregation="normalize_then_sum"))
    run = train(cfg)
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 * 4  # 2 steps of 4 groups of 4
    for step in (1, 2):
        step_rows = [r for r in rows if r["step"] == step]
        per_fn = torch.tensor([[NAN if v is None else v for v in r["rewards"].values()] for r in step_rows])
        logged = torch.tensor([r["advantage"] for r in step_rows])
        torch.testing.assert_close(logged, decoupled_advantages(per_fn, list(weights), 4), atol=1e-6, rtol=0)
        total = torch.tensor([NAN if r["reward"] is None else r["reward"] for r in step_rows])
        # It is not what the field's default gives, nor GDPO without the weights.
        assert (logged - group_advantages(total, 4)).abs().max() > 1e-2
        assert (logged - decoupled_advantages(per_fn, [1.0, 1.0], 4)).abs().max() > 1e-3
        flat = [r["prompt"].startswith(("3", "4")) for r in step_rows]
        if dynamic_sampling:  # the filter still reads the weighted total: every kept group's totals differ
            assert all(len(set(total[i:i + 4].tolist())) > 1 for i in range(0, 16, 4)) and not any(flat)
        else:
            assert logged[flat].tolist() == [0.0] * sum(flat)
    if dynamic_sampling:
        assert sum(m["dynamic_sampling/draws"] for m in read_metrics(run)) > 2  # groups were dropped
    else:
        assert any(r["prompt"].startswith(("3", "4")) for r in rows)


# ---------------------------------------------------------------- config checks


def _raw(**algorithm) -> dict:
    return {"model": {"path": "m"}, "data": {"task": "addition"},
            "rewards": {"aggregation": "normalize_then_sum"}, "algorithm": algorithm}


def test_config_rejects_an_unknown_aggregation():
    with pytest.raises(ConfigError, match=r"rewards\.aggregation: got 'sum_normalize'; choose one of"):
        RewardConfig(aggregation="sum_normalize")


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp"])
def test_config_rejects_another_advantage_estimator(estimator):
    with pytest.raises(ConfigError, match=rf"rewards\.aggregation: .*algorithm\.advantage_estimator = '{estimator}'"):
        config_from_dict(_raw(advantage_estimator=estimator))


@pytest.mark.parametrize("scale_rewards", ["batch", "none"])
def test_config_rejects_a_scale_rewards_it_would_ignore(scale_rewards):
    with pytest.raises(ConfigError, match=rf"rewards\.aggregation: .*algorithm\.scale_rewards = '{scale_rewards}'"):
        config_from_dict(_raw(scale_rewards=scale_rewards))


def test_config_accepts_gdpo_with_grpo_and_a_preset_once_scale_rewards_is_set():
    assert config_from_dict(_raw()).rewards.aggregation == "normalize_then_sum"
    with pytest.raises(ConfigError, match="a preset such as dr_grpo"):
        config_from_dict(_raw(preset="dr_grpo"))  # the preset sets scale_rewards = "none"
    assert config_from_dict(_raw(preset="dr_grpo", scale_rewards="group")).algorithm.scale_rewards == "group"
