"""The second round of variants against TRL 1.16's own code, in float64 within 1e-6: the loss types sapo,
luspo and vespo, two-sided clipping (delta), the off-policy sequence mask, the sampler-trainer mismatch
correction (its four modes) and the adaptive entropy coefficient.

As in test_trl_parity.py, ``GRPOTrainer._compute_loss`` runs on a stand-in ``self`` carrying only what it
reads; TRL's static helpers (``get_off_policy_mask``, ``get_gamma_weights``) are TRL's own. The
importance-sampling ratios are computed inside ``_generate_and_score_completions``, which is not callable
alone: ``_trl_is_ratio`` retypes those lines (grpo_trainer.py 2660-2706) one for one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")

from grpokit.algorithms.mismatch import importance_correction  # noqa: E402
from grpokit.algorithms.objectives import Accumulation, LossSpec, adapt_entropy_coef, policy_loss  # noqa: E402

F64 = torch.float64
EPS, EPS_HIGH, MAX_LEN = 0.2, 0.28, 7
Trainer = grpo_trainer.GRPOTrainer


def _fake(loss_type, level, beta, logp, *, delta=None, threshold=None, use_is=False, ent=None, adaptive=None,
          grad_accum=1):
    args = SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=grad_accum,
                           sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
                           vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, **(adaptive or {}))
    ent = torch.zeros_like(logp) if ent is None else ent
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, ent, None),
        top_entropy_quantile=1.0, aux_loss_enabled=False, off_policy_mask_threshold=threshold,
        importance_sampling_level=level, beta=beta, args=args, loss_type=loss_type, epsilon_low=EPS,
        epsilon_high=1.0 + EPS_HIGH if loss_type == "cispo" else EPS_HIGH,
        use_vllm=use_is, vllm_importance_sampling_correction=use_is, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum, max_completion_length=MAX_LEN,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x,
                                    sync_gradients=True),
        _entropy_bonus_enabled=adaptive is not None, entropy_coef=(adaptive or {}).get("entropy_coef", 0.0),
        use_adaptive_entropy=adaptive is not None, _last_world_entropy=float("inf"), _entropy_window_stats=None,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        get_off_policy_mask=Trainer.get_off_policy_mask, get_gamma_weights=Trainer.get_gamma_weights,
    )
    return fake


def _trl_loss(fake, adv, mask, old, ref, num_items, *, sampling=None, is_ratio=None):
    n, t = mask.shape
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros(n, t, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "num_items_in_batch": num_items}
    for key, value in (("old_per_token_logps", old), ("ref_per_token_logps", ref),
                       ("sampling_per_token_logps", sampling), ("importance_sampling_ratio", is_ratio)):
        if value is not None:
            inputs[key] = value
    return Trainer._compute_loss(fake, None, inputs)


def _batch(seed, on_policy=False, spread=0.3):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 1, 5, 0, 6])  # unequal, one answer with no token at all
    mask = (torch.arange(MAX_LEN)[None, :] < lengths[:, None]).long()  # [6, 7]
    logp = torch.log_softmax(torch.randn(6, MAX_LEN, 5, generator=gen, dtype=F64), -1)[..., 0]  # [6, 7]
    old = None if on_policy else logp + spread * torch.randn(6, MAX_LEN, generator=gen, dtype=F64)
    ref = logp + 0.2 * torch.randn(6, MAX_LEN, generator=gen, dtype=F64)
    sampling = logp + 0.5 * torch.randn(6, MAX_LEN, generator=gen, dtype=F64)  # the sampler's own log-probs
    adv = torch.randn(6, generator=gen, dtype=F64)
    return logp, old, ref, sampling, adv, mask


def _compare(loss_type, level, beta, on_policy, *, seed=0, delta=None, threshold=None, is_mode=None, spread=0.3,
             **ours):
    logp0, old, ref, sampling, adv, mask = _batch(seed, on_policy, spread)
    num_items = torch.tensor(40)
    is_ratio = None
    if is_mode is not None:
        trainer_logp = old if old is not None else logp0
        is_ratio = _trl_is_ratio(trainer_logp, sampling, mask, is_mode, 2.0, 0.5)
    trl_logp = logp0.clone().requires_grad_()
    fake = _fake(loss_type, level, beta, trl_logp, delta=delta, threshold=threshold, use_is=is_ratio is not None)
    trl = _trl_loss(fake, adv, mask, old, ref if beta else None, num_items,
                    sampling=sampling if threshold is not None else None, is_ratio=is_ratio)
    trl.backward()
    logp = logp0.clone().requires_grad_()
    weights = None
    if is_mode is not None:
        weights, _ = importance_correction(old if old is not None else logp0, sampling, mask, is_mode, cap_max=2.0,
                                           cap_min=0.5)
    loss, stats = policy_loss(logp, old, adv, mask,
                              LossSpec(beta=beta, epsilon=EPS, epsilon_high=fake.epsilon_high, loss_type=loss_type,
                                       importance_sampling_level=level, max_completion_length=MAX_LEN, delta=delta,
                                       off_policy_mask_threshold=threshold),
                              ref_logp=ref if beta else None, accumulation=Accumulation(num_items),
                              sampling_logp=sampling if threshold is not None else None, token_weights=weights, **ours)
    loss.backward()
    assert abs(loss.item() - trl.item()) < 1e-6 * max(1.0, abs(trl.item())), (loss.item(), trl.item())
    torch.testing.assert_close(logp.grad, trl_logp.grad, atol=1e-6, rtol=1e-6)
    assert logp.grad.abs().sum() > 0
    metrics = fake._metrics["train"]
    if beta:
        assert abs(stats["kl"].item() - metrics["kl"][0]) < 1e-6
    if loss_type == "vespo":
        assert abs(stats["vespo/phi_seq_mean"].item() - metrics["vespo/phi_seq_mean"][0]) < 1e-6
    if level == "token" and loss_type == "luspo":
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert abs(stats[key].item() - metrics[key][0]) < 1e-6, key
    return loss, stats


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["sapo", "luspo", "vespo"])
def test_new_loss_types_match_trl(loss_type, level, beta, on_policy):
    _compare(loss_type, level, beta, on_policy, seed=len(loss_type) + 10 * int(beta > 0))


def test_the_sapo_gate_is_not_the_identity_in_the_parity_batch():
    # guard: ratios far from 1, so the soft gate differs from a plain policy gradient
    logp, old, _, _, adv, mask = _batch(4)
    sapo, _ = policy_loss(logp, old, adv, mask, LossSpec(loss_type="sapo"))
    plain, _ = policy_loss(logp, old, adv, mask, LossSpec(loss_type="grpo", epsilon=0.99, epsilon_high=100.0))
    assert abs(sapo.item() - plain.item()) > 1e-3


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_two_sided_clipping_matches_trl(loss_type, level):
    loss, _ = _compare(loss_type, level, 0.0, False, seed=5, delta=1.5, spread=0.8)
    plain, _ = _compare(loss_type, level, 0.0, False, seed=5, spread=0.8)
    if level == "token":
        assert abs(loss.item() - plain.item()) > 1e-6  # some negative-advantage token had a ratio above delta


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_off_policy_mask_matches_trl(loss_type, beta):
    loss, stats = _compare(loss_type, "token", beta, False, seed=6, threshold=0.02)
    assert 0 < stats["off_policy/masked_share"].item() < 1  # some answers dropped, not all


def test_off_policy_mask_falls_back_to_the_old_logprobs_as_trl():
    # without the sampler's log-probs TRL measures the drift from old_per_token_logps; so does grpokit
    logp0, old, _, _, adv, mask = _batch(7, spread=0.8)
    trl_logp = logp0.clone().requires_grad_()
    fake = _fake("dapo", "token", 0.0, trl_logp, threshold=0.1)
    trl = _trl_loss(fake, adv, mask, old, None, torch.tensor(40))
    loss, stats = policy_loss(logp0, old, adv, mask,
                              LossSpec(epsilon=EPS, epsilon_high=EPS_HIGH, off_policy_mask_threshold=0.1),
                              accumulation=Accumulation(num_items_in_batch=40))
    assert abs(loss.item() - trl.item()) < 1e-9 and stats["off_policy/masked_share"].item() > 0


# ---------------------------------------------------------------- mismatch correction


def _trl_is_ratio(old_per_token_logps, sampling_per_token_logps, completion_mask, mode, clip_max, clip_min):
    """TRL 1.16 grpo_trainer.py 2660-2706 (`vllm_importance_sampling_correction`), line for line."""
    mask = completion_mask
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
        logps_diff = per_sequence_logps_diff
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio


MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bounds", [(2.0, 0.5), (1.5, None), (None, 0.5)])
def test_mismatch_weights_match_trl(mode, bounds):
    cap_max, cap_min = bounds
    logp, _, _, sampling, _, mask = _batch(8)
    theirs = _trl_is_ratio(logp, sampling, mask, mode, cap_max, cap_min)
    ours, stats = importance_correction(logp, sampling, mask, mode, cap_max=cap_max, cap_min=cap_min)
    valid = mask.bool() if mode.startswith("token") else torch.ones_like(theirs, dtype=torch.bool)
    torch.testing.assert_close(ours[valid], theirs[valid], atol=1e-12, rtol=1e-12)  # padding: TRL 1, ours 1
    flat = theirs[valid]
    assert stats["sampling/is_ratio_mean"] == pytest.approx(flat.mean().item(), abs=1e-9)
    assert (stats["sampling/is_ratio_min"], stats["sampling/is_ratio_max"]) == (
        pytest.approx(flat.min().item()), pytest.approx(flat.max().item()))
    share = [v for k, v in stats.items() if k.endswith("_share")][0]
    assert 0 < share < 1  # the batch has ratios on both sides of the bounds


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "luspo"])
def test_mismatch_correction_in_the_loss_matches_trl(loss_type, mode):
    _compare(loss_type, "token", 0.04, False, seed=9, is_mode=mode)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_vespo_folds_the_correction_into_its_weight_as_trl(mode):
    _compare("vespo", "token", 0.0, False, seed=10, is_mode=mode)


# ---------------------------------------------------------------- adaptive entropy


def test_adaptive_entropy_controller_matches_trl_over_several_steps():
    # TRL's _compute_loss updates its coefficient at each optimizer-step boundary from the step's token
    # entropy; grpokit's adapt_entropy_coef must give the same sequence (and apply 0 while entropy > target)
    knobs = dict(entropy_target=0.9, entropy_coef_min=0.0, entropy_coef_max=0.012, entropy_coef_delta=0.005)
    logp0, _, _, _, adv, mask = _batch(11, on_policy=True)
    gen = torch.Generator().manual_seed(12)
    fake = None
    coef, last = 0.002, float("inf")
    for step, level in enumerate((0.5, 0.7, 1.4, 0.3, 0.2)):  # mean entropies around the target 0.9
        ent = level * 2 * torch.rand(6, MAX_LEN, generator=gen, dtype=F64)
        logp = logp0.clone().requires_grad_()
        if fake is None:
            fake = _fake("bnpo", "token", 0.0, logp, ent=ent, adaptive={**knobs, "entropy_coef": coef})
        fake._get_per_token_logps_and_entropies = lambda *a, _l=logp, _e=ent, **k: (_l, _e, None)
        applied = coef if last <= knobs["entropy_target"] else 0.0
        trl = _trl_loss(fake, adv, mask, None, None, torch.tensor(22))
        ours, _ = policy_loss(logp0, None, adv, mask, LossSpec(loss_type="bnpo", entropy_coef=applied), entropy=ent)
        assert abs(ours.item() - trl.item()) < 1e-9, step  # the same coefficient was applied
        measured = float((ent * mask).sum() / mask.sum())
        coef, last = adapt_entropy_coef(coef, measured, target=0.9, delta=0.005, low=0.0, high=0.012), measured
        assert fake.entropy_coef == pytest.approx(coef, abs=1e-12) and fake._last_world_entropy == pytest.approx(last)
    assert fake._metrics["train"]["entropy_coef"][-1] == pytest.approx(coef)
