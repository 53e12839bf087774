"""Golden and property tests for grpokit.algorithms.advantages.group_advantages."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algorithms.advantages import group_advantages

NAN = float("nan")
EPS = 1e-4


def t64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# ---------------------------------------------------------------- seed 001 golden


def test_seed001_table_population_std_rounded():
    # Seed 001's table: scores 0.8 0.3 0.6 0.3 -> +1.41 -0.94 +0.47 -0.94.
    adv = group_advantages(torch.tensor([0.8, 0.3, 0.6, 0.3]), 4)
    torch.testing.assert_close(adv, torch.tensor([1.41, -0.94, 0.47, -0.94]), atol=1e-2, rtol=0)


def test_seed001_table_population_std_exact():
    # mean = (0.8 + 0.3 + 0.6 + 0.3) / 4 = 0.5; deviations +0.3 -0.2 +0.1 -0.2
    # squared: 0.09 0.04 0.01 0.04 -> sum 0.18 -> population variance 0.18 / 4 = 0.045
    sd = math.sqrt(0.045)  # 0.212132...
    expected = t64(0.3, -0.2, 0.1, -0.2) / (sd + EPS)
    adv = group_advantages(t64(0.8, 0.3, 0.6, 0.3), 4)
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    # eps is really in the denominator: without it A_1 would be 1.414214 (off by 6.7e-4)
    assert abs(adv[0].item() - 0.3 / sd) > 5e-4


def test_seed001_table_sample_std_exact():
    # Bessel: variance 0.18 / (4 - 1) = 0.06
    sd = math.sqrt(0.06)  # 0.244949...
    expected = t64(0.3, -0.2, 0.1, -0.2) / (sd + EPS)  # +1.2242 -0.8162 +0.4081 -0.8162
    adv = group_advantages(t64(0.8, 0.3, 0.6, 0.3), 4, std="sample")
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(adv, t64(1.2242, -0.8162, 0.4081, -0.8162), atol=1e-4, rtol=0)


def test_groups_are_independent_and_laid_out_group_by_group():
    # Group 1 is the seed's table; group 2 is [1, 0]: mean 0.5, population std 0.5.
    adv = group_advantages(t64(0.8, 0.3, 0.6, 0.3, 1.0, 0.0, 0.0, 1.0), 4)
    sd1 = math.sqrt(0.045)
    # group 2 = [1, 0, 0, 1]: mean 0.5, deviations +-0.5, population std 0.5
    expected = t64(0.3 / (sd1 + EPS), -0.2 / (sd1 + EPS), 0.1 / (sd1 + EPS), -0.2 / (sd1 + EPS),
                   0.5 / 0.5001, -0.5 / 0.5001, -0.5 / 0.5001, 0.5 / 0.5001)
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_integer_rewards_give_float32():
    # [1, 0, 0, 0]: mean 0.25, population variance (0.5625 + 3 * 0.0625) / 4 = 0.1875
    adv = group_advantages(torch.tensor([1, 0, 0, 0]), 4)
    assert adv.dtype == torch.float32
    sd = math.sqrt(0.1875)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]) / (sd + EPS), atol=1e-6, rtol=0)


def test_dtype_follows_floating_rewards():
    assert group_advantages(t64(1.0, 0.0), 2).dtype == torch.float64
    assert group_advantages(torch.tensor([1.0, 0.0], dtype=torch.bfloat16), 2).dtype == torch.bfloat16


# ---------------------------------------------------------------- degenerate groups


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("std", ["population", "sample"])
def test_zero_std_group_is_exactly_zero(scale_rewards, std):
    # 0.1 * 3 / 3 != 0.1 in floating point: a naive (r - mean) / (std + eps) gives ~1e-13, not 0.
    rewards = t64(0.1, 0.1, 0.1, 0.7, 0.2, 0.4)
    adv = group_advantages(rewards, 3, scale_rewards=scale_rewards, std=std)
    assert torch.all(adv[:3] == 0.0)
    assert torch.all(adv[3:] != 0.0)
    assert not torch.isnan(adv).any()


def test_all_groups_constant_gives_zeros_not_nan():
    adv = group_advantages(torch.full((8,), 0.3), 4, scale_rewards="batch")
    assert torch.equal(adv, torch.zeros(8))


def test_nan_rewards_are_excluded_from_the_group_statistics():
    # valid [1.0, 0.0, 0.5]: mean 0.5, population variance (0.25 + 0.25 + 0) / 3 = 1/6
    sd = math.sqrt(1 / 6)
    adv = group_advantages(t64(1.0, NAN, 0.0, 0.5), 4)
    torch.testing.assert_close(adv, t64(0.5 / (sd + EPS), 0.0, -0.5 / (sd + EPS), 0.0), atol=1e-6, rtol=0)
    # sample std: variance 0.5 / 2 = 0.25
    adv = group_advantages(t64(1.0, NAN, 0.0, 0.5), 4, std="sample")
    torch.testing.assert_close(adv, t64(0.5 / (0.5 + EPS), 0.0, -0.5 / (0.5 + EPS), 0.0), atol=1e-6, rtol=0)


@pytest.mark.parametrize("std", ["population", "sample"])
def test_single_valid_reward_and_all_nan_groups_get_zero(std):
    rewards = t64(NAN, 0.7, NAN, NAN, NAN, NAN, NAN, NAN, 1.0, 0.0, 1.0, 0.0)
    adv = group_advantages(rewards, 4, std=std)
    assert torch.equal(adv[:8], torch.zeros(8, dtype=torch.float64))
    assert not torch.isnan(adv).any()
    assert torch.all(adv[8:].abs() > 0.5)


def test_nan_in_batch_mode_is_excluded_from_the_batch_std():
    # valid rewards 1, 0 | 3, 3: batch mean 1.75, population variance
    # (0.5625 + 3.0625 + 1.5625 + 1.5625) / 4 = 1.6875
    rewards = t64(1.0, 0.0, NAN, 3.0, 3.0, NAN)
    adv = group_advantages(rewards, 3, scale_rewards="batch")
    sd = math.sqrt(1.6875)
    torch.testing.assert_close(adv, t64(0.5 / (sd + EPS), -0.5 / (sd + EPS), 0.0, 0.0, 0.0, 0.0), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- batch and none


def test_batch_mode_hand_derived():
    # groups [1, 0] and [3, 5]; group means 0.5 and 4
    # batch: mean 2.25, deviations -1.25 -2.25 0.75 2.75, squares 1.5625 5.0625 0.5625 7.5625 -> sum 14.75
    rewards = t64(1.0, 0.0, 3.0, 5.0)
    pop = math.sqrt(14.75 / 4)
    adv = group_advantages(rewards, 2, scale_rewards="batch")
    torch.testing.assert_close(adv, t64(0.5, -0.5, -1.0, 1.0) / (pop + EPS), atol=1e-6, rtol=0)
    smp = math.sqrt(14.75 / 3)
    adv = group_advantages(rewards, 2, scale_rewards="batch", std="sample")
    torch.testing.assert_close(adv, t64(0.5, -0.5, -1.0, 1.0) / (smp + EPS), atol=1e-6, rtol=0)
    # group mode differs: each group's own std (0.5 and 1.0)
    adv = group_advantages(rewards, 2, scale_rewards="group")
    torch.testing.assert_close(adv, t64(0.5 / 0.5001, -0.5 / 0.5001, -1 / 1.0001, 1 / 1.0001), atol=1e-6, rtol=0)


def test_none_mode_is_mean_centering_only():
    # Dr. GRPO: no division at all (not even by eps)
    adv = group_advantages(t64(0.8, 0.3, 0.6, 0.3, 2.0, 0.0, 1.0, 1.0), 4, scale_rewards="none")
    torch.testing.assert_close(adv, t64(0.3, -0.2, 0.1, -0.2, 1.0, -1.0, 0.0, 0.0), atol=1e-12, rtol=0)


def test_eps_argument_is_used():
    adv = group_advantages(t64(1.0, 0.0), 2, eps=0.5)  # std 0.5 -> 0.5 / (0.5 + 0.5)
    torch.testing.assert_close(adv, t64(0.5, -0.5), atol=1e-12, rtol=0)


def test_group_mode_properties_on_random_rewards():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 8, generator=gen, dtype=torch.float64)
    adv = group_advantages(rewards, 8, eps=0.0).view(6, 8)
    torch.testing.assert_close(adv.mean(1), torch.zeros(6, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(adv.std(1, unbiased=False), torch.ones(6, dtype=torch.float64), atol=1e-12, rtol=0)
    # invariant to a positive affine change of the rewards (eps = 0)
    adv2 = group_advantages(3.0 * rewards + 7.0, 8, eps=0.0).view(6, 8)
    torch.testing.assert_close(adv2, adv, atol=1e-9, rtol=0)


# ---------------------------------------------------------------- inputs and errors


def test_input_is_not_modified():
    rewards = t64(0.8, NAN, 0.6, 0.3, 0.1, 0.1, 0.1, 0.1)
    before = rewards.clone()
    for mode in ("group", "batch", "none"):
        group_advantages(rewards, 4, scale_rewards=mode)
    torch.testing.assert_close(rewards, before, rtol=0, atol=0, equal_nan=True)


def test_error_when_not_divisible():
    with pytest.raises(ValueError, match=r"not divisible by group_size \(4\)"):
        group_advantages(torch.zeros(6), 4)


@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_error_on_bad_group_size(bad):
    with pytest.raises(ValueError, match="group_size must be an integer >= 1"):
        group_advantages(torch.zeros(4), bad)


def test_error_on_unknown_scale_rewards_lists_choices():
    with pytest.raises(ValueError, match=r"scale_rewards must be one of \['batch', 'group', 'none'\], got 'std'"):
        group_advantages(torch.zeros(4), 2, scale_rewards="std")


def test_error_on_unknown_std_lists_choices():
    with pytest.raises(ValueError, match=r"std must be one of \['population', 'sample'\], got 'unbiased'"):
        group_advantages(torch.zeros(4), 2, std="unbiased")


def test_error_on_2d_rewards():
    with pytest.raises(ValueError, match=r"rewards must have shape \[N\]"):
        group_advantages(torch.zeros(2, 4), 4)


@pytest.mark.parametrize("scale", [1.0, 1e20, 1e30])
def test_huge_rewards_keep_their_advantages(scale):
    """Rewards 1e20 and 0 in float32: the squared deviations (1e40) overflow float32, so a float32 std is inf and
    every advantage a silent 0. Worked in float64 the ratio is the scale's: population std = scale / 2 for the
    group (scale, 0, scale, 0), A = (r - scale / 2) / (scale / 2 + 1e-4) = +-1 (to float32)."""
    rewards = torch.tensor([scale, 0.0, scale, 0.0], dtype=torch.float32)
    adv = group_advantages(rewards, 4)
    assert adv.dtype == torch.float32
    expected = 1.0 / (1.0 + 2e-4 / scale)
    assert adv.tolist() == pytest.approx([expected, -expected, expected, -expected], rel=1e-6)
