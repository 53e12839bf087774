"""Golden tests for the per-turn advantages (algorithms/turn_advantages.py): numbers derived by hand.

The GiGPO example (one prompt, G = 3, gamma = 0.5, omega = 1, no std scaling):

    answer  turns  states  turn rewards  outcome  step rewards  returns (gamma 0.5)
    a0      2      0, 1    0.2, -        1        0.2, 1        0.7, 1
    a1      2      0, 1    0.0, -        0        0,   0        0,   0
    a2      1      0       -             1        1             1

    episode returns 1.2, 0, 1 -> mean 11/15 -> A^E = 7/15, -11/15, 4/15
    step group state 0: 0.7, 0, 1 -> mean 17/30 -> 2/15, -17/30, 13/30
    step group state 1: 1, 0 -> mean 1/2 -> +1/2, -1/2
    A = a0: 7/15 + 2/15 = 3/5, 7/15 + 1/2 = 29/30;  a1: -11/15 - 17/30 = -13/10, -11/15 - 1/2 = -37/30;
        a2: 4/15 + 13/30 = 7/10
"""

from __future__ import annotations

import pytest
import torch

from grpokit.algorithms.turn_advantages import (
    TURN_ADVANTAGES,
    GroupNormalization,
    discounted_returns,
    gigpo_advantages,
    mt_grpo_advantages,
    normalize_within,
    token_advantages,
)
from grpokit.config.algorithm import TURN_ADVANTAGES as CONFIG_NAMES

nan = float("nan")


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def example(*, gamma=0.5, omega=1.0, **normalization):
    outcome = t([1.0, 0.0, 1.0])
    turn_rewards = t([[0.2, nan], [0.0, nan], [nan, nan]])
    states = t([[0, 1], [0, 1], [0, -1]], torch.long)
    turns = t([2, 2, 1], torch.long)
    return gigpo_advantages(outcome, turn_rewards, states, turns, 3, gamma=gamma, omega=omega,
                            normalization=GroupNormalization(**dict(scale_rewards="none") | normalization))


def test_gigpo_adds_the_step_group_advantage_to_the_episode_advantage():
    expected = t([[3 / 5, 29 / 30], [-13 / 10, -37 / 30], [7 / 10, 0.0]])
    torch.testing.assert_close(example(), expected, atol=1e-12, rtol=0)


def test_gigpo_omega_weighs_only_the_step_term():
    # omega = 2: a0's first turn 7/15 + 2 * 2/15 = 11/15; a2's 4/15 + 2 * 13/30 = 17/15
    adv = example(omega=2.0)
    assert adv[0, 0].item() == pytest.approx(11 / 15) and adv[2, 0].item() == pytest.approx(17 / 15)
    omega0 = example(omega=0.0)  # the episode advantage alone, on every turn of the answer
    torch.testing.assert_close(omega0, t([[7 / 15, 7 / 15], [-11 / 15, -11 / 15], [4 / 15, 0.0]]))


def test_gigpo_discounts_later_rewards_in_the_step_return():
    # gamma = 1: a0's returns are 1.2, 1 -> state 0 group 1.2, 0, 1 (mean 11/15): a0 gets 7/15 there
    adv = example(gamma=1.0)
    assert adv[0, 0].item() == pytest.approx(7 / 15 + 7 / 15)
    returns = discounted_returns(t([[1.0, 2.0, 4.0]]), 0.5)
    torch.testing.assert_close(returns, t([[1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 4.0]]))


def test_gigpo_scales_step_groups_by_their_std():
    # state 1 holds 1 and 0: population std 0.5 -> +-0.5 / (0.5 + 1e-4)
    adv = example(scale_rewards="group", omega=1.0) - example(scale_rewards="group", omega=0.0)
    assert adv[0, 1].item() == pytest.approx(0.5 / 0.5001) and adv[1, 1].item() == pytest.approx(-0.5 / 0.5001)
    # sample std (Bessel) of 1, 0 is sqrt(1/2)
    sample = example(scale_rewards="group", std="sample") - example(scale_rewards="group", std="sample", omega=0.0)
    assert sample[0, 1].item() == pytest.approx(0.5 / (0.5 ** 0.5 + 1e-4))


def test_gigpo_groups_identical_states_at_any_turn_and_never_across_prompts():
    # prompt 0: a0 reaches state 5 at its turn 1, a1 starts from it; state 3 only a0 saw (one member: 0)
    # prompt 1: the same ids, other answers: they form their own groups
    outcome = t([1.0, 0.0, 1.0, 1.0])
    turn_rewards = torch.full((4, 2), nan, dtype=torch.float64)
    states = t([[3, 5], [5, -1], [3, 5], [5, -1]], torch.long)
    turns = t([2, 1, 2, 1], torch.long)
    adv = gigpo_advantages(outcome, turn_rewards, states, turns, 2, gamma=1.0,
                           normalization=GroupNormalization(scale_rewards="none"))
    # prompt 0: episode +-1/2; state 5 holds a0's return 1 and a1's 0: +-1/2; state 3 alone: 0
    torch.testing.assert_close(adv[:2], t([[0.5, 1.0], [-1.0, 0.0]]))
    # prompt 1: equal outcomes (episode 0) and equal returns in state 5: exactly 0, no eps blow-up
    assert adv[2:].abs().max().item() == 0.0
    scaled = gigpo_advantages(outcome, turn_rewards, states, turns, 2, gamma=1.0,
                              normalization=GroupNormalization(scale_rewards="group"))
    assert scaled[2:].abs().max().item() == 0.0


def test_gigpo_leaves_unscored_answers_out_of_the_step_groups():
    outcome = t([nan, 0.0, 1.0])
    turn_rewards = torch.full((3, 1), nan, dtype=torch.float64)
    states = t([[0], [0], [0]], torch.long)
    adv = gigpo_advantages(outcome, turn_rewards, states, t([1, 1, 1], torch.long), 3,
                           normalization=GroupNormalization(scale_rewards="none"))
    # a0 is unscored: A^E = 0 and no step advantage; a1, a2 hold +-1/2 in both levels
    torch.testing.assert_close(adv, t([[0.0], [-1.0], [1.0]]))


def test_gigpo_without_states_is_the_episode_advantage_of_the_summed_rewards():
    outcome = t([1.0, 0.0])
    turn_rewards = t([[0.5, nan], [nan, nan]])
    adv = gigpo_advantages(outcome, turn_rewards, torch.full((2, 2), -1), t([2, 1], torch.long), 2,
                           normalization=GroupNormalization(scale_rewards="none"))
    # episode returns 1.5, 0 -> +-0.75 on every existing turn
    torch.testing.assert_close(adv, t([[0.75, 0.75], [-0.75, 0.0]]))


def test_mt_grpo_adds_the_normalised_turn_reward_to_the_outcome_advantage():
    outcome_adv = t([1.0, -1.0, 0.0])
    turn_rewards = t([[1.0, nan], [0.0, nan], [nan, nan]])  # a2 reported no turn reward
    turns = t([2, 2, 1], torch.long)
    adv = mt_grpo_advantages(outcome_adv, turn_rewards, turns, 3, scale=False)
    # turn 0 group: a0 1, a1 0 (a2 out) -> +-1/2; turn 1 reported by nobody: the outcome advantage alone
    torch.testing.assert_close(adv, t([[1.5, 1.0], [-1.5, -1.0], [0.0, 0.0]]))
    weighted = mt_grpo_advantages(outcome_adv, turn_rewards, turns, 3, weight=2.0, scale=False)
    torch.testing.assert_close(weighted[0], t([2.0, 1.0]))
    scaled = mt_grpo_advantages(outcome_adv, turn_rewards, turns, 3)  # population std 0.5
    assert scaled[0, 0].item() == pytest.approx(1 + 0.5 / 0.5001)


def test_mt_grpo_single_reports_and_equal_turn_rewards_add_nothing():
    outcome_adv = t([0.5, -0.5, 0.25, -0.25])
    turn_rewards = t([[1.0, 3.0], [nan, 3.0], [2.0, 2.0], [2.0, 2.0]])
    adv = mt_grpo_advantages(outcome_adv, turn_rewards, t([2, 2, 2, 2], torch.long), 2)
    # prompt 0, turn 0: only a0 reported (one member); turn 1: equal. prompt 1: all equal
    torch.testing.assert_close(adv, outcome_adv[:, None].expand(4, 2))


def test_each_token_gets_its_turns_advantage_and_tool_tokens_none():
    turn_adv = t([[0.6, -0.2], [1.0, 0.0]])
    token_turn = t([[0, 0, -1, -1, 1, 1, -1], [0, 0, 0, -1, -1, -1, -1]], torch.long)
    expected = t([[0.6, 0.6, 0, 0, -0.2, -0.2, 0], [1.0, 1.0, 1.0, 0, 0, 0, 0]])
    torch.testing.assert_close(token_advantages(turn_adv, token_turn), expected)


def test_normalize_within_groups_by_key_rows():
    values = t([1.0, 3.0, 5.0, 5.0, 7.0])
    keys = t([[0, 1], [0, 1], [1, 1], [1, 1], [0, 2]], torch.long)
    # (0,1): 1, 3 -> mean 2, population std 1 -> -1, +1 (eps 0); (1,1): equal -> 0; (0,2): alone -> 0
    torch.testing.assert_close(normalize_within(values, keys, eps=0.0), t([-1.0, 1.0, 0.0, 0.0, 0.0]))


def test_bad_shapes_are_refused_naming_them():
    with pytest.raises(ValueError, match="whole groups"):
        mt_grpo_advantages(t([0.0, 0.0, 0.0]), t([[0.0], [0.0], [0.0]]), t([1, 1, 1], torch.long), 2)
    with pytest.raises(ValueError, match="turns must be in"):
        mt_grpo_advantages(t([0.0, 0.0]), t([[0.0], [0.0]]), t([2, 1], torch.long), 2)


def test_the_config_names_the_same_estimators():
    assert CONFIG_NAMES == TURN_ADVANTAGES


def test_the_keywords_before_group_normalization_still_work_with_a_warning_naming_it():
    """gigpo_advantages(..., scale_rewards=..., std=...), the public spelling before GroupNormalization: the same
    advantages, and a DeprecationWarning that names the new spelling (grpokit.errors.keywords_moved_into, which
    completion_logprobs and explain use as well)."""
    outcome, turn_rewards = t([1.0, 0.0, 1.0]), t([[0.2, nan], [0.0, nan], [nan, nan]])
    states, turns = t([[0, 1], [0, 1], [0, -1]], torch.long), t([2, 2, 1], torch.long)
    with pytest.warns(DeprecationWarning, match=r"pass normalization=GroupNormalization\(scale_rewards='none', "
                                                r"std='sample'\) \(from grpokit.algorithms.turn_advantages"):
        old = gigpo_advantages(outcome, turn_rewards, states, turns, 3, gamma=0.5, scale_rewards="none", std="sample")
    new = gigpo_advantages(outcome, turn_rewards, states, turns, 3, gamma=0.5,
                           normalization=GroupNormalization(scale_rewards="none", std="sample"))
    torch.testing.assert_close(old, new, rtol=0, atol=0)
