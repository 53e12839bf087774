"""grpokit's loss, gradient, stats and advantages against TRL 1.16's own GRPOTrainer code.

We call ``GRPOTrainer._compute_loss`` itself on a stand-in ``self`` that carries only
the attributes it reads, with ``_get_per_token_logps_and_entropies`` returning our
log-prob tensor, so TRL's formula is executed, not retyped.

Conventions set equal on purpose (each a documented difference, not a bug):
- ``args.use_bias_correction_kl=False`` (TRL's option multiplies KL_t by the ratio; it is on by
  default in TRL and ``algorithm.kl_bias_correction``, off by default, in grpokit: its parity with
  TRL is tested in test_estimators.py::test_kl_bias_correction_matches_trl).
- one process, ``current_gradient_accumulation_steps == steps_per_generation``:
  TRL's dapo/cispo then divides by ``num_items_in_batch`` exactly as grpokit does
  (TRL: num_items_in_batch / num_processes * grad_accum / steps_per_generation), and
  its grpo/bnpo/dr_grpo divide by grad_accum = 1.
- CISPO: both cap the ratio at ``epsilon_high`` itself (ScaleRL's eps_max); the tests give
  cispo a cap above 1 (1 + EPS_HIGH), as a real run would.
- GSPO clip metrics: TRL averages over sequences, grpokit over tokens (the sequence
  ratio broadcast), so clip stats are compared at token level only.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

from grpokit.algorithms.advantages import group_advantages  # noqa: E402
from grpokit.algorithms.objectives import Accumulation, LossSpec, policy_loss  # noqa: E402

F64 = torch.float64
EPS, EPS_HIGH, MAX_LEN = 0.2, 0.28, 7


def _fake_trainer(loss_type: str, level: str, beta: float, logp: torch.Tensor, grad_accum: int = 1):
    epsilon_high = 1.0 + EPS_HIGH if loss_type == "cispo" else EPS_HIGH
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0,
        aux_loss_enabled=False,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=grad_accum),
        loss_type=loss_type,
        epsilon_low=EPS,
        epsilon_high=epsilon_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum,
        max_completion_length=MAX_LEN,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x),
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )


def _random_batch(seed: int, on_policy: bool):
    gen = torch.Generator().manual_seed(seed)
    n, t = 6, MAX_LEN
    lengths = torch.tensor([7, 3, 1, 5, 0, 6])  # unequal, one answer with no token at all
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # [N, T]
    logp = torch.log_softmax(torch.randn(n, t, 5, generator=gen, dtype=F64), -1)[..., 0]  # [N, T], < 0
    old = None if on_policy else logp + 0.3 * torch.randn(n, t, generator=gen, dtype=F64)  # ratios ~ e^(+-0.3)
    ref = logp + 0.2 * torch.randn(n, t, generator=gen, dtype=F64)
    adv = torch.randn(n, generator=gen, dtype=F64)
    return logp, old, ref, adv, mask


def trl_compute_loss(fake, adv, mask, old, ref, num_items):
    """TRL's own `GRPOTrainer._compute_loss` on our tensors (the prompt and token ids are dummies: the
    fake trainer returns the log-probs under test); `old` / `ref` None = on-policy / no KL term."""
    n, t = mask.shape
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros(n, t, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "num_items_in_batch": num_items}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return grpo_trainer.GRPOTrainer._compute_loss(fake, None, inputs)


CASES = [
    (lt, level, beta, on_policy)
    for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
    for level in ("token", "sequence")
    for beta in (0.0, 0.04)
    for on_policy in (False, True)
]


@pytest.mark.parametrize(("loss_type", "level", "beta", "on_policy"), CASES)
def test_loss_gradient_and_stats_match_trl(loss_type, level, beta, on_policy):
    logp0, old, ref, adv, mask = _random_batch(seed=len(loss_type) + 10 * int(beta > 0), on_policy=on_policy)
    num_items = torch.tensor(40)  # the whole generation batch's tokens (this micro-batch has 22)

    trl_logp = logp0.clone().requires_grad_()
    fake = _fake_trainer(loss_type, level, beta, trl_logp)
    trl_loss = trl_compute_loss(fake, adv, mask, old, ref if beta else None, num_items)
    trl_loss.backward()

    logp = logp0.clone().requires_grad_()
    loss, stats = policy_loss(logp, old, adv, mask,
                              LossSpec(beta=beta, epsilon=EPS, epsilon_high=fake.epsilon_high, loss_type=loss_type,
                                       importance_sampling_level=level, max_completion_length=MAX_LEN),
                              ref_logp=ref if beta else None, accumulation=Accumulation(num_items))
    loss.backward()

    assert abs(loss.item() - trl_loss.item()) < 1e-6 * max(1.0, abs(trl_loss.item()))
    torch.testing.assert_close(logp.grad, trl_logp.grad, atol=1e-6, rtol=1e-6)
    assert logp.grad.abs().sum() > 0

    metrics = fake._metrics["train"]
    if beta:
        assert abs(stats["kl"].item() - metrics["kl"][0]) < 1e-6
    if level == "token" and loss_type != "cispo":
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert abs(stats[key].item() - metrics[key][0]) < 1e-6, key
    if level == "token" and loss_type == "cispo":
        assert abs(stats["clip_ratio/high_mean"].item() - metrics["cispo_clip_ratio"][0]) < 1e-6


def test_some_tokens_are_clipped_in_the_parity_batch():
    # guard: the parity cases above exercise clipping on both sides, not just the identity region
    logp, old, _, adv, mask = _random_batch(seed=4, on_policy=False)
    _, stats = policy_loss(logp, old, adv, mask, LossSpec(epsilon=EPS, epsilon_high=EPS_HIGH))
    assert stats["clip_ratio/low_mean"] > 0 and stats["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("grad_accum", [1, 4])
def test_dapo_scale_matches_trl_under_gradient_accumulation(grad_accum):
    # TRL: normaliser = num_items_in_batch / num_processes * grad_accum / steps_per_generation; with
    # steps_per_generation == grad_accum this is num_items_in_batch, whatever the accumulation.
    logp0, old, _, adv, mask = _random_batch(seed=3, on_policy=False)
    trl_logp = logp0.clone().requires_grad_()
    fake = _fake_trainer("dapo", "token", 0.0, trl_logp, grad_accum=grad_accum)
    inputs = {
        "prompt_ids": torch.zeros(6, 1, dtype=torch.long), "prompt_mask": torch.ones(6, 1, dtype=torch.long),
        "completion_ids": torch.zeros(6, MAX_LEN, dtype=torch.long), "completion_mask": mask,
        "advantages": adv, "num_items_in_batch": torch.tensor(88), "old_per_token_logps": old,
    }
    trl_loss = grpo_trainer.GRPOTrainer._compute_loss(fake, None, inputs)
    loss, _ = policy_loss(logp0, old, adv, mask, LossSpec(epsilon=EPS, epsilon_high=EPS_HIGH),
                          accumulation=Accumulation(num_items_in_batch=88))
    assert abs(loss.item() - trl_loss.item()) < 1e-9


# ---------------------------------------------------------------- advantages


def _trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """TRL 1.16 grpo_trainer.py lines 2764-2787 and 2806 (multi_objective_aggregation="sum_then_normalize").

    That code sits inside ``_generate_and_score_completions`` and is not reachable as a
    function; this is its arithmetic line for line, with TRL's own ``nanstd``.
    """
    nanstd = trl_utils.nanstd
    mean_grouped = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    else:  # "batch"
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_sample_std_advantages_match_trl(scale_rewards):
    gen = torch.Generator().manual_seed(7)
    rewards = torch.rand(5 * 4, generator=gen, dtype=F64)
    rewards[4:8] = 0.25  # a zero-std group
    rewards[9] = math.nan  # an unscorable answer (every reward function returned None)
    rewards[12:15] = math.nan  # a group with a single valid reward
    ours = group_advantages(rewards, 4, scale_rewards=scale_rewards, std="sample")
    theirs = _trl_advantages(rewards, 4, scale_rewards)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert ours[:4].abs().sum() > 0


def test_trl_nanstd_is_the_sample_std():
    # Why std="sample" is TRL's convention: nanstd applies Bessel's correction (trl/trainer/utils.py).
    # (Only to ~1e-8 in float64: TRL's Bessel factor count / (count - 1) is computed in float32.)
    r = torch.tensor([0.8, 0.3, 0.6, 0.3], dtype=F64)
    assert abs(trl_utils.nanstd(r).item() - math.sqrt(0.06)) < 1e-7
    assert abs(trl_utils.nanstd(r).item() - math.sqrt(0.045)) > 1e-2  # not the population std
