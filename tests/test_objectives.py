"""Golden, gradient and memory tests for grpokit.algorithms.objectives."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algorithms.advantages import group_advantages
from grpokit.algorithms.logprobs import token_logprobs, token_logprobs_from_hidden
from grpokit.algorithms.objectives import Accumulation, LossSpec, importance_log_ratio, policy_loss, sequence_ratio

LN2 = math.log(2.0)
F64 = torch.float64


# ---------------------------------------------------------------- seed 002


def _seed002_logits(probs: list[list[float]]) -> torch.Tensor:
    # logits whose softmax is `probs` (shifted by +3 per row: softmax ignores the shift)
    return (torch.tensor(probs, dtype=F64).log() + 3.0).unsqueeze(0)  # [1, 3, 3]


OLD_PROBS = [[0.5, 0.3, 0.2], [0.2, 0.6, 0.2], [0.3, 0.3, 0.4]]  # steps 1-3, tokens A B C
NEW_PROBS = [[0.6, 0.2, 0.2], [0.1, 0.7, 0.2], [0.2, 0.2, 0.6]]
ABC = torch.tensor([[0, 1, 2]])  # the sequence A B C


def test_seed002_token_and_sequence_ratios():
    old = token_logprobs(_seed002_logits(OLD_PROBS), ABC)  # log(0.5, 0.6, 0.4)
    new = token_logprobs(_seed002_logits(NEW_PROBS), ABC)  # log(0.6, 0.7, 0.6)
    mask = torch.ones(1, 3)
    torch.testing.assert_close(old.exp(), torch.tensor([[0.5, 0.6, 0.4]], dtype=F64))
    rho = importance_log_ratio(new, old, mask).exp()
    torch.testing.assert_close(rho, torch.tensor([[1.2, 0.7 / 0.6, 1.5]], dtype=F64), atol=1e-12, rtol=0)
    assert abs(rho[0, 1].item() - 1.1667) < 1e-4
    # pi_new(ABC) / pi_old(ABC) = 0.252 / 0.12 = 2.1 = 1.2 * 1.1667 * 1.5
    seq = sequence_ratio(new, old, mask)
    torch.testing.assert_close(seq, torch.tensor([2.1], dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(seq, torch.tensor([0.252 / 0.12], dtype=F64), atol=1e-12, rtol=0)
    # GSPO's length-normalised sequence ratio: 2.1 ** (1/3)
    gspo = importance_log_ratio(new, old, mask, level="sequence").exp()
    torch.testing.assert_close(gspo, torch.tensor([[2.1 ** (1 / 3)]], dtype=F64), atol=1e-12, rtol=0)


def test_seed002_ratios_through_policy_loss():
    old = token_logprobs(_seed002_logits(OLD_PROBS), ABC)
    new = token_logprobs(_seed002_logits(NEW_PROBS), ABC)
    # A = 1, no clipping (epsilon 10), bnpo: loss = -(1.2 + 1.1667 + 1.5) / 3
    loss, _ = policy_loss(new, old, torch.ones(1, dtype=F64), torch.ones(1, 3),
                          LossSpec(epsilon=10.0, loss_type="bnpo"))
    assert abs(loss.item() + (1.2 + 0.7 / 0.6 + 1.5) / 3) < 1e-12
    # default epsilon 0.2: all three are clipped to 1.2 -> loss -1.2, stats: 2 of 3 above 1.2
    loss, stats = policy_loss(new, old, torch.ones(1, dtype=F64), torch.ones(1, 3), LossSpec(loss_type="bnpo"))
    assert abs(loss.item() + (1.2 + 0.7 / 0.6 + 1.2) / 3) < 1e-12
    assert abs(stats["clip_ratio/high_mean"].item() - 1 / 3) < 1e-12  # only 1.5 > 1.2 (1.2 is not > 1.2)


# ---------------------------------------------------------------- the hand-derived batch
#
# N = 3 answers, T = 4 slots, old_logp = log 0.5 on every completion token, logp = log(0.5 * rho).
#   answer 0: A = +1,  rho = 1.0  1.5  0.5  | pad   (3 tokens)
#   answer 1: A = -2,  rho = 0.5  1.5  | pad pad    (2 tokens)
#   answer 2: A = +0.5, rho = 1.1 0.9  1.25 1.0     (4 tokens)
# epsilon = 0.2: clip range [0.8, 1.2].
# per-token -min(rho*A, clip(rho)*A):
#   answer 0: -min(1, 1) = -1;  -min(1.5, 1.2) = -1.2 (clipped);  -min(0.5, 0.8) = -0.5   sum -2.7
#   answer 1: -min(-1, -1.6) = 1.6 (clipped);  -min(-3, -2.4) = 3.0                     sum  4.6
#   answer 2: -0.55;  -0.45;  -min(0.625, 0.6) = -0.6 (clipped);  -0.5                   sum -2.1
# total sum -0.2 over 9 tokens.

RHO = [[1.0, 1.5, 0.5, 1.0], [0.5, 1.5, 1.0, 1.0], [1.1, 0.9, 1.25, 1.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
ADV = [1.0, -2.0, 0.5]
# gradient of the un-normalised sum wrt logp: -A * rho where not clipped (d rho / d logp = rho), else 0
SUM_GRAD = [[-1.0, 0.0, -0.5, 0.0], [0.0, 3.0, 0.0, 0.0], [-0.55, -0.45, 0.0, -0.5]]


def _batch(padding_garbage: bool = True):
    mask = torch.tensor(MASK)
    old = torch.full((3, 4), math.log(0.5), dtype=F64)
    logp = (0.5 * torch.tensor(RHO, dtype=F64)).log()
    if padding_garbage:  # what sits under the padding must not matter
        logp = torch.where(mask.bool(), logp, torch.tensor(-1e4, dtype=F64))
        old = torch.where(mask.bool(), old, torch.tensor(-1e9, dtype=F64))
    return logp.requires_grad_(), old, torch.tensor(ADV, dtype=F64), mask


@pytest.mark.parametrize(
    ("loss_type", "kwargs", "normaliser", "expected"),
    [
        # grpo: per-answer means -2.7/3 = -0.9, 4.6/2 = 2.3, -2.1/4 = -0.525 -> mean 0.875/3
        ("grpo", {}, None, 0.875 / 3),
        ("bnpo", {}, 9.0, -0.2 / 9),
        ("dr_grpo", {"max_completion_length": 4}, 12.0, -0.2 / 12),  # N * L = 3 * 4
        ("dr_grpo", {"max_completion_length": 10}, 30.0, -0.2 / 30),
        ("dapo", {}, 9.0, -0.2 / 9),  # no num_items_in_batch: the micro-batch's 9 tokens
        ("dapo", {"num_items_in_batch": 36}, 36.0, -0.2 / 36),  # whole generation batch: 36 tokens
        ("dapo", {"num_items_in_batch": torch.tensor(36)}, 36.0, -0.2 / 36),
    ],
)
def test_hand_derived_loss_and_gradient(loss_type, kwargs, normaliser, expected):
    logp, old, adv, mask = _batch()
    spec = LossSpec(loss_type=loss_type, max_completion_length=kwargs.get("max_completion_length"))
    loss, _ = policy_loss(logp, old, adv, mask, spec,
                          accumulation=Accumulation(num_items_in_batch=kwargs.get("num_items_in_batch")))
    assert abs(loss.item() - expected) < 1e-12
    loss.backward()
    sum_grad = torch.tensor(SUM_GRAD, dtype=F64)
    if normaliser is None:  # grpo: token t of answer i weighs 1 / (N * L_i)
        lengths = torch.tensor(MASK, dtype=F64).sum(1, keepdim=True)
        expected_grad = sum_grad / (3 * lengths)
    else:
        expected_grad = sum_grad / normaliser
    torch.testing.assert_close(logp.grad, expected_grad, atol=1e-12, rtol=0)


def test_clipping_zeroes_the_gradient_on_both_sides_only_where_it_binds():
    logp, old, adv, mask = _batch()
    loss, _ = policy_loss(logp, old, adv, mask, LossSpec(loss_type="bnpo"))
    loss.backward()
    g = logp.grad
    assert g[0, 1] == 0.0  # A > 0, rho 1.5 > 1.2: clipped high
    assert g[2, 2] == 0.0  # A > 0, rho 1.25 > 1.2: clipped high
    assert g[1, 0] == 0.0  # A < 0, rho 0.5 < 0.8: clipped low
    assert g[0, 2] < 0.0  # A > 0, rho 0.5 < 0.8: NOT clipped (pessimistic bound keeps it)
    assert g[1, 1] > 0.0  # A < 0, rho 1.5 > 1.2: NOT clipped
    assert torch.all(g[~mask.bool()] == 0.0)  # padding


def test_asymmetric_clipping_epsilon_high():
    # epsilon_high 0.3: clip range [0.8, 1.3]. Answer 2's rho 1.25 is no longer clipped: -0.625 (was -0.6);
    # answer 0's 1.5 is clipped at 1.3: -1.3 (was -1.2); answer 1's low side is unchanged (1.6, 3.0).
    # sum -0.2 - 0.025 - 0.1 = -0.325 over 9 tokens
    logp, old, adv, mask = _batch()
    loss, stats = policy_loss(logp, old, adv, mask, LossSpec(epsilon_high=0.3, loss_type="bnpo"))
    assert abs(loss.item() + 0.325 / 9) < 1e-12
    assert abs(stats["clip_ratio/high_mean"].item() - 1 / 9) < 1e-12  # only answer 0's 1.5


def test_clip_stats_hand_derived():
    # low: rho < 0.8 and A < 0 -> answer 1 token 0 (answer 0's 0.5 has A > 0)    1 of 9
    # high: rho > 1.2 and A > 0 -> answer 0 token 1 (1.5), answer 2 token 2 (1.25) 2 of 9
    logp, old, adv, mask = _batch()
    _, stats = policy_loss(logp, old, adv, mask)
    assert set(stats) == {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
    assert abs(stats["clip_ratio/low_mean"].item() - 1 / 9) < 1e-12
    assert abs(stats["clip_ratio/high_mean"].item() - 2 / 9) < 1e-12
    assert abs(stats["clip_ratio/region_mean"].item() - 3 / 9) < 1e-12
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())


@pytest.mark.parametrize(
    ("adv", "low", "high"),
    [
        # rho = 0.5, 0.6, 1.5, 1.0 (4 tokens), epsilon 0.2
        (-1.0, 2 / 4, 0.0),  # A < 0: only the low side counts (0.5 and 0.6 < 0.8)
        (+1.0, 0.0, 1 / 4),  # A > 0: only the high side counts (1.5 > 1.2)
        (0.0, 0.0, 0.0),  # A = 0: nothing is clipped
    ],
)
def test_clip_stats_depend_on_the_sign_of_the_advantage(adv, low, high):
    old = torch.zeros(1, 4, dtype=F64)
    logp = torch.tensor([[0.5, 0.6, 1.5, 1.0]], dtype=F64).log()
    _, stats = policy_loss(logp, old, torch.tensor([adv], dtype=F64), torch.ones(1, 4))
    assert abs(stats["clip_ratio/low_mean"].item() - low) < 1e-12
    assert abs(stats["clip_ratio/high_mean"].item() - high) < 1e-12
    assert abs(stats["clip_ratio/region_mean"].item() - (low + high)) < 1e-12


def test_kl_hand_derived():
    # ref - logp = delta per completion token:
    #   answer 0: ln2, 0, -ln2;  answer 1: 0, ln2;  answer 2: 0, 0, 0, -ln2
    # k3 = e^d - d - 1: d = ln2 -> 1 - ln2; d = 0 -> 0; d = -ln2 -> ln2 - 0.5
    # sum KL = 2 (1 - ln2) + 2 (ln2 - 0.5) = 1  -> kl stat 1/9
    # dapo loss = (-0.2 + 0.04 * 1) / 9
    # d KL / d logp = 1 - e^d: d = ln2 -> -1, d = -ln2 -> +0.5, d = 0 -> 0
    logp, old, adv, mask = _batch()
    delta = torch.tensor([[LN2, 0, -LN2, 99.0], [0, LN2, 99.0, 99.0], [0, 0, 0, -LN2]], dtype=F64)
    ref = logp.detach() + delta  # 99 under padding: exp(99 + 1e4) would be inf if it leaked
    loss, stats = policy_loss(logp, old, adv, mask, LossSpec(beta=0.04), ref_logp=ref)
    assert abs(stats["kl"].item() - 1 / 9) < 1e-12
    assert abs(loss.item() - (-0.2 + 0.04) / 9) < 1e-12
    loss.backward()
    kl_grad = torch.tensor([[-1.0, 0, 0.5, 0], [0, -1.0, 0, 0], [0, 0, 0, 0.5]], dtype=F64)
    torch.testing.assert_close(logp.grad, (torch.tensor(SUM_GRAD, dtype=F64) + 0.04 * kl_grad) / 9, atol=1e-12, rtol=0)


def test_kl_is_absent_when_beta_is_zero_and_ref_is_ignored():
    logp, old, adv, mask = _batch()
    loss, stats = policy_loss(logp, old, adv, mask, LossSpec(beta=0.0), ref_logp=torch.zeros(3, 4, dtype=F64))
    assert "kl" not in stats
    assert abs(loss.item() + 0.2 / 9) < 1e-12


def test_cispo_hand_derived():
    # weight = sg(min(rho, 1.2)) (epsilon_high = 1.2 is the cap itself)
    # answer 0: 1.0 1.2 0.5; answer 1: 0.5 1.2; answer 2: 1.1 0.9 1.2 1.0
    # per-token loss -w * A * logp with logp = log(0.5 * rho); dapo normaliser 9 tokens
    logp, old, adv, mask = _batch()
    w = [[1.0, 1.2, 0.5], [0.5, 1.2], [1.1, 0.9, 1.2, 1.0]]
    total = sum(-w[i][t] * ADV[i] * math.log(0.5 * RHO[i][t]) for i in range(3) for t in range(len(w[i])))
    loss, _ = policy_loss(logp, old, adv, mask, LossSpec(loss_type="cispo", epsilon_high=1.2))  # the cap itself (TRL)
    assert abs(loss.item() - total / 9) < 1e-12
    loss.backward()
    # gradient -w * A / 9 everywhere, clipped tokens included (CISPO never drops a token's gradient)
    expected = torch.zeros(3, 4, dtype=F64)
    for i in range(3):
        for t in range(len(w[i])):
            expected[i, t] = -w[i][t] * ADV[i] / 9
    torch.testing.assert_close(logp.grad, expected, atol=1e-12, rtol=0)
    assert logp.grad[1, 0] != 0.0  # rho 0.5, A < 0: clipped for dapo, not for cispo


def test_gspo_sequence_level_hand_derived():
    # sequence ratio s_i = exp(mean_t log rho) = geometric mean of the answer's token ratios:
    #   s_0 = 0.75^(1/3), s_1 = 0.75^(1/2), s_2 = 1.2375^(1/4), all inside [0.8, 1.2]
    # every token of answer i has loss -s_i * A_i; grpo -> mean_i(-s_i A_i)
    # d loss / d logp_t = -A_i * s_i / (N * L_i)  (d s_i / d logp_t = s_i / L_i)
    logp, old, adv, mask = _batch()
    s = [0.75 ** (1 / 3), 0.75 ** 0.5, (1.1 * 0.9 * 1.25 * 1.0) ** 0.25]
    lengths = [3, 2, 4]
    loss, _ = policy_loss(logp, old, adv, mask, LossSpec(loss_type="grpo", importance_sampling_level="sequence"))
    assert abs(loss.item() - sum(-s[i] * ADV[i] for i in range(3)) / 3) < 1e-12
    loss.backward()
    expected = torch.zeros(3, 4, dtype=F64)
    for i in range(3):
        expected[i, : lengths[i]] = -ADV[i] * s[i] / (3 * lengths[i])
    torch.testing.assert_close(logp.grad, expected, atol=1e-12, rtol=0)


def test_gspo_clips_the_whole_sequence():
    # rho = 1.5, 1.5 -> s = 1.5 > 1.2 with A = +1: loss -1.2 per token, zero gradient, all tokens "high"
    old = torch.full((1, 2), math.log(0.5), dtype=F64)
    logp = torch.full((1, 2), math.log(0.75), dtype=F64, requires_grad=True)
    loss, stats = policy_loss(logp, old, torch.ones(1, dtype=F64), torch.ones(1, 2),
                              LossSpec(importance_sampling_level="sequence"))
    assert abs(loss.item() + 1.2) < 1e-12
    loss.backward()
    assert torch.all(logp.grad == 0.0)
    assert stats["clip_ratio/high_mean"].item() == 1.0


def test_on_policy_gradient_is_reinforce_with_group_baseline():
    # old_logp=None: rho == 1, nothing clipped; d loss / d logp_t = -A_i / normaliser with
    # A_i = (r_i - mean) / (std + eps) from seed 001's rewards 0.8 0.3 0.6 0.3
    rewards = torch.tensor([0.8, 0.3, 0.6, 0.3], dtype=F64)
    adv = group_advantages(rewards, 4)
    a_hand = torch.tensor([0.3, -0.2, 0.1, -0.2], dtype=F64) / (math.sqrt(0.045) + 1e-4)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    logp = torch.randn(4, 3, dtype=F64).requires_grad_()
    loss, stats = policy_loss(logp, None, adv, mask, LossSpec(loss_type="dapo"))
    loss.backward()
    expected = -a_hand[:, None] * mask / 9  # 9 completion tokens
    torch.testing.assert_close(logp.grad, expected, atol=1e-9, rtol=0)
    assert stats["clip_ratio/region_mean"].item() == 0.0
    # the loss value itself is -sum_i A_i L_i / 9 (ratio 1)
    lengths = mask.sum(1).to(F64)
    assert abs(loss.item() + (a_hand * lengths).sum().item() / 9) < 1e-9
    # grpo: -A_i / (N * L_i)
    logp.grad = None
    policy_loss(logp, None, adv, mask, LossSpec(loss_type="grpo"))[0].backward()
    torch.testing.assert_close(logp.grad, -a_hand[:, None] * mask / (4 * lengths[:, None]), atol=1e-9, rtol=0)


def test_zero_length_answer_counts_in_grpo_mean_and_gives_no_nan():
    logp = torch.zeros(2, 2, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0]])
    loss, stats = policy_loss(logp, None, torch.tensor([1.0, 5.0], dtype=F64), mask, LossSpec(loss_type="grpo"))
    assert abs(loss.item() + 0.5) < 1e-12  # (-1 + 0) / 2
    loss.backward()
    assert not torch.isnan(logp.grad).any()


def test_inputs_not_modified():
    logp, old, adv, mask = _batch()
    ref = logp.detach() - 0.1
    before = [x.detach().clone() for x in (logp, old, adv, mask, ref)]
    for lt in ("grpo", "bnpo", "dapo", "cispo"):
        for level in ("token", "sequence"):
            policy_loss(logp, old, adv, mask, LossSpec(beta=0.1, loss_type=lt, importance_sampling_level=level),
                        ref_logp=ref)
    for b, a in zip(before, (logp, old, adv, mask, ref)):
        assert torch.equal(b, a.detach())


# ---------------------------------------------------------------- errors


def test_errors_name_argument_and_expected_shape():
    logp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match=r"old_logp must have shape \[N, T\] = \(3, 4\)"):
        policy_loss(logp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match=r"mask must have shape \[N, T\] = \(3, 4\)"):
        policy_loss(logp, old, adv, mask.T)
    with pytest.raises(ValueError, match=r"advantages must have shape \[N\] = \(3,\)"):
        policy_loss(logp, old, adv[:2], mask)
    with pytest.raises(ValueError, match=r"logp must have shape \[N, T\]"):
        policy_loss(logp[0], old[0], adv, mask[0])
    with pytest.raises(ValueError, match=r"ref_logp must have shape"):
        policy_loss(logp, old, adv, mask, LossSpec(beta=0.1), ref_logp=old[:1])


def test_error_unknown_loss_type_lists_choices():
    logp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match=r"loss_type must be one of \['bnpo', 'cispo', 'dapo', 'dr_grpo', 'grpo', "
                                         r"'luspo', 'sapo', 'vespo'\]"):
        policy_loss(logp, old, adv, mask, LossSpec(loss_type="ppo"))


def test_error_unknown_importance_sampling_level_lists_choices():
    logp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match=r"importance_sampling_level must be one of \['sequence', 'token'\]"):
        policy_loss(logp, old, adv, mask, LossSpec(importance_sampling_level="answer"))


def test_error_beta_without_ref_and_dr_grpo_without_length():
    logp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="needs ref_logp"):
        policy_loss(logp, old, adv, mask, LossSpec(beta=0.04))
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logp, old, adv, mask, LossSpec(loss_type="dr_grpo"))


def test_the_earlier_accumulation_keywords_still_work_with_a_deprecation_warning():
    logp, old, adv, mask = _batch()
    now, _ = policy_loss(logp, old, adv, mask, accumulation=Accumulation(num_items_in_batch=36, entropy_parts=2))
    with pytest.warns(DeprecationWarning, match=r"pass accumulation=Accumulation\(num_items_in_batch=36, entropy_"):
        before, _ = policy_loss(logp, old, adv, mask, num_items_in_batch=36, entropy_parts=2)
    assert before.item() == now.item()
    with pytest.raises(TypeError, match=r"pass accumulation=Accumulation\(entropy_parts=2\) alone"):
        policy_loss(logp, old, adv, mask, accumulation=Accumulation(), entropy_parts=2)


# ---------------------------------------------------------------- chunked log-probabilities

V = 32000


def _full(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    logsm = torch.log_softmax(logits.float() / temperature, dim=-1)  # the plain [N, T, V] way
    logp = logsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return logp, -(logsm.exp() * logsm).sum(-1)


@pytest.mark.parametrize("chunk_size", [7, 48, 5000])
def test_token_logprobs_equals_full_log_softmax_with_grads(chunk_size):
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(2, 24, V, generator=gen)).requires_grad_()
    ids = torch.randint(0, V, (2, 24), generator=gen)
    w1, w2 = torch.randn(2, 24, generator=gen), torch.randn(2, 24, generator=gen)
    before = logits.detach().clone()
    logp, ent = token_logprobs(logits, ids, temperature=0.7, chunk_size=chunk_size, with_entropy=True)
    assert logp.shape == ent.shape == (2, 24)
    (g,) = torch.autograd.grad((logp * w1).sum() + (ent * w2).sum(), logits)
    ref_logp, ref_ent = _full(logits, ids, 0.7)
    (g_ref,) = torch.autograd.grad((ref_logp * w1).sum() + (ref_ent * w2).sum(), logits)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(g, g_ref, atol=1e-7, rtol=1e-5)
    assert torch.equal(logits.detach(), before)
    assert not torch.equal(logp, _full(logits, ids, 1.0)[0])  # temperature is applied


def test_token_logprobs_without_entropy_returns_a_tensor_and_upcasts_bf16():
    logits = torch.randn(2, 5, 50).to(torch.bfloat16)
    ids = torch.randint(0, 50, (2, 5))
    logp = token_logprobs(logits, ids, chunk_size=3)
    assert isinstance(logp, torch.Tensor) and logp.dtype == torch.float32
    torch.testing.assert_close(logp, _full(logits, ids, 1.0)[0])


def test_entropy_with_masked_vocab_is_finite():
    logits = torch.randn(1, 4, 10)
    logits[..., 5:] = float("-inf")
    logits.requires_grad_()
    logp, ent = token_logprobs(logits, torch.zeros(1, 4, dtype=torch.long), with_entropy=True)
    ent.sum().backward()
    assert torch.isfinite(ent).all() and torch.isfinite(logits.grad).all()


def _new_saved_bytes(fn, *exclude: torch.Tensor) -> int:
    """Bytes autograd saves for backward outside of tensors we already hold."""
    held = {x.untyped_storage().data_ptr() for x in exclude}
    seen: dict[int, int] = {}

    def pack(x):
        ptr = x.untyped_storage().data_ptr()
        if ptr not in held:
            seen[ptr] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(seen.values())


def test_token_logprobs_does_not_keep_a_full_log_softmax_for_backward():
    logits = torch.randn(2, 24, V, requires_grad=True)
    ids = torch.randint(0, V, (2, 24))
    full_bytes = 2 * 24 * V * 4
    saved = _new_saved_bytes(lambda: token_logprobs(logits, ids, chunk_size=8, with_entropy=True), logits)
    assert saved < full_bytes / 10
    # the plain way keeps at least the full log-softmax
    assert _new_saved_bytes(lambda: _full(logits, ids, 1.0), logits) >= full_bytes


class _RecordingHead(torch.nn.Linear):
    def forward(self, x):
        out = super().forward(x)
        self.max_rows = max(getattr(self, "max_rows", 0), out.shape[0])
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_logprobs_from_hidden_equals_full_with_grads(dtype):
    gen = torch.Generator().manual_seed(2)
    head = _RecordingHead(16, V, bias=True).to(dtype)
    hidden = torch.randn(2, 24, 16, generator=gen, dtype=dtype).requires_grad_()
    ids = torch.randint(0, V, (2, 24), generator=gen)
    w1, w2 = torch.randn(2, 24, generator=gen, dtype=dtype), torch.randn(2, 24, generator=gen, dtype=dtype)
    before = hidden.detach().clone()
    out = {}

    def run():
        out["lp"], out["ent"] = token_logprobs_from_hidden(hidden, head, ids, temperature=1.3, chunk_size=10,
                                                           with_entropy=True)

    saved = _new_saved_bytes(run, hidden, head.weight, head.bias)
    assert saved < 2 * 24 * V * 4 / 10  # backward recomputes each chunk's logits
    assert head.max_rows <= 10  # never more than chunk_size rows of logits at once
    logp, ent = out["lp"], out["ent"]
    params = (hidden, head.weight, head.bias)
    grads = torch.autograd.grad((logp * w1).sum() + (ent * w2).sum(), params)
    logsm = torch.log_softmax(torch.nn.functional.linear(hidden, head.weight, head.bias) / 1.3, dim=-1)
    ref_logp = logsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logsm.exp() * logsm).sum(-1)
    ref_grads = torch.autograd.grad((ref_logp * w1).sum() + (ref_ent * w2).sum(), params)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-10, "rtol": 1e-10}
    torch.testing.assert_close(logp, ref_logp, **tol)
    torch.testing.assert_close(ent, ref_ent, **tol)
    for g, g_ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, g_ref, **tol)
    assert torch.equal(hidden.detach(), before)


def test_token_logprobs_from_hidden_without_entropy_returns_none():
    head = torch.nn.Linear(4, 11, bias=False)
    logp, ent = token_logprobs_from_hidden(torch.randn(3, 2, 4), head, torch.zeros(3, 2, dtype=torch.long))
    assert ent is None and logp.shape == (3, 2)


def test_logprob_argument_errors():
    with pytest.raises(ValueError, match=r"token_ids must have shape \[N, T\] = \(2, 3\)"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match=r"hidden must have shape \[N, T, H\]"):
        token_logprobs_from_hidden(torch.zeros(2, 3), torch.nn.Linear(3, 5), torch.zeros(2, 3, dtype=torch.long))


# ---------------------------------------------------------------- dependency direction


@pytest.mark.parametrize("module", ["advantages", "objectives", "logprobs", "fused_logprobs"])
def test_pure_modules_import_only_torch_and_stdlib(module):
    # The pure math (grpokit/algorithms) imports only torch and itself (never transformers or trl), and of the
    # config only its torch-free lists of the variants' names (config/variants.py).
    import ast
    import importlib
    import sys

    path = importlib.import_module(f"grpokit.algorithms.{module}").__file__
    tree = ast.parse(open(path, encoding="utf-8").read())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module if node.module.startswith("grpokit.") else node.module.split(".")[0])
    allowed = {"torch", "__future__"} | set(sys.stdlib_module_names)
    allowed |= {"grpokit.config.variants", "grpokit.errors"}  # torch-free names; errors imports nothing at load
    assert all(r in allowed or r.startswith("grpokit.algorithms.") for r in roots), roots


@pytest.mark.parametrize("chunk_size", [10, 50])
def test_chunked_logprobs_of_non_contiguous_slices(chunk_size):
    # logits[:, 1:] of a longer sequence cannot be viewed as [N*T, V]: chunks become whole sequences
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(3, 9, 300, generator=gen, dtype=F64, requires_grad=True)
    logits = full[:, 1:]  # [3, 8, 300], not viewable as [24, 300]
    ids = torch.randint(0, 300, (3, 9), generator=gen)[:, 1:]
    w = torch.randn(3, 8, generator=gen, dtype=F64)
    logp, ent = token_logprobs(logits, ids, temperature=0.9, chunk_size=chunk_size, with_entropy=True)
    (g,) = torch.autograd.grad((logp * w).sum() + ent.sum(), full)
    logsm = torch.log_softmax(logits / 0.9, -1)
    ref_logp, ref_ent = logsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1), -(logsm.exp() * logsm).sum(-1)
    (g_ref,) = torch.autograd.grad((ref_logp * w).sum() + ref_ent.sum(), full)
    torch.testing.assert_close(logp, ref_logp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=1e-12)
    head = _RecordingHead(4, 300).to(F64)
    hidden = torch.randn(3, 9, 4, generator=gen, dtype=F64)[:, 1:]
    h_logp, _ = token_logprobs_from_hidden(hidden, head, ids, chunk_size=chunk_size)
    assert head.max_rows <= max(chunk_size, 8)  # whole sequences of T = 8 rows, as many as fit in a chunk
    ref = torch.log_softmax(head(hidden), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(h_logp, ref, atol=1e-12, rtol=1e-12)


def test_chunked_logprobs_of_empty_batch():
    assert token_logprobs(torch.zeros(0, 3, 7), torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3)
    logp, ent = token_logprobs(torch.zeros(2, 0, 7), torch.zeros(2, 0, dtype=torch.long), with_entropy=True)
    assert logp.shape == ent.shape == (2, 0)


def test_the_loss_options_as_keywords_still_work_with_a_warning_naming_loss_spec():
    """`grpokit.policy_loss(logp, old, A, mask, loss_type="grpo")`, the README's form before `LossSpec`: it raised a
    bare TypeError (an unexpected keyword); now the same loss, and a DeprecationWarning showing the spelling."""
    logp, old, adv, mask = _batch()
    now, _ = policy_loss(logp, old, adv, mask, LossSpec(loss_type="grpo", epsilon=0.1))
    with pytest.warns(DeprecationWarning, match=r"pass spec=LossSpec\(loss_type='grpo', epsilon=0.1\) \(from grpokit"):
        before, _ = policy_loss(logp, old, adv, mask, loss_type="grpo", epsilon=0.1)
    assert before.item() == now.item()
    with pytest.raises(TypeError, match=r"pass spec=LossSpec\(beta=0.1\) alone"):
        policy_loss(logp, old, adv, mask, spec=LossSpec(), beta=0.1)
    with pytest.raises(TypeError, match=r"pass spec=LossSpec\(beta=0.1\) alone"):  # the spec given by position
        policy_loss(logp, old, adv, mask, LossSpec(), beta=0.1)
