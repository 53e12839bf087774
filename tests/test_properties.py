"""Property tests (hypothesis) for the math and the config loader: invariants over many random inputs.

Rewards are drawn on a coarse binary grid (multiples of 1/4) where a test adds or multiplies, so that
float rounding cannot merge two distinct rewards and the invariance is exact up to the last ulp.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from grpokit.algorithms.advantages import group_advantages
from grpokit.algorithms.objectives import LossSpec, policy_loss
from grpokit.config.loading import load_config, to_toml
from grpokit.config.schema import SECTIONS
from grpokit.errors import ConfigError

SETTINGS = settings(max_examples=50, deadline=None)
SCALES = ["group", "batch", "none"]
STDS = ["population", "sample"]
BASE = {"model": {"path": "m"}, "data": {"task": "addition"}}


# ------------------------------------------------------------------ group_advantages


@st.composite
def grouped_rewards(draw, values=st.integers(-40, 40).map(lambda k: k / 4), max_groups=4, max_group=8):
    """(rewards [B*G] float64, G)."""
    G = draw(st.integers(2, max_group))
    B = draw(st.integers(1, max_groups))
    flat = draw(st.lists(values, min_size=B * G, max_size=B * G))
    return torch.tensor(flat, dtype=torch.float64), G


finite_floats = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@SETTINGS
@given(grouped_rewards(values=finite_floats), st.sampled_from(SCALES), st.sampled_from(STDS))
def test_advantages_are_finite_and_sum_to_zero_per_group(data, scale, std):
    rewards, G = data
    assert torch.isfinite(group_advantages(rewards.float(), G, scale_rewards=scale, std=std)).all()  # as trained
    adv = group_advantages(rewards, G, scale_rewards=scale, std=std).view(-1, G)  # float64: check the algebra
    # |sum_i (r_i - mean)| <= G ulp(max |r|), divided by (std + eps) >= 1e-4: a bound 10x over the worst case.
    spread = rewards.view(-1, G).abs().amax(-1).clamp(min=1)  # [B]
    assert (adv.sum(-1).abs() <= 1e-11 * G * spread).all()


@SETTINGS
@given(grouped_rewards(values=st.floats(allow_nan=False, allow_infinity=False, width=32)), st.sampled_from(STDS))
def test_float32_rewards_of_any_size_keep_their_signal(data, std):
    """Over float32's whole range: finite advantages, and a group whose rewards span d >= 1 has max |A| >= 0.45
    (max |r - mean| >= d / 2 and std <= d, so |A| >= (d / 2) / (d + eps)); a float32 std overflowed past 1e19."""
    rewards, G = data
    adv = group_advantages(rewards.float(), G, std=std).view(-1, G)
    assert torch.isfinite(adv).all()
    grouped = rewards.view(-1, G)
    spans = (grouped.amax(-1) - grouped.amin(-1)) >= 1
    assert (adv[spans].abs().amax(-1) >= 0.45).all()


@SETTINGS
@given(grouped_rewards(), st.sampled_from(STDS))
def test_standardised_groups_are_zero_sum_with_unit_std(data, std):
    rewards, G = data
    adv = group_advantages(rewards, G, std=std, eps=0.0).view(-1, G)
    torch.testing.assert_close(adv.sum(-1), torch.zeros(len(adv), dtype=torch.float64), atol=1e-9, rtol=0)
    grouped = rewards.view(-1, G)
    informative = grouped.amax(-1) > grouped.amin(-1)
    # With eps = 0 each informative group is standardised: its std (same ddof) is exactly 1.
    ddof = 0 if std == "population" else 1
    if informative.any():
        stds = adv[informative].var(dim=-1, correction=ddof).sqrt()
        torch.testing.assert_close(stds, torch.ones_like(stds), atol=1e-9, rtol=0)


@SETTINGS
@given(grouped_rewards(), st.data(), st.sampled_from(["group", "none"]), st.sampled_from(STDS))
def test_adding_a_constant_to_a_group_changes_nothing(data, extra, scale, std):
    rewards, G = data
    shifts = torch.tensor(extra.draw(st.lists(st.integers(-50, 50), min_size=len(rewards) // G,
                                              max_size=len(rewards) // G)), dtype=torch.float64)
    shifted = (rewards.view(-1, G) + shifts[:, None]).reshape(-1)
    torch.testing.assert_close(group_advantages(shifted, G, scale_rewards=scale, std=std),
                               group_advantages(rewards, G, scale_rewards=scale, std=std), atol=1e-9, rtol=0)


@SETTINGS
@given(grouped_rewards(), st.data(), st.sampled_from(STDS))
def test_scaling_a_group_changes_nothing_with_group_scaling(data, extra, std):
    """A_i is invariant to r -> k_g * r (k_g > 0 per group) when each group is divided by its own std.
    Exact with eps = 0; the default eps = 1e-4 moves A by a relative eps / (k_g * std_g) at most."""
    rewards, G = data
    factors = torch.tensor(extra.draw(st.lists(st.sampled_from([0.25, 0.5, 2.0, 3.0, 16.0, 1000.0]),
                                               min_size=len(rewards) // G, max_size=len(rewards) // G)),
                           dtype=torch.float64)
    scaled = (rewards.view(-1, G) * factors[:, None]).reshape(-1)
    torch.testing.assert_close(group_advantages(scaled, G, std=std, eps=0.0),
                               group_advantages(rewards, G, std=std, eps=0.0), atol=1e-9, rtol=1e-9)


@SETTINGS
@given(st.integers(2, 8), st.integers(1, 4), finite_floats, st.sampled_from(SCALES), st.sampled_from(STDS))
def test_all_equal_groups_get_exactly_zero(G, B, value, scale, std):
    adv = group_advantages(torch.full((B * G,), value), G, scale_rewards=scale, std=std)
    assert torch.equal(adv, torch.zeros(B * G))


@SETTINGS
@given(grouped_rewards(), st.data(), st.sampled_from(SCALES), st.sampled_from(STDS))
def test_nan_rewards_get_zero_and_do_not_touch_the_rest(data, extra, scale, std):
    rewards, G = data
    holes = torch.tensor(extra.draw(st.lists(st.booleans(), min_size=len(rewards), max_size=len(rewards))))
    with_nan = torch.where(holes, torch.nan, rewards)
    adv = group_advantages(with_nan, G, scale_rewards=scale, std=std)
    assert torch.isfinite(adv).all()
    assert (adv[holes] == 0).all()
    # Within a group the valid answers' advantages still sum to zero.
    torch.testing.assert_close(adv.view(-1, G).sum(-1), torch.zeros(len(rewards) // G, dtype=torch.float64),
                               atol=1e-6, rtol=0)


# ------------------------------------------------------------------ policy_loss


@st.composite
def loss_inputs(draw):
    """logp, old_logp, ref_logp [N, T] (log-probs in [-20, 0]), advantages [N], mask [N, T] (right-padded)."""
    N, T = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    logp = -20 * torch.rand(N, T, generator=g, dtype=torch.float64)
    old = (logp + 0.6 * torch.randn(N, T, generator=g, dtype=torch.float64)).clamp(max=0)  # ratios around 1
    ref = -20 * torch.rand(N, T, generator=g, dtype=torch.float64)
    adv = torch.tensor(draw(st.lists(st.floats(-5, 5, allow_nan=False), min_size=N, max_size=N)), dtype=torch.float64)
    lengths = torch.tensor(draw(st.lists(st.integers(0, T), min_size=N, max_size=N)))
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return logp, old, ref, adv, mask


@SETTINGS
@given(loss_inputs(), st.sampled_from(["dapo", "bnpo", "grpo", "dr_grpo", "cispo"]))
def test_on_policy_loss_is_the_aggregated_negative_advantage(inputs, loss_type):
    """old_logp=None: ratio 1, so each token's loss is -A (CISPO: -min(1, cap) * A * logp, the cap being
    epsilon_high itself, as in TRL: unset it is epsilon, 0.2), aggregated as the loss type says."""
    logp, _, _, adv, mask = inputs
    T = logp.shape[1]
    loss, _ = policy_loss(logp, None, adv, mask, LossSpec(loss_type=loss_type, max_completion_length=T))
    m = mask.double()
    per_token = -adv[:, None] * m if loss_type != "cispo" else -0.2 * adv[:, None] * logp * m
    if loss_type == "cispo":  # with the usual cap (5.0) the weight at ratio 1 is 1
        capped, _ = policy_loss(logp, None, adv, mask,
                                LossSpec(loss_type=loss_type, epsilon_high=5.0, max_completion_length=T))
        torch.testing.assert_close(capped, (-adv[:, None] * logp * m).sum() / m.sum().clamp(min=1),
                                   atol=1e-10, rtol=1e-10)
    expected = {
        "dapo": per_token.sum() / m.sum().clamp(min=1),
        "bnpo": per_token.sum() / m.sum().clamp(min=1),
        "cispo": per_token.sum() / m.sum().clamp(min=1),
        "dr_grpo": per_token.sum() / (len(adv) * T),
        "grpo": (per_token.sum(-1) / m.sum(-1).clamp(min=1)).mean(),
    }[loss_type]
    torch.testing.assert_close(loss, expected, atol=1e-10, rtol=1e-10)


@SETTINGS
@given(loss_inputs(), st.sampled_from(["dapo", "bnpo", "grpo", "dr_grpo", "cispo"]),
       st.sampled_from(["token", "sequence"]), st.floats(0.01, 0.99), st.floats(0.0, 2.0), st.floats(0.0, 0.5))
def test_loss_is_finite_and_clip_stats_partition_the_region(inputs, loss_type, level, eps, eps_high, beta):
    logp, old, ref, adv, mask = inputs
    logp = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, old, adv, mask,
                              LossSpec(beta=beta, epsilon=eps, epsilon_high=eps_high or None, loss_type=loss_type,
                                       importance_sampling_level=level, max_completion_length=logp.shape[1]),
                              ref_logp=ref)
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    if loss_type == "cispo":  # one statistic: the share of tokens whose weight the cap lowered (TRL's)
        assert set(k for k in stats if k.startswith("clip_ratio/")) == {"clip_ratio/high_mean"}
        assert 0.0 <= stats["clip_ratio/high_mean"].item() <= 1.0
    else:
        low, high, region = (stats[f"clip_ratio/{k}_mean"].item() for k in ("low", "high", "region"))
        assert all(0.0 <= v <= 1.0 for v in (low, high, region))
        assert math.isclose(region, low + high, abs_tol=1e-12)  # low needs A < 0, high needs A > 0: disjoint
    if beta > 0:
        assert stats["kl"].item() >= 0  # k3 is non-negative


# ------------------------------------------------------------------ config loader

text = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)
VALID_OVERRIDES = {
    ("train", "steps"): st.integers(1, 10**6),
    ("train", "learning_rate"): st.floats(1e-9, 1.0),
    ("train", "warmup_steps"): st.integers(0, 100),
    ("train", "adam_betas"): st.tuples(st.floats(0, 0.999), st.floats(0, 0.9999)),
    ("train", "seed"): st.integers(0, 2**31),
    ("rollout", "group_size"): st.sampled_from([2, 4, 8]),  # divides the default batch of 8 * G
    ("rollout", "temperature"): st.floats(0.01, 5.0),
    ("rollout", "top_p"): st.floats(0.01, 1.0),
    ("rollout", "top_k"): st.integers(0, 1000),
    ("rollout", "stop_strings"): st.lists(text.filter(bool), max_size=3).map(tuple),
    ("algorithm", "loss_type"): st.sampled_from(["grpo", "bnpo", "dr_grpo", "dapo", "cispo"]),
    ("algorithm", "beta"): st.floats(0, 10),
    ("algorithm", "epsilon"): st.floats(0.001, 0.999),
    ("algorithm", "epsilon_high"): st.floats(0, 1),
    ("algorithm", "scale_rewards"): st.sampled_from(["group", "batch", "none"]),
    ("algorithm", "std"): st.sampled_from(["population", "sample"]),
    ("algorithm", "num_iterations"): st.integers(1, 8),
    ("output", "dir"): text.filter(bool),
    ("output", "keep_last"): st.integers(1, 10),
    ("data", "task_args"): st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True),
                                           st.integers(0, 9) | text, max_size=3),
    ("rewards", "functions"): st.lists(text.filter(bool), max_size=3).map(tuple),
}


def toml_literal(value) -> str:
    """An override's value as TOML, written independently of config.to_toml."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a valid TOML basic string for these characters
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


@SETTINGS
@given(st.lists(st.sampled_from(sorted(VALID_OVERRIDES)), min_size=1, max_size=5, unique=True), st.data())
def test_valid_overrides_apply_and_round_trip_through_to_toml(tmp_path_factory, keys, data):
    values = {key: data.draw(VALID_OVERRIDES[key], label=".".join(key)) for key in keys}
    overrides = [f"{s}.{k}={toml_literal(v)}" for (s, k), v in values.items()]
    config = load_config(None, overrides, base=BASE)
    for (section, key), value in values.items():
        assert getattr(getattr(config, section), key) == value
    path = tmp_path_factory.mktemp("toml") / "resolved.toml"
    path.write_text(to_toml(config), encoding="utf-8")
    assert load_config(path) == config


def test_a_newline_stop_string_round_trips_through_to_toml(tmp_path):
    config = load_config(None, ['rollout.stop_strings=["\\n"]'], base=BASE)
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(config), encoding="utf-8")
    assert load_config(path) == config


identifiers = st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True)


@SETTINGS
@given(st.sampled_from(sorted(SECTIONS)), identifiers)
def test_unknown_keys_always_raise_config_error(section, key):
    assume(key not in {f.name for f in dataclasses.fields(SECTIONS[section])})
    with pytest.raises(ConfigError, match=rf"unknown key {section}\.{key}"):
        load_config(None, [f"{section}.{key}=1"], base=BASE)


@SETTINGS
@given(identifiers)
def test_unknown_sections_always_raise_config_error(section):
    assume(section not in SECTIONS)
    with pytest.raises(ConfigError, match=rf"unknown section \[{section}\]"):
        load_config(None, [f"{section}.steps=1"], base=BASE)
