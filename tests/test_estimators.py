"""Advantage estimators (RLOO, REINFORCE++-baseline) and the loss options beside the loss type
(KL bias correction, top-entropy quantile, entropy bonus): hand-derived golden numbers, then
TRL 1.16's own code on identical inputs (its RLOO arithmetic line for line; its
``GRPOTrainer._compute_loss`` called on a stand-in ``self``, as in test_trl_parity.py)."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grpokit.algorithms.advantages import ESTIMATORS, group_advantages
from grpokit.algorithms.objectives import Accumulation, LossSpec, high_entropy_mask, policy_loss

F64 = torch.float64


def _t(*values):
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------- estimators: golden


def test_rloo_baseline_is_the_mean_of_the_others():
    # rewards 1 0 0 1: a 1's baseline is (0 + 0 + 1) / 3 = 1/3, a 0's is (1 + 0 + 1) / 3 = 2/3
    adv = group_advantages(_t(1, 0, 0, 1), 4, estimator="rloo")
    torch.testing.assert_close(adv, _t(2 / 3, -2 / 3, -2 / 3, 2 / 3))


def test_rloo_on_the_seed_table_is_g_over_g_minus_1_times_the_centred_reward():
    # seed 001's scores 0.8 0.3 0.6 0.3 (mean 0.5): A_i = 4/3 (r_i - 0.5), never divided by a std
    adv = group_advantages(_t(0.8, 0.3, 0.6, 0.3), 4, estimator="rloo")
    torch.testing.assert_close(adv, _t(0.3, -0.2, 0.1, -0.2) * 4 / 3)  # 0.4 -0.267 0.133 -0.267


def test_rloo_leaves_nan_rewards_out_of_the_baseline():
    # [1, nan, 0, 0]: the 1 is compared with (0 + 0) / 2, each 0 with (1 + 0) / 2; nan gets 0
    adv = group_advantages(_t(1, math.nan, 0, 0), 4, estimator="rloo")
    torch.testing.assert_close(adv, _t(1.0, 0.0, -0.5, -0.5))


def test_reinforce_pp_divides_group_centred_rewards_by_their_batch_std():
    # groups [1, 0] and [1, 1]: centred 0.5 -0.5 0 0; their population std over the batch is
    # sqrt((0.25 + 0.25) / 4) = 1/sqrt(8), so A = 0.5 * sqrt(8) = sqrt(2); the equal group stays 0
    adv = group_advantages(_t(1, 0, 1, 1), 2, estimator="reinforce_pp", eps=0.0)
    torch.testing.assert_close(adv, _t(math.sqrt(2), -math.sqrt(2), 0, 0))
    # sample std (ddof 1): sqrt(0.5 / 3), A = 0.5 / sqrt(1/6) = sqrt(1.5)
    adv = group_advantages(_t(1, 0, 1, 1), 2, estimator="reinforce_pp", eps=0.0, std="sample")
    torch.testing.assert_close(adv, _t(math.sqrt(1.5), -math.sqrt(1.5), 0, 0))


def test_reinforce_pp_differs_from_batch_scaling_which_uses_the_raw_rewards_spread():
    # scale_rewards="batch": std of the raw rewards 1 0 1 1 = sqrt(3/16) (includes the gap between prompts)
    batch = group_advantages(_t(1, 0, 1, 1), 2, scale_rewards="batch", eps=0.0)
    torch.testing.assert_close(batch, _t(0.5, -0.5, 0, 0) / math.sqrt(3 / 16))
    pp = group_advantages(_t(1, 0, 1, 1), 2, estimator="reinforce_pp", eps=0.0)
    assert pp[0] > batch[0] + 0.2


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_every_estimator_gives_exact_zero_to_groups_without_signal(estimator):
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.7, 0.2, math.nan, 0.3, 1.0, math.nan, math.nan, math.nan])
    adv = group_advantages(rewards, 4, estimator=estimator)
    assert torch.equal(adv[:4], torch.zeros(4))  # all equal (0.1 sums with an ulp of error)
    assert torch.equal(adv[8:], torch.zeros(4))  # a single valid reward
    assert adv[6] == 0 and adv[4] > 0 > adv[5]
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp"])
def test_estimators_other_than_grpo_reject_scale_rewards(estimator):
    with pytest.raises(ValueError, match="applies to the 'grpo' estimator only"):
        group_advantages(_t(1, 0), 2, estimator=estimator, scale_rewards="none")
    with pytest.raises(ValueError, match="estimator must be one of"):
        group_advantages(_t(1, 0), 2, estimator="ppo")


def test_grpo_estimator_is_the_default_bit_for_bit():
    rewards = torch.rand(24, generator=torch.Generator().manual_seed(0))
    for scale in ("group", "batch", "none"):
        assert torch.equal(group_advantages(rewards, 4, scale_rewards=scale),
                           group_advantages(rewards, 4, scale_rewards=scale, estimator="grpo"))


def test_rloo_matches_trl_rloo_trainer_arithmetic():
    """TRL 1.16 rloo_trainer.py (the leave-one-out lines after "RLOO advantages computation"), line for line."""
    gen = torch.Generator().manual_seed(3)
    rewards = torch.rand(5 * 4, generator=gen, dtype=F64)
    rewards[4:8] = 0.25
    rewards[9] = math.nan
    rewards[12:15] = math.nan
    grouped = rewards.view(-1, 4)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (counts - 1)).view(-1)
    theirs = torch.nan_to_num(rewards - baselines, nan=0.0)
    torch.testing.assert_close(group_advantages(rewards, 4, estimator="rloo"), theirs, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- loss options: golden

ENT = _t(0.1, 0.9, 0.5, 0.3, 0.6, 5.0).view(2, 3)  # row 1's last position is padding (entropy 5.0 there)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_high_entropy_mask_keeps_the_top_quantile_of_valid_tokens():
    # valid entropies sorted: 0.1 0.3 0.5 0.6 0.9; q = 0.4 -> the 0.6 quantile: position 0.6 * 4 = 2.4,
    # 0.5 + 0.4 * (0.6 - 0.5) = 0.54 -> keeps 0.9 and 0.6 (two of five); padding (5.0) never
    assert high_entropy_mask(ENT, MASK, 0.4).tolist() == [[False, True, False], [False, True, False]]
    assert high_entropy_mask(ENT, MASK, 1.0).tolist() == [[True, True, True], [True, True, False]]
    assert high_entropy_mask(ENT, MASK, 0.0).tolist() == [[False, True, False], [False, False, False]]
    assert not high_entropy_mask(ENT, torch.zeros_like(MASK), 0.2).any()
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        high_entropy_mask(ENT, MASK, 1.5)


def test_high_entropy_mask_equals_torch_quantile():
    gen = torch.Generator().manual_seed(0)
    ent, mask = torch.rand(16, 9, generator=gen), torch.rand(16, 9, generator=gen) > 0.3
    for q in (0.05, 0.2, 0.5, 0.77, 1.0):
        thr = torch.quantile(ent[mask], 1 - q)
        assert torch.equal(high_entropy_mask(ent, mask, q), (ent * mask >= thr) & mask)


def test_top_entropy_quantile_keeps_the_policy_term_on_those_tokens_only():
    # on-policy, bnpo: loss_t = -A_i on kept tokens; A = (2, 1); q = 0.4 keeps (0, 1) and (1, 1):
    # (-2 - 1) / 5 valid tokens (the normaliser is still the full mask) = -0.6
    logp = torch.full((2, 3), -1.0, dtype=F64, requires_grad=True)
    loss, _ = policy_loss(logp, None, _t(2, 1), MASK, LossSpec(loss_type="bnpo", top_entropy_quantile=0.4), entropy=ENT)
    assert abs(loss.item() + 0.6) < 1e-12
    loss.backward()
    torch.testing.assert_close(logp.grad, _t(0, -0.4, 0, 0, -0.2, 0).view(2, 3))
    full, _ = policy_loss(logp, None, _t(2, 1), MASK, LossSpec(loss_type="bnpo", top_entropy_quantile=1.0), entropy=ENT)
    assert abs(full.item() + 8 / 5) < 1e-12  # (-2 * 3 - 1 * 2) / 5


@pytest.mark.parametrize(("loss_type", "expected"), [
    ("bnpo", -0.1 * (0.1 + 0.9 + 0.5 + 0.3 + 0.6) / 5),  # token mean 0.48
    ("dapo", -0.1 * 2.4 / 5),
    ("grpo", -0.1 * (0.5 + 0.45) / 2),  # per answer: (0.1 + 0.9 + 0.5) / 3, (0.3 + 0.6) / 2
    ("dr_grpo", -0.1 * 2.4 / (2 * 4)),  # sum / (N * max_completion_length = 4)
])
def test_entropy_bonus_uses_the_loss_types_aggregation(loss_type, expected):
    ent = ENT.clone().requires_grad_()
    logp = torch.full((2, 3), -1.0, dtype=F64, requires_grad=True)
    loss, _ = policy_loss(logp, None, _t(0, 0), MASK,
                          LossSpec(loss_type=loss_type, entropy_coef=0.1, max_completion_length=4), entropy=ent)
    assert abs(loss.item() - expected) < 1e-12
    loss.backward()
    assert ent.grad[1, 2] == 0 and (ent.grad[MASK.bool()] < 0).all()  # pushes entropy up, never at padding
    if loss_type == "bnpo":
        torch.testing.assert_close(ent.grad, _t(-0.02, -0.02, -0.02, -0.02, -0.02, 0).view(2, 3))


def test_entropy_bonus_acts_on_the_top_entropy_tokens_when_both_are_set():
    # q = 0.4 keeps the tokens with entropy 0.9 and 0.6: bonus -0.1 * (0.9 + 0.6) / 5
    loss, _ = policy_loss(torch.zeros(2, 3, dtype=F64), None, _t(0, 0), MASK,
                          LossSpec(loss_type="bnpo", entropy_coef=0.1, top_entropy_quantile=0.4), entropy=ENT)
    assert abs(loss.item() + 0.03) < 1e-12


def test_kl_bias_correction_multiplies_k3_by_the_ratio_and_its_gradient():
    # one token, A = 0, beta = 1, bnpo. logp = log 0.5, ref = log 0.25: delta = ref - logp = -log 2,
    # k3 = 0.5 + log 2 - 1 = 0.19315. Plain: dk3/dlogp = 1 - e^delta = 0.5. Corrected on-policy
    # (value of rho = 1): d(k3 * rho)/dlogp = 1 - e^delta + k3 = -delta = log 2.
    mask = torch.ones(1, 1)
    ref = torch.tensor([[math.log(0.25)]], dtype=F64)
    k3 = 0.5 + math.log(2) - 1
    for correct, grad in ((False, 0.5), (True, math.log(2))):
        logp = torch.tensor([[math.log(0.5)]], dtype=F64, requires_grad=True)
        loss, stats = policy_loss(logp, None, _t(0), mask,
                                  LossSpec(beta=1.0, loss_type="bnpo", kl_bias_correction=correct), ref_logp=ref)
        loss.backward()
        assert abs(loss.item() - k3) < 1e-12 and abs(stats["kl"].item() - k3) < 1e-12
        assert abs(logp.grad.item() - grad) < 1e-12
    # off-policy: old = log 0.25 makes rho = 2, so the corrected KL term is 2 * k3
    loss, stats = policy_loss(torch.tensor([[math.log(0.5)]], dtype=F64), torch.tensor([[math.log(0.25)]], dtype=F64),
                              _t(0), mask, LossSpec(beta=1.0, loss_type="bnpo", kl_bias_correction=True), ref_logp=ref)
    assert abs(loss.item() - 2 * k3) < 1e-12 and abs(stats["kl"].item() - 2 * k3) < 1e-12


def test_entropy_options_validate_their_inputs():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="needs entropy"):
        policy_loss(logp, None, torch.zeros(2), MASK, LossSpec(entropy_coef=0.1))
    with pytest.raises(ValueError, match="needs entropy"):
        policy_loss(logp, None, torch.zeros(2), MASK, LossSpec(top_entropy_quantile=0.5))
    with pytest.raises(ValueError, match="entropy must have shape"):
        policy_loss(logp, None, torch.zeros(2), MASK, LossSpec(entropy_coef=0.1), entropy=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="entropy_coef must be >= 0"):
        policy_loss(logp, None, torch.zeros(2), MASK, LossSpec(entropy_coef=-1.0), entropy=torch.zeros(2, 3))


def test_defaults_leave_the_loss_unchanged():
    gen = torch.Generator().manual_seed(1)
    logp, old, ref = (torch.randn(4, 5, generator=gen, dtype=F64) - 2 for _ in range(3))
    adv, mask = torch.randn(4, generator=gen, dtype=F64), (torch.rand(4, 5, generator=gen) > 0.2).long()
    base, _ = policy_loss(logp, old, adv, mask, LossSpec(beta=0.04), ref_logp=ref)
    same, _ = policy_loss(logp, old, adv, mask,
                          LossSpec(beta=0.04, entropy_coef=0.0, top_entropy_quantile=1.0, kl_bias_correction=False),
                          ref_logp=ref, entropy=torch.rand(4, 5, dtype=F64))
    assert torch.equal(base, same)


# ---------------------------------------------------------------- TRL 1.16 parity

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
from test_trl_parity import trl_compute_loss  # noqa: E402  (TRL's loss on our tensors, shared with the parity tests)

EPS, EPS_HIGH, MAX_LEN = 0.2, 0.28, 7


def _fake_trl(loss_type, level, beta, logp, ent, *, bias_kl=False, quantile=1.0, entropy_coef=0.0):
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, ent, None),
        top_entropy_quantile=quantile, aux_loss_enabled=False, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=EPS,
        epsilon_high=1.0 + EPS_HIGH if loss_type == "cispo" else EPS_HIGH,
        args=SimpleNamespace(use_bias_correction_kl=bias_kl, delta=None, steps_per_generation=1),
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=MAX_LEN,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x,
                                    pad_across_processes=lambda x, dim, pad_index: x, sync_gradients=True),
        _entropy_bonus_enabled=entropy_coef > 0, entropy_coef=entropy_coef, use_adaptive_entropy=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    fake.get_high_entropy_mask = lambda e, m, t: trl_grpo.GRPOTrainer.get_high_entropy_mask(fake, e, m, t)
    return fake


def _batch(seed, on_policy):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 1, 5, 0, 6])
    mask = (torch.arange(MAX_LEN)[None, :] < lengths[:, None]).long()  # [6, 7]
    logp = torch.log_softmax(torch.randn(6, MAX_LEN, 5, generator=gen, dtype=F64), -1)[..., 0]
    old = None if on_policy else logp + 0.3 * torch.randn(6, MAX_LEN, generator=gen, dtype=F64)
    ref = logp + 0.2 * torch.randn(6, MAX_LEN, generator=gen, dtype=F64)
    ent = 2.0 * torch.rand(6, MAX_LEN, generator=gen, dtype=F64)
    adv = torch.randn(6, generator=gen, dtype=F64)
    return logp, old, ref, ent, adv, mask


def _both(loss_type, level, beta, on_policy, *, seed=0, bias_kl=False, quantile=1.0, entropy_coef=0.0,
          num_items=None, compare=True):
    logp0, old, ref, ent0, adv, mask = _batch(seed, on_policy)
    num_items = torch.tensor(40) if num_items is None else num_items
    trl_logp, trl_ent = logp0.clone().requires_grad_(), ent0.clone().requires_grad_()
    fake = _fake_trl(loss_type, level, beta, trl_logp, trl_ent, bias_kl=bias_kl, quantile=quantile,
                     entropy_coef=entropy_coef)
    trl_loss = trl_compute_loss(fake, adv, mask, old, ref if beta else None, num_items)
    trl_loss.backward()

    logp, ent = logp0.clone().requires_grad_(), ent0.clone().requires_grad_()
    loss, stats = policy_loss(logp, old, adv, mask,
                              LossSpec(beta=beta, epsilon=EPS,
                                       epsilon_high=1.0 + EPS_HIGH if loss_type == "cispo" else EPS_HIGH,
                                       loss_type=loss_type, importance_sampling_level=level,
                                       max_completion_length=MAX_LEN, kl_bias_correction=bias_kl,
                                       entropy_coef=entropy_coef, top_entropy_quantile=quantile),
                              ref_logp=ref if beta else None, accumulation=Accumulation(num_items), entropy=ent)
    loss.backward()
    if not compare:
        return loss, trl_loss
    assert abs(loss.item() - trl_loss.item()) < 1e-9 * max(1.0, abs(trl_loss.item()))
    torch.testing.assert_close(logp.grad, trl_logp.grad, atol=1e-9, rtol=1e-9)
    assert logp.grad.abs().sum() > 0
    if entropy_coef:
        torch.testing.assert_close(ent.grad, trl_ent.grad, atol=1e-9, rtol=1e-9)
    if beta:
        assert abs(stats["kl"].item() - fake._metrics["train"]["kl"][0]) < 1e-9
    return loss, trl_loss


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_kl_bias_correction_matches_trl(loss_type, level, on_policy):
    loss, _ = _both(loss_type, level, 0.04, on_policy, seed=1, bias_kl=True)
    plain, _ = _both(loss_type, level, 0.04, on_policy, seed=1, bias_kl=False)
    if not on_policy:
        assert abs(loss.item() - plain.item()) > 1e-6  # the option changed something


@pytest.mark.parametrize("quantile", [0.2, 0.5])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_top_entropy_quantile_matches_trl(loss_type, level, quantile):
    _both(loss_type, level, 0.04, False, seed=2, quantile=quantile)


@pytest.mark.parametrize("quantile", [1.0, 0.3])
@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_entropy_bonus_matches_trl_where_both_take_the_token_mean(loss_type, quantile):
    # TRL's bonus is sum(H * m') / sum(m') over the acting tokens m'; grpokit's is aggregated like the
    # loss: equal for bnpo and for dapo with num_items_in_batch = this batch's tokens, when m' = m
    if quantile == 1.0:
        _both(loss_type, "token", 0.0, False, seed=3, entropy_coef=0.05, num_items=torch.tensor(22))
        return
    # documented difference with a top-entropy mask m': grpokit keeps the full mask's normaliser (22 tokens)
    ours, theirs = _both(loss_type, "token", 0.0, False, seed=3, entropy_coef=0.05, quantile=quantile,
                         num_items=torch.tensor(22), compare=False)
    _, _, _, ent, _, mask = _batch(3, False)
    acting = high_entropy_mask(ent, mask, quantile)
    bonus_sum = (ent * acting).sum().item()
    expected = theirs.item() + 0.05 * bonus_sum / acting.sum().item() - 0.05 * bonus_sum / 22
    assert abs(ours.item() - expected) < 1e-9 and abs(ours.item() - theirs.item()) > 1e-3
