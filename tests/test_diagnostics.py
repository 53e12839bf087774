"""Diagnostics: each of the seeds' common mistakes fires once on a run that has it, and a healthy run stays silent."""

from __future__ import annotations

import math

import pytest

from grpokit.config.schema import Config, DataConfig, ModelConfig, RolloutConfig, TrainConfig
from grpokit.observe.diagnostics import Diagnostics, default_window, replay

STEPS = 60


def healthy(step: int) -> dict:
    """Plausible metrics of a run that learns: some zero-std groups, little clipping, entropy easing down."""
    wiggle = 0.02 * math.sin(step)
    return {
        "reward": 0.3 + 0.4 * step / STEPS + wiggle,
        "reward_std": 0.35,
        "frac_reward_zero_std": 0.25 + wiggle,
        "clip_ratio/region_mean": 0.03 + wiggle / 2,
        "entropy": 1.6 - 0.6 * step / STEPS + wiggle,
        "completions/clipped_ratio": 0.05,
        "rewards/correct/mean": 0.3 + 0.4 * step / STEPS, "rewards/correct/std": 0.4,
        "rewards/format/mean": 0.9, "rewards/format/std": 0.1 + wiggle,
    }


def run(diagnostics: Diagnostics, change=lambda step, m: m) -> list[tuple[int, str]]:
    found = []
    for step in range(1, STEPS + 1):
        found += [(step, m) for m in diagnostics.update(step, change(step, healthy(step)))]
    return found


def config(G: int = 8, steps: int = STEPS) -> Config:
    return Config(model=ModelConfig(path="unused"), data=DataConfig(task="addition"),
                  rollout=RolloutConfig(group_size=G, max_new_tokens=32), train=TrainConfig(steps=steps))


def test_a_healthy_run_stays_silent():
    d = Diagnostics.from_config(config())
    assert d.check_config(config()) == []
    assert run(d) == []


@pytest.mark.parametrize("change, figure, fix", [
    (lambda s, m: {**m, "frac_reward_zero_std": 0.85}, "frac_reward_zero_std = 0.85", "dynamic_sampling = true"),
    (lambda s, m: {**m, "clip_ratio/region_mean": 0.3}, "clip_ratio/region_mean = 0.30", "lower train.learning_rate"),
    (lambda s, m: {**m, "entropy": 1.6 * 0.95 ** s, "reward": 0.3 + m["reward"] / 100}, "entropy collapsed from 1.2",
     "epsilon_high"),  # the reward stays where it was: the collapse is not the policy learning
    (lambda s, m: {**m, "completions/clipped_ratio": 0.8}, "completions/clipped_ratio = 0.80",
     "raise rollout.max_new_tokens"),
    (lambda s, m: {**m, "rewards/format/mean": 1.0, "rewards/format/std": 0.0}, "reward 'format' has std 0",
     "drop it from rewards.functions"),
])
def test_each_problem_fires_once_with_its_figure_and_fix(change, figure, fix):
    found = run(Diagnostics.from_config(config()), change)
    assert len(found) == 1, found
    step, message = found[0]
    assert message.startswith("diagnostic: ") and figure in message and fix in message, message
    assert step >= default_window(STEPS)  # a window, never a single step


def test_zero_std_says_whether_prompts_are_too_easy_or_too_hard():
    easy = run(Diagnostics(window=5), lambda s, m: {**m, "frac_reward_zero_std": 0.9, "reward": 0.95})
    hard = run(Diagnostics(window=5), lambda s, m: {**m, "frac_reward_zero_std": 0.9, "reward": 0.02})
    assert "too easy" in easy[0][1] and "too hard" in hard[0][1]
    with_ds = run(Diagnostics(window=5, dynamic_sampling=True), lambda s, m: {**m, "frac_reward_zero_std": 0.9})
    assert "dynamic sampling is on" in with_ds[0][1]


def tool_demo_like(step: int) -> dict:
    """The shape of `grpokit demo --task tools` (150 steps): the reward rises 0.28 -> 0.92 and flattens,
    per-token entropy falls 0.13 -> 0.01 (one right answer per prompt), and late groups tie because
    every answer in them is right."""
    learned = min(1.0, step / 60)
    return {"reward": 0.28 + 0.64 * learned + 0.03 * math.sin(step), "entropy": 0.13 * (1 - learned) + 0.008,
            "frac_reward_zero_std": 0.1 + 0.55 * learned, "clip_ratio/region_mean": 0.0,
            "completions/clipped_ratio": 0.0, "rewards/correct/mean": 0.3 + 0.6 * learned, "rewards/correct/std": 0.3}


def test_a_run_that_learns_its_task_is_not_warned_about_entropy_or_easy_prompts():
    """Entropy falling and groups tying because the policy now solves its prompts is the run succeeding."""
    d = Diagnostics(window=default_window(150))
    assert [m for step in range(1, 151) for m in d.update(step, tool_demo_like(step))] == []


def test_entropy_collapse_fires_once_the_reward_is_back_where_it_started():
    def rise_then_fall(step: int) -> dict:
        m = tool_demo_like(min(step, 60))
        return {**m, "reward": m["reward"] if step < 80 else 0.3} if step < 150 else m

    d = Diagnostics(window=10)
    found = [m for step in range(1, 150) for m in d.update(step, rise_then_fall(step))]
    assert [m for m in found if "entropy collapsed" in m] != [] and len(found) == 2, found
    assert any("mostly too hard" in m for m in found)  # the groups tie at a low reward again


def test_groups_that_tie_from_the_start_at_a_high_reward_are_still_too_easy():
    d = Diagnostics(window=10)
    found = [m for step in range(1, 61) for m in d.update(step, {**tool_demo_like(60), "frac_reward_zero_std": 0.8})]
    assert len(found) == 1 and "mostly too easy" in found[0], found


def test_one_bad_step_does_not_fire_a_window_check():
    spikes = lambda s, m: {**m, "clip_ratio/region_mean": 0.9, "frac_reward_zero_std": 1.0,  # noqa: E731
                           "completions/clipped_ratio": 1.0} if s == 30 else m
    assert run(Diagnostics(window=10), spikes) == []


def test_a_reward_that_spreads_once_is_not_flat():
    change = lambda s, m: {**m, "rewards/format/std": 0.0 if s > 1 else 0.2}  # noqa: E731
    assert run(Diagnostics(window=5), change) == []


def test_missing_and_non_finite_values_are_ignored():
    change = lambda s, m: {**m, "entropy": None if s % 2 else float("nan"), "kl": None,  # noqa: E731
                           "clip_ratio/region_mean": float("inf")}
    assert run(Diagnostics(window=5), change) == []


@pytest.mark.parametrize("G, figure", [(2, "+1 and -1"), (3, "+1.41 / -0.71")])
def test_small_groups_are_flagged_from_the_config(G, figure):
    d = Diagnostics.from_config(config(G))
    messages = d.check_config(config(G))
    assert len(messages) == 1 and f"rollout.group_size = {G}" in messages[0] and figure in messages[0]
    assert "4-16" in messages[0]
    assert d.check_config(config(G)) == []  # once per run


def test_replay_over_metrics_rows_reports_steps():
    rows = [{"step": s, **healthy(s), "completions/clipped_ratio": 0.9} for s in range(1, 21)]
    found = replay(rows, config(G=2, steps=20))
    assert [s for s, _ in found] == [0, default_window(20)]
    assert "group_size" in found[0][1] and "clipped_ratio" in found[1][1]
    assert replay(rows, None, window=20)[0][0] == 20
