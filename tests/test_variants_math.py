"""Golden tests with hand-derived numbers for the second round of variants: SAPO, LUSPO, VESPO, two-sided
clipping (delta), the off-policy sequence mask, the sampler-trainer mismatch correction modes and the
adaptive entropy coefficient. (Parity with TRL 1.16's own code: test_variants_parity.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algorithms.mismatch import importance_correction
from grpokit.algorithms.objectives import LossSpec, adapt_entropy_coef, off_policy_mask, policy_loss, vespo_weights

F64 = torch.float64


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------- SAPO


def test_sapo_soft_gate_by_hand():
    # one answer, two tokens with log-ratios 0.5 and -0.4, A = +1 (tau_pos = 1); a second answer A = -2
    # (tau_neg = 1.05) with one token, log-ratio 0.3. grpo aggregation: mean over tokens, then answers.
    logp = torch.tensor([[0.5, -0.4], [0.3, 0.0]], dtype=F64, requires_grad=True)
    old = torch.zeros(2, 2, dtype=F64)
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, stats = policy_loss(logp, old, adv, mask,
                              LossSpec(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05))
    r = [math.exp(0.5), math.exp(-0.4), math.exp(0.3)]
    a0 = -(4 * _sigmoid(r[0] - 1) + 4 * _sigmoid(r[1] - 1)) / 2  # answer 0: -sigmoid(r - 1) * 4 * A, mean
    a1 = -(_sigmoid(1.05 * (r[2] - 1)) * 4 / 1.05) * (-2.0)
    assert loss.item() == pytest.approx((a0 + a1) / 2, abs=1e-12)
    assert stats == {}  # no clip range, no clip statistics
    # the gate's gradient: d/dlogp [-4/tau * sigmoid(tau (r - 1)) * A] = -4 A sigmoid'(.) * r
    loss.backward()
    s0 = _sigmoid(r[0] - 1)
    assert logp.grad[0, 0].item() == pytest.approx(-4 * s0 * (1 - s0) * r[0] / 2 / 2, abs=1e-12)


def test_sapo_on_policy_gradient_is_the_plain_policy_gradient():
    # at ratio 1 the gate's slope is sigmoid'(0) * 4 = 1 for any tau: the gradient is -A per token (grpo mean)
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    for tau in (1.0, 1.05, 3.0):
        logp.grad = None
        loss, _ = policy_loss(logp, None, torch.tensor([-0.7], dtype=F64), torch.ones(1, 3),
                              LossSpec(loss_type="sapo", sapo_temperature_pos=tau, sapo_temperature_neg=tau))
        loss.backward()
        torch.testing.assert_close(logp.grad, torch.full((1, 3), 0.7 / 3, dtype=F64), atol=1e-12, rtol=0)


# ---------------------------------------------------------------- LUSPO


def test_luspo_sums_each_answers_tokens_then_averages_answers():
    # on-policy, ratio 1: per-token loss -A. Answers of 3 and 2 tokens, A = +1 and -0.5:
    # (-1 * 3 + 0.5 * 2) / 2 = -1 (grpo would give (-1 + 0.5) / 2 = -0.25: no length weighting)
    logp = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([1.0, -0.5], dtype=F64)
    loss, _ = policy_loss(logp, None, adv, mask, LossSpec(loss_type="luspo", importance_sampling_level="sequence"))
    assert loss.item() == pytest.approx(-1.0, abs=1e-12)
    grpo, _ = policy_loss(logp, None, adv, mask, LossSpec(loss_type="grpo", importance_sampling_level="sequence"))
    assert grpo.item() == pytest.approx(-0.25, abs=1e-12)


def test_luspo_clips_the_sequence_ratio_like_gspo():
    # one answer of 2 tokens, log-ratios 0.3 and 0.1: GSPO ratio exp(0.2) = 1.2214 > 1 + 4e-4, A = 1:
    # clipped to 1.0004, summed over 2 tokens
    logp = torch.tensor([[0.3, 0.1]], dtype=F64)
    loss, stats = policy_loss(logp, torch.zeros(1, 2, dtype=F64), torch.ones(1, dtype=F64), torch.ones(1, 2),
                              LossSpec(loss_type="luspo", importance_sampling_level="sequence", epsilon=3e-4,
                                       epsilon_high=4e-4))
    assert loss.item() == pytest.approx(-2 * 1.0004, abs=1e-12)
    assert stats["clip_ratio/high_mean"].item() == 1.0


# ---------------------------------------------------------------- VESPO


def test_vespo_gamma_weight_by_hand():
    # phi(w) = e^lam * w^k * e^(-lam w); phi(1) = 1 for every (k, lam)
    adv = torch.tensor([[1.0], [-1.0], [0.0]], dtype=F64)
    maskf = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]], dtype=F64)
    log_ratio = torch.tensor([[0.2, 0.3], [-0.4, 9.0], [0.0, 0.0]], dtype=F64)  # padding (9.0) is ignored
    phi = vespo_weights(adv, log_ratio, maskf)
    w0, w1 = math.exp(0.5), math.exp(-0.4)
    want = [math.exp(3) * w0 ** 2 * math.exp(-3 * w0),  # A >= 0: k = 2, lam = 3 (the sequence SUM of log-ratios)
            math.exp(2) * w1 ** 3 * math.exp(-2 * w1),  # A < 0: k = 3, lam = 2
            1.0]  # w = 1
    torch.testing.assert_close(phi, torch.tensor(want, dtype=F64)[:, None], atol=1e-12, rtol=0)


def test_vespo_loss_is_reinforce_weighted_by_phi_with_no_gradient_through_phi():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=F64, requires_grad=True)
    old = logp.detach() - torch.tensor([[0.2, 0.3], [-0.4, 0.0]], dtype=F64)  # log-ratios as above
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, stats = policy_loss(logp, old, adv, mask, LossSpec(loss_type="vespo"))
    w0, w1 = math.exp(0.5), math.exp(-0.4)
    phi0, phi1 = math.exp(3) * w0 ** 2 * math.exp(-3 * w0), math.exp(2) * w1 ** 3 * math.exp(-2 * w1)
    total = -phi0 * 1.0 * (-1.0 - 2.0) - phi1 * (-1.0) * (-0.5)  # -phi * A * logp over the 3 valid tokens
    assert loss.item() == pytest.approx(total / 3, abs=1e-12)  # dapo normaliser: 3 tokens
    assert stats["vespo/phi_seq_mean"].item() == pytest.approx((phi0 + phi1) / 2, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-phi0 / 3, -phi0 / 3], [phi1 / 3, 0.0]], dtype=F64))


def test_vespo_folds_the_mismatch_weights_into_its_sequence_ratio():
    adv = torch.tensor([[1.0]], dtype=F64)
    maskf = torch.ones(1, 2, dtype=F64)
    weights = torch.tensor([[2.0, 0.5]], dtype=F64)  # product 1: no change
    plain = vespo_weights(adv, torch.tensor([[0.1, 0.1]], dtype=F64), maskf)
    torch.testing.assert_close(vespo_weights(adv, torch.tensor([[0.1, 0.1]], dtype=F64), maskf, weights), plain)
    w = math.exp(0.2) * 3.0  # product of the weights 3
    got = vespo_weights(adv, torch.tensor([[0.1, 0.1]], dtype=F64), maskf, torch.tensor([[3.0, 1.0]], dtype=F64))
    assert got.item() == pytest.approx(math.exp(3) * w ** 2 * math.exp(-3 * w), abs=1e-12)


# ---------------------------------------------------------------- two-sided clipping


def test_delta_caps_the_loss_of_a_negative_advantage_token_whose_ratio_ran_away():
    # ratio 5, A = -1: standard clipped loss -min(5 * -1, 1.2 * -1) = 5; with delta = 3: -min(3 * -1, -1.2) = 3
    logp = torch.tensor([[math.log(5.0)]], dtype=F64, requires_grad=True)
    old, adv, mask = torch.zeros(1, 1, dtype=F64), torch.tensor([-1.0], dtype=F64), torch.ones(1, 1)
    plain, _ = policy_loss(logp, old, adv, mask, LossSpec(loss_type="bnpo"))
    capped, _ = policy_loss(logp, old, adv, mask, LossSpec(loss_type="bnpo", delta=3.0))
    assert (plain.item(), capped.item()) == (pytest.approx(5.0), pytest.approx(3.0))
    capped.backward()
    assert logp.grad.item() == 0.0  # the cap is flat: no gradient pushes the ratio further
    # a positive advantage is bounded by the usual clip (1 + eps_high < delta): delta changes nothing
    a, _ = policy_loss(logp.detach(), old, -adv, mask, LossSpec(loss_type="bnpo"))
    b, _ = policy_loss(logp.detach(), old, -adv, mask, LossSpec(loss_type="bnpo", delta=3.0))
    assert a.item() == b.item() == pytest.approx(-1.2)


# ---------------------------------------------------------------- off-policy sequence mask


def test_off_policy_mask_drops_negative_advantage_answers_that_drifted_too_far():
    # mean KL (sampling - current) per answer: 0.6, 0.4, 0.9, 0.6 (last: two tokens 0.2 and 1.0)
    logp = torch.zeros(4, 2, dtype=F64)
    sampling = torch.tensor([[0.6, 0.0], [0.4, 0.0], [0.9, 0.0], [0.2, 1.0]], dtype=F64)
    maskf = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0]], dtype=F64)
    adv = torch.tensor([[-1.0], [-1.0], [2.0], [-0.1]], dtype=F64)
    keep = off_policy_mask(adv, logp, sampling, maskf, threshold=0.5)
    assert keep.squeeze(-1).tolist() == [0.0, 1.0, 1.0, 0.0]  # drop A<0 with KL>0.5; A>=0 always kept
    sampling_nan = sampling.clone()
    sampling_nan[0, 0] = math.nan  # an unscored token is no evidence: KL 0 there
    assert off_policy_mask(adv, logp, sampling_nan, maskf, threshold=0.5)[0].item() == 1.0


def test_off_policy_mask_in_the_loss_removes_the_policy_term_not_the_kl():
    logp = torch.tensor([[-1.0], [-1.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5], [-0.5]], dtype=F64)
    sampling = torch.tensor([[0.0], [-1.0]], dtype=F64)  # answer 0 drifted by KL 1.0, answer 1 not at all
    adv, mask = torch.tensor([-1.0, -1.0], dtype=F64), torch.ones(2, 1)
    loss, stats = policy_loss(logp, None, adv, mask,
                              LossSpec(beta=0.1, loss_type="bnpo", off_policy_mask_threshold=0.5), ref_logp=ref,
                              sampling_logp=sampling)
    kl = [math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1]
    want = (0.0 + 0.1 * kl[0] + 1.0 + 0.1 * kl[1]) / 2  # answer 0: KL only; answer 1: -A * 1 + KL
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert stats["off_policy/masked_share"].item() == 0.5


# ---------------------------------------------------------------- mismatch correction modes


TRAINER = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, -0.1, 0.0]], dtype=F64)
SAMPLER = torch.tensor([[-2.0, -1.0, -0.6], [-0.2, -0.1, 5.0]], dtype=F64)  # gaps 1, -1, 0.3 | -0.3, 0, pad
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_truncate_and_mask_by_hand():
    e = math.exp
    w, stats = importance_correction(TRAINER, SAMPLER, MASK, "token_truncate", cap_max=2.0, cap_min=0.5)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, e(0.3)], [e(-0.3), 1.0, 1.0]], dtype=F64))
    assert stats["sampling/is_truncated_share"] == pytest.approx(2 / 5)  # e^1 and e^-1 of 5 valid tokens
    w, stats = importance_correction(TRAINER, SAMPLER, MASK, "token_mask", cap_max=2.0, cap_min=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, e(0.3)], [e(-0.3), 1.0, 1.0]], dtype=F64))
    assert stats["sampling/is_masked_share"] == pytest.approx(2 / 5)
    assert stats["sampling/is_ratio_mean"] == pytest.approx((e(0.3) + e(-0.3) + 1.0) / 5)
    assert (stats["sampling/is_ratio_min"], stats["sampling/is_ratio_max"]) == (0.0, pytest.approx(e(0.3)))
    assert stats["sampling/logprob_gap_mean"] == pytest.approx((1 + 1 + 0.3 + 0.3 + 0) / 5)
    assert stats["sampling/logprob_gap_max"] == pytest.approx(1.0)


def test_sequence_modes_use_the_product_of_the_token_ratios():
    # answer 0: exp(1 - 1 + 0.3) = e^0.3; answer 1: exp(-0.3 + 0) = e^-0.3 (padding left out)
    e = math.exp
    w, stats = importance_correction(TRAINER, SAMPLER, MASK, "sequence_truncate", cap_max=1.2)
    torch.testing.assert_close(w, torch.tensor([[1.2], [e(-0.3)]], dtype=F64))  # e^0.3 = 1.35 > 1.2
    assert stats["sampling/is_truncated_share"] == 0.5
    w, stats = importance_correction(TRAINER, SAMPLER, MASK, "sequence_mask", cap_min=0.8)
    torch.testing.assert_close(w, torch.tensor([[e(0.3)], [0.0]], dtype=F64))  # e^-0.3 = 0.74 < 0.8
    assert stats["sampling/is_masked_share"] == 0.5


def test_correction_arguments_are_checked():
    with pytest.raises(ValueError, match="needs a bound"):
        importance_correction(TRAINER, SAMPLER, MASK, "token_mask")
    with pytest.raises(ValueError, match="must be below cap_max"):
        importance_correction(TRAINER, SAMPLER, MASK, "token_mask", cap_min=2.0, cap_max=2.0)
    with pytest.raises(ValueError, match="mode must be one of"):
        importance_correction(TRAINER, SAMPLER, MASK, "sequence")


def test_sequence_weights_broadcast_over_the_answers_tokens_in_the_loss():
    logp = torch.zeros(2, 2, dtype=F64, requires_grad=True)
    adv, mask = torch.tensor([1.0, 1.0], dtype=F64), torch.ones(2, 2)
    loss, _ = policy_loss(logp, None, adv, mask, LossSpec(loss_type="bnpo"),
                          token_weights=torch.tensor([[0.0], [2.0]], dtype=F64))
    assert loss.item() == pytest.approx((0 + 0 - 2 - 2) / 4)


# ---------------------------------------------------------------- adaptive entropy coefficient


def test_adaptive_entropy_coefficient_steps_toward_the_target_within_its_bounds():
    step = dict(target=0.2, delta=0.005, low=0.0, high=0.012)
    coef = 0.0
    trace = []
    for entropy in (0.1, 0.15, 0.2, 0.3, 0.05, 0.05, 0.05):  # at or below the target: up; above: down
        coef = adapt_entropy_coef(coef, entropy, **step)
        trace.append(round(coef, 6))
    assert trace == [0.005, 0.01, 0.012, 0.007, 0.012, 0.012, 0.012]  # capped at high = 0.012
    assert adapt_entropy_coef(0.003, 0.9, **step) == 0.0  # floored at low
