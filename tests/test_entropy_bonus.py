"""The entropy bonus aggregated as TRL 1.16 aggregates it (`entropy_aggregation="token_mean"`, the TRL drop-in's).

TRL's `_compute_loss` adds `- coef * sum(H * m') / sum(m') / gradient_accumulation_steps` after the loss type's
own aggregation, for every loss type: the plain token mean over the acting tokens m' (the mask, or the
high-entropy tokens), never rescaled by a policy normaliser. (a) Golden numbers by hand for each loss type;
(b) TRL's own `_compute_loss` on the same tensors for all eight loss types, with gradient accumulation and the
top-entropy mask; (c) the trainer's micro-batch wiring (`training/update.py`) against TRL's loss summed over one
accumulation window, on a tiny model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grpokit.algorithms import objectives
from grpokit.algorithms.objectives import LOSS_TYPES, Accumulation, LossSpec, mean_token_entropy, policy_loss
from grpokit.config import variants
from grpokit.config.schema import AlgorithmConfig

F64 = torch.float64
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ENT = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.6, math.nan]], dtype=F64)  # NaN at padding never reaches the loss
CAP = {"cispo": {"epsilon_high": 5.0}}  # cispo's cap on the importance weight (>= 1, as a real run's)


def _loss(loss_type, adv, *, entropy=ENT, aggregation="token_mean", **kw):
    logp = torch.full((2, 3), -1.0, dtype=F64, requires_grad=True)
    spec = {k: kw.pop(k) for k in ("top_entropy_quantile",) if k in kw}
    return policy_loss(logp, None, torch.tensor(adv, dtype=F64), MASK,
                       LossSpec(loss_type=loss_type, entropy_coef=0.1, entropy_aggregation=aggregation,
                                max_completion_length=4, **CAP.get(loss_type, {}), **spec), entropy=entropy,
                       accumulation=Accumulation(**kw))[0]


def test_the_names_are_the_configs():
    assert objectives.ENTROPY_AGGREGATIONS is variants.ENTROPY_AGGREGATIONS  # one tuple, the config's


@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_token_mean_is_the_same_bonus_for_every_loss_type(loss_type):
    # A = 0: no policy term, the loss is the bonus alone: -0.1 * (0.1 + 0.9 + 0.5 + 0.3 + 0.6) / 5 = -0.048
    ent = ENT.clone().requires_grad_()
    loss = _loss(loss_type, [0.0, 0.0], entropy=ent)
    assert abs(loss.item() + 0.048) < 1e-12
    loss.backward()
    expected = torch.tensor([[-0.02, -0.02, -0.02], [-0.02, -0.02, 0.0]], dtype=F64)  # -0.1 / 5 per valid token
    torch.testing.assert_close(ent.grad, expected, atol=1e-12, rtol=0)
    # split over 4 micro-batches that add up unscaled (dapo, cispo, vespo): each carries a quarter
    assert abs(_loss(loss_type, [0.0, 0.0], entropy_parts=4).item() + 0.012) < 1e-12


@pytest.mark.parametrize(("loss_type", "aggregated_like_the_loss"), [
    ("grpo", -0.1 * (1.5 / 3 + 0.9 / 2) / 2),  # per-answer means, then the mean
    ("dr_grpo", -0.1 * 2.4 / (2 * 4)),  # sum / (N * max_completion_length)
    ("luspo", -0.1 * (1.5 + 0.9) / 2),  # per-answer sums, then the mean
])
def test_grpokits_own_aggregation_differs_where_the_normaliser_does(loss_type, aggregated_like_the_loss):
    assert abs(_loss(loss_type, [0.0, 0.0], aggregation="loss").item() - aggregated_like_the_loss) < 1e-12
    assert abs(_loss(loss_type, [0.0, 0.0]).item() + 0.048) < 1e-12


@pytest.mark.parametrize(("loss_type", "kw", "expected"), [
    # on-policy, logp = -1, A = (2, 1): each token's clipped term is -A
    ("grpo", {}, -(2 + 1) / 2 - 0.048),  # answer means -2, -1
    ("bnpo", {}, -(2 * 3 + 1 * 2) / 5 - 0.048),
    ("dr_grpo", {}, -8 / (2 * 4) - 0.048),
    ("dapo", {"num_items_in_batch": 10, "entropy_parts": 2}, -8 / 10 - 0.048 / 2),  # one of two micro-batches
    ("luspo", {}, -(6 + 2) / 2 - 0.048),  # answer sums -6, -2
])
def test_the_bonus_adds_to_the_policy_term_outside_its_normaliser(loss_type, kw, expected):
    assert abs(_loss(loss_type, [2.0, 1.0], **kw).item() - expected) < 1e-12


def test_with_the_top_entropy_mask_the_mean_is_over_the_acting_tokens():
    # q = 0.4: the threshold is the 0.6 quantile of (0.1, 0.3, 0.5, 0.6, 0.9), 0.54: tokens 0.9 and 0.6 act
    assert abs(_loss("bnpo", [0.0, 0.0], top_entropy_quantile=0.4).item() + 0.1 * 0.75) < 1e-12
    # grpokit's own aggregation keeps bnpo's normaliser, the 5 tokens of the mask
    assert abs(_loss("bnpo", [0.0, 0.0], top_entropy_quantile=0.4, aggregation="loss").item() + 0.03) < 1e-12
    acting = torch.tensor([[0, 1, 0], [0, 1, 0]])
    assert abs(mean_token_entropy(ENT, acting).item() - 0.75) < 1e-12
    assert mean_token_entropy(ENT, torch.zeros(2, 3)).item() == 0.0  # no acting token: no bonus, no NaN


def test_bad_aggregation_arguments_are_refused():
    with pytest.raises(ValueError, match="entropy_aggregation must be one of"):
        _loss("dapo", [0.0, 0.0], aggregation="mean")
    with pytest.raises(ValueError, match="entropy_parts >= 1"):
        _loss("dapo", [0.0, 0.0], entropy_parts=0)


def test_the_config_field_checks_its_value():
    from grpokit.errors import ConfigError

    with pytest.raises(ConfigError, match="algorithm.entropy_aggregation"):
        AlgorithmConfig(entropy_coef=0.1, entropy_aggregation="mean")
    assert any(key == "entropy_aggregation" for key, _ in AlgorithmConfig(entropy_aggregation="token_mean").warnings)
    luspo = AlgorithmConfig(loss_type="luspo", importance_sampling_level="sequence", entropy_coef=0.1)
    assert "luspo_entropy" in dict(luspo.warnings)  # the bonus grows with the answer length
    token_mean = AlgorithmConfig(loss_type="luspo", importance_sampling_level="sequence", entropy_coef=0.1,
                                 entropy_aggregation="token_mean")
    assert "luspo_entropy" not in dict(token_mean.warnings) and not token_mean.warnings


# ---------------------------------------------------------------- TRL 1.16's own loss code

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
from test_trl_parity import trl_compute_loss  # noqa: E402  (TRL's _compute_loss on our tensors)

EPS, EPS_HIGH, MAX_LEN = 0.2, 0.28, 7
SAPO_NEG = 1.25  # exact in float32: TRL's torch.where(..., 1.05) makes SAPO's temperatures float32 tensors


def _fake_trl(loss_type, logp, ent, *, quantile=1.0, coef=0.05, grad_accum=1, beta=0.0, eps_high=None):
    """A stand-in `self` for TRL's `_compute_loss`: only the attributes it reads, with the bonus on."""
    trl_cls = trl_grpo.GRPOTrainer
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, ent, None),
        top_entropy_quantile=quantile, aux_loss_enabled=False, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=EPS,
        epsilon_high=eps_high if eps_high is not None else (5.0 if loss_type == "cispo" else EPS_HIGH),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=grad_accum,
                             sapo_temperature_pos=1.0, sapo_temperature_neg=SAPO_NEG, vespo_k_pos=2.0,
                             vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0),
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum, max_completion_length=MAX_LEN,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x,
                                    pad_across_processes=lambda x, dim, pad_index: x, sync_gradients=True),
        _entropy_bonus_enabled=True, entropy_coef=coef, use_adaptive_entropy=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        get_gamma_weights=trl_cls.get_gamma_weights,
    )
    fake.get_high_entropy_mask = lambda e, m, t: trl_cls.get_high_entropy_mask(fake, e, m, t)
    return fake


def _batch(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 1, 5, 0, 6])  # unequal, one answer with no token
    mask = (torch.arange(MAX_LEN)[None, :] < lengths[:, None]).long()  # [6, 7]
    logp = torch.log_softmax(torch.randn(6, MAX_LEN, 5, generator=gen, dtype=F64), -1)[..., 0]  # [6, 7]
    old = logp + 0.3 * torch.randn(6, MAX_LEN, generator=gen, dtype=F64)  # ratios ~ e^(+-0.3): both clip sides
    ref = logp + 0.2 * torch.randn(6, MAX_LEN, generator=gen, dtype=F64)
    ent = 2.0 * torch.rand(6, MAX_LEN, generator=gen, dtype=F64)
    adv = torch.randn(6, generator=gen, dtype=F64)
    return logp, old, ref, ent, adv, mask


@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("quantile", [1.0, 0.3])
@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_loss_and_gradients_match_trl_for_every_loss_type(loss_type, quantile, grad_accum):
    logp0, old, ref, ent0, adv, mask = _batch(seed=len(loss_type))
    beta = 0.04 if loss_type in ("grpo", "dapo") else 0.0  # the KL term in the mix for two of them
    num_items = torch.tensor(40)  # the generation batch's tokens (this micro-batch has 22)
    trl_logp, trl_ent = logp0.clone().requires_grad_(), ent0.clone().requires_grad_()
    fake = _fake_trl(loss_type, trl_logp, trl_ent, quantile=quantile, grad_accum=grad_accum, beta=beta)
    trl_loss = trl_compute_loss(fake, adv, mask, old, ref if beta else None, num_items)
    trl_loss.backward()

    # the trainer's rule (training/update.py): a loss summed over global tokens adds its micro-batches up unscaled
    # and passes their count as entropy_parts; the others are divided by the count, bonus included
    global_tokens = AlgorithmConfig(loss_type=loss_type).sums_over_global_tokens
    logp, ent = logp0.clone().requires_grad_(), ent0.clone().requires_grad_()
    loss, _ = policy_loss(logp, old, adv, mask,
                          LossSpec(beta=beta, epsilon=EPS, epsilon_high=fake.epsilon_high, loss_type=loss_type,
                                   max_completion_length=MAX_LEN, entropy_coef=0.05, entropy_aggregation="token_mean",
                                   top_entropy_quantile=quantile, sapo_temperature_neg=SAPO_NEG),
                          ref_logp=ref if beta else None, entropy=ent,
                          accumulation=Accumulation(num_items, grad_accum if global_tokens else 1))
    loss = loss if global_tokens else loss / grad_accum
    loss.backward()
    assert abs(loss.item() - trl_loss.item()) < 1e-9 * max(1.0, abs(trl_loss.item()))
    torch.testing.assert_close(logp.grad, trl_logp.grad, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ent.grad, trl_ent.grad, atol=1e-9, rtol=1e-9)
    assert ent.grad.abs().sum() > 0 and logp.grad.abs().sum() > 0


# ---------------------------------------------------------------- the trainer's wiring, on a tiny model

G = 4


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "sapo"])
def test_the_trainers_micro_batches_give_trls_accumulated_loss(tiny_model_dir, loss_type):
    """optimize() over 3 micro-batches (one optimizer step) has the gradient of TRL's loss summed over an
    accumulation window of 3, each micro-batch's bonus its own token mean / 3."""
    from grpokit.config.schema import Config, DataConfig, ModelConfig, RolloutConfig, TrainConfig
    from grpokit.models.forward import ForwardOptions, completion_logprobs
    from grpokit.models.loading import load_model, load_tokenizer
    from grpokit.rollout.decode import sample_groups
    from grpokit.rollout.request import RolloutRequest, SamplingParams
    from grpokit.training.generate import GenerationBatch
    from grpokit.training.setup import Policy
    from grpokit.training.update import optimize

    model, tok = load_model(tiny_model_dir, device="cpu").eval(), load_tokenizer(tiny_model_dir)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("12+7=", "3+45=", "100+1=")]
    rollout = sample_groups(model, RolloutRequest(prompts, G, SamplingParams(6, (tok.eos_token_id,), tok.pad_token_id),
                                                  torch.Generator().manual_seed(0)))
    adv = torch.randn(3 * G, generator=torch.Generator().manual_seed(1))
    batch = GenerationBatch(SimpleNamespace(rollout=rollout), adv, rollout.completion_mask.clone(), None, None)
    config = Config(model=ModelConfig(path=str(tiny_model_dir), device="cpu"), data=DataConfig(path="unused.jsonl"),
                    rollout=RolloutConfig(group_size=G, max_new_tokens=6, temperature=1.0),
                    algorithm=AlgorithmConfig(loss_type=loss_type, entropy_coef=0.05, entropy_aggregation="token_mean",
                                              sapo_temperature_neg=SAPO_NEG),
                    train=TrainConfig(prompts_per_step=3, micro_batch_size=4, max_grad_norm=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # the gradient stays in .grad, the weights as they are
    policy = Policy(model, None, True, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
    metrics = optimize(config, policy, batch)
    ours = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    trl_loss, n_items = 0.0, batch.loss_mask.sum()
    for rows in torch.arange(3 * G).split(4):  # TRL: per_device_train_batch_size 4, gradient_accumulation_steps 3
        T = int(rollout.completion_mask[rows].sum(-1).max())
        logp, ent = completion_logprobs(model, rollout.prompt_ids[rows], rollout.prompt_mask[rows],
                                        rollout.completion_ids[rows, :T], rollout.completion_mask[rows, :T],
                                        temperature=1.0, with_entropy=True,
                                        options=ForwardOptions(linear_head=True))
        fake = _fake_trl(loss_type, logp, ent, grad_accum=3, eps_high=0.2)
        fake.max_completion_length = 6
        micro = trl_compute_loss(fake, adv[rows], batch.loss_mask[rows, :T], None, None, n_items)
        micro.backward()
        trl_loss += micro.item()
    assert metrics["loss"] == pytest.approx(trl_loss, rel=1e-5, abs=1e-7)
    assert ours.keys() and all(torch.allclose(ours[k], p.grad, rtol=1e-4, atol=1e-7)
                               for k, p in model.named_parameters() if k in ours)
