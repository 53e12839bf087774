"""Every fast path gives the same loss and gradients as the plain path.

Fast paths (each can be switched off, which is how the benchmark's ablation rows are made):
the fused selective log-softmax (`train.fused_logprobs`) and its one-pass backward, skipping
answers whose advantage is 0 when β = 0 (`train.skip_zero_advantage`), old log-probs kept from
the first pass (`algorithm.old_logprobs = "first_pass"`) or taken from the sampler ("sampler"),
and the rollout engine's preallocated KV cache and sampler.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from grpokit.algorithms import fused_logprobs
from grpokit.config.schema import AlgorithmConfig, Config, DataConfig, ModelConfig, RolloutConfig, TrainConfig
from grpokit.models.forward import ForwardOptions, completion_logprobs, embedding_rows_into_grad
from grpokit.models.loading import load_model, load_tokenizer
from grpokit.rollout.decode import sample_groups
from grpokit.rollout.request import RolloutRequest, SamplingParams
from grpokit.training import update
from grpokit.training.generate import GenerationBatch
from grpokit.training.setup import Policy
from grpokit.training.update import _micro_step, loss_spec, optimize, score_old_and_ref

G = 4


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, device="cpu").eval(), load_tokenizer(tiny_model_dir)


def _rollout(tiny, max_new_tokens=6, ignore_eos=False, seed=0):
    model, tok = tiny
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("12+7=", "3+45=", "100+1=")]
    sampling = SamplingParams(max_new_tokens, (tok.eos_token_id,), tok.pad_token_id, temperature=1.0,
                              ignore_eos=ignore_eos)
    return sample_groups(model, RolloutRequest(prompts, G, sampling, torch.Generator().manual_seed(seed)))


def _config(tiny_model_dir, *, fused=True, skip=True, **algo) -> Config:
    return Config(model=ModelConfig(path=str(tiny_model_dir), device="cpu"), data=DataConfig(path="unused.jsonl"),
                  rollout=RolloutConfig(group_size=G, max_new_tokens=6, temperature=0.8),
                  algorithm=AlgorithmConfig(**algo),
                  train=TrainConfig(prompts_per_step=3, fused_logprobs=fused, skip_zero_advantage=skip,
                                    logprob_chunk_size=5))


def _batch(rollout, *, zero_groups=True, off_policy=False, ref=False, seed=1) -> GenerationBatch:
    gen = torch.Generator().manual_seed(seed)
    N = rollout.num_sequences
    adv = torch.randn(N, generator=gen)
    if zero_groups:  # the first group ties (advantage 0 for all its answers), as many real groups do
        adv[:G] = 0.0
    noise = lambda: 0.3 * torch.randn(rollout.logprobs.shape, generator=gen)  # noqa: E731
    old = rollout.logprobs + noise() if off_policy else None  # ratios away from 1: both clip sides bind somewhere
    ref = rollout.logprobs + noise() if ref else None
    return GenerationBatch(SimpleNamespace(rollout=rollout), adv, rollout.completion_mask.clone(), old, ref)


def _policy(model, lr: float = 1e-2) -> Policy:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return Policy(model, None, True, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))


def _loss_and_grads(config, model, batch):
    model.zero_grad(set_to_none=True)
    N = len(batch.advantages)
    n_items = batch.loss_mask.sum().clamp(min=1)
    loss, stats, _ = _micro_step(config, loss_spec(config), Policy(model, None, True, None, None), batch,
                                 batch.old_logp, torch.arange(N), n_items, 1)
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return loss, stats, grads


def _assert_same(a, b):
    (loss_a, stats_a, grads_a), (loss_b, stats_b, grads_b) = a, b
    assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-7)
    for k in ("clip_ratio/region_mean", "kl"):
        if k in stats_b:
            assert stats_a[k] == pytest.approx(stats_b[k], rel=1e-5, abs=1e-7)
    assert grads_a.keys() == grads_b.keys()
    for k in grads_b:
        torch.testing.assert_close(grads_a[k], grads_b[k], atol=2e-7, rtol=1e-4)


CASES = [
    dict(loss_type="dapo"),
    dict(loss_type="grpo"),
    dict(loss_type="bnpo"),
    dict(loss_type="dr_grpo"),
    dict(loss_type="cispo", epsilon_high=0.28),
    dict(loss_type="dapo", importance_sampling_level="sequence"),  # GSPO
]


@pytest.mark.parametrize("algo", CASES)
@pytest.mark.parametrize("regime", ["on_policy", "off_policy", "kl"])
def test_fused_head_and_zero_advantage_skip_match_the_plain_path(tiny, tiny_model_dir, algo, regime):
    model, _ = tiny
    beta = 0.04 if regime == "kl" else 0.0
    batch = _batch(_rollout(tiny), off_policy=regime != "on_policy", ref=beta > 0)
    plain = _loss_and_grads(_config(tiny_model_dir, fused=False, skip=False, beta=beta, **algo), model, batch)
    before = dict(fused_logprobs.PATH_COUNTS)
    for fused, skip in ((True, False), (False, True), (True, True)):
        fast = _loss_and_grads(_config(tiny_model_dir, fused=fused, skip=skip, beta=beta, **algo), model, batch)
        _assert_same(fast, plain)
    one_pass = fused_logprobs.PATH_COUNTS["one_pass"] - before["one_pass"]
    gspo_off_policy = algo.get("importance_sampling_level") == "sequence" and regime != "on_policy"
    assert one_pass == (0 if gspo_off_policy else 2)  # GSPO's off-policy ratio is not per token: recompute


def test_skipping_zero_advantage_answers_runs_the_model_on_the_others_only(tiny, tiny_model_dir, monkeypatch):
    model, _ = tiny
    batch = _batch(_rollout(tiny))
    seen = []
    real = completion_logprobs

    def spy(model, prompt_ids, *a, **k):
        seen.append(prompt_ids.shape[0])
        return real(model, prompt_ids, *a, **k)

    monkeypatch.setattr("grpokit.training.update.completion_logprobs", spy)
    _loss_and_grads(_config(tiny_model_dir), model, batch)
    assert seen == [len(batch.advantages) - G]
    batch.advantages.zero_()  # no answer carries a gradient: no model call at all, and no update
    loss, _, grads = _loss_and_grads(_config(tiny_model_dir), model, batch)
    assert seen == [len(batch.advantages) - G] and loss == 0.0 and not grads


def test_fused_logprobs_of_the_whole_model_match_the_plain_head(tiny):
    model, _ = tiny
    r = _rollout(tiny)
    args = (model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    with torch.no_grad():
        fused, ent_f = completion_logprobs(*args, temperature=0.7, with_entropy=True,
                                           options=ForwardOptions(chunk_size=5))
        plain, ent_p = completion_logprobs(*args, temperature=0.7, with_entropy=True,
                                           options=ForwardOptions(chunk_size=5, fused=False))
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_f, ent_p, atol=1e-5, rtol=1e-5)


def _one_step(tiny_model_dir, rollout, **algo):
    """Weights after one GRPO step (μ = 2) from fresh weights, the step's metrics, and the batch with the old
    log-probs the second pass's micro-steps scored against (the recomputed ones, or the first pass's)."""
    model = load_model(tiny_model_dir, device="cpu").eval()
    config = _config(tiny_model_dir, num_iterations=2, **algo)
    batch = _batch(rollout, zero_groups=False)
    policy = _policy(model)
    batch = score_old_and_ref(config, policy, batch)
    scored_against = []

    def micro_step(config, spec, policy, batch, old_logp, *rest):
        scored_against.append(old_logp)
        return _micro_step(config, spec, policy, batch, old_logp, *rest)

    with mock.patch.object(update, "_micro_step", micro_step):
        metrics = optimize(config, policy, batch)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return weights, metrics, dataclasses.replace(batch, old_logp=scored_against[-1])


def test_old_logprobs_from_the_first_pass_equal_the_recomputed_ones(tiny, tiny_model_dir):
    rollout = _rollout(tiny)
    w_re, m_re, b_re = _one_step(tiny_model_dir, rollout, old_logprobs="recompute")
    w_fp, m_fp, b_fp = _one_step(tiny_model_dir, rollout, old_logprobs="first_pass")
    torch.testing.assert_close(b_fp.old_logp * b_fp.loss_mask, b_re.old_logp * b_re.loss_mask, atol=1e-5, rtol=0)
    assert m_fp["clip_ratio/region_mean"] == pytest.approx(m_re["clip_ratio/region_mean"], abs=1e-6)
    assert m_fp["loss"] == pytest.approx(m_re["loss"], rel=1e-4, abs=1e-6)
    for k in w_re:
        torch.testing.assert_close(w_fp[k], w_re[k], atol=1e-5, rtol=1e-4)


def test_sampler_logprobs_as_old_logprobs_differ_from_a_recompute_by_float_noise_only(tiny, tiny_model_dir):
    rollout = _rollout(tiny)
    _, _, b_re = _one_step(tiny_model_dir, rollout, old_logprobs="recompute")
    _, _, b_sa = _one_step(tiny_model_dir, rollout, old_logprobs="sampler")
    # the rollout ran at temperature 1.0 and the trainer at 0.8: compare at the sampling temperature
    model = load_model(tiny_model_dir, device="cpu").eval()
    with torch.no_grad():
        recomputed, _ = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                            rollout.completion_mask, temperature=1.0)
    gap = ((recomputed - rollout.logprobs) * rollout.completion_mask).abs().max().item()
    assert gap < 1e-5
    assert torch.equal(b_sa.old_logp, rollout.logprobs)


@pytest.mark.parametrize("with_grad", [True, False])
def test_shared_prompt_forward_matches_one_forward_per_row(tiny, tiny_model_dir, monkeypatch, with_grad):
    """Each distinct prompt runs once, its KV cache repeated over its answers (prompts of different
    lengths, so left padding; EOS-terminated answers, so right padding): same log-probs and gradients."""
    model, tok = tiny
    r = _rollout(tiny, max_new_tokens=8)
    cut = torch.zeros_like(r.completion_mask, dtype=torch.bool)
    cut[::3, 5:] = True  # as if these answers had ended with EOS at their 5th token
    r = dataclasses.replace(r, completion_mask=r.completion_mask.masked_fill(cut, 0),
                            completion_ids=r.completion_ids.masked_fill(cut, tok.pad_token_id))
    assert r.prompt_mask.sum(-1).unique().numel() > 1 and (r.completion_mask == 0).any()
    w = torch.randn(r.completion_ids.shape, generator=torch.Generator().manual_seed(3))
    calls = []

    def run(share: bool):
        model.zero_grad(set_to_none=True)
        spy = model.base_model.register_forward_pre_hook(
            lambda mod, args, kwargs: calls.append((share, kwargs["input_ids"].shape)), with_kwargs=True)
        try:
            with torch.set_grad_enabled(with_grad):
                logp, ent = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                                r.completion_mask, temperature=0.9, with_entropy=True,
                                                options=ForwardOptions(chunk_size=7, share_prompts=share))
                if with_grad:
                    (logp * w * r.completion_mask).sum().backward()
        finally:
            spy.remove()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        return logp.detach(), ent.detach(), grads

    shared, plain = run(True), run(False)
    N, P, T = r.num_sequences, r.prompt_ids.shape[1], r.completion_ids.shape[1]
    assert [c for c in calls if c[0]] == [(True, (N // G, P)), (True, (N, T - 1))]  # 3 prompts once, then answers
    assert [c for c in calls if not c[0]] == [(False, (N, P + T))]
    m = r.completion_mask.bool()
    torch.testing.assert_close(shared[0][m], plain[0][m], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(shared[1][m], plain[1][m], atol=2e-5, rtol=1e-5)
    assert shared[2].keys() == plain[2].keys()
    for k in plain[2]:
        torch.testing.assert_close(shared[2][k], plain[2][k], atol=1e-6, rtol=1e-4)


def _two_micro_steps(config, model, batch):
    """Two micro-steps' gradients accumulated (.grad is None before the first), as one optimizer step has."""
    model.zero_grad(set_to_none=True)
    n_items = batch.loss_mask.sum().clamp(min=1)
    for _ in range(2):
        _micro_step(config, loss_spec(config), Policy(model, None, True, None, None), batch, batch.old_logp,
                    torch.arange(len(batch.advantages)), n_items, 1)
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("with_padding_idx, tied", [(False, True), (True, True), (False, False)])
def test_embedding_rows_added_into_the_gradient_give_the_dense_gradient(tiny, tiny_model_dir, with_padding_idx,
                                                                        tied):
    """`train.embedding_rows_into_grad`: over two accumulated micro-steps every gradient is the dense
    lookup's (the first adds torch's dense gradient, the second its rows in place), tied to the head or not
    (then the weight's accumulator gets no gradient at all from the lookup), the padding row gets none, a
    post-accumulate hook sees the whole gradient, and the module is put back."""
    model, _ = tiny
    embed, head_weight = model.get_input_embeddings(), model.lm_head.weight
    batch = _batch(_rollout(tiny), off_policy=True)
    # a token the answers use (row 0's group has advantage 0): torch's lookup gives its row no gradient
    embed.padding_idx = int(batch.rollout.completion_ids[-1, 0]) if with_padding_idx else None
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(head_weight.detach().clone())
    try:
        config = _config(tiny_model_dir)
        dense = _two_micro_steps(config, model, batch)
        seen = []
        hook = embed.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
        try:
            with embedding_rows_into_grad(model) as applies:
                assert applies and "forward" in embed.__dict__
                rows = _two_micro_steps(config, model, batch)
        finally:
            hook.remove()
        assert "forward" not in embed.__dict__
        assert dense.keys() == rows.keys()
        for k in dense:
            torch.testing.assert_close(rows[k], dense[k], atol=4e-7, rtol=1e-4)
        torch.testing.assert_close(seen[-1], dense["model.embed_tokens.weight"], atol=4e-7, rtol=1e-4)
    finally:
        embed.padding_idx = None
        model.lm_head.weight = head_weight
    with embedding_rows_into_grad(model, enabled=False) as applies:
        assert not applies and "forward" not in embed.__dict__
    hook = embed.weight.register_hook(lambda g: g)  # a tensor hook would see only part of the gradient: off
    try:
        with embedding_rows_into_grad(model) as applies:
            assert not applies
    finally:
        hook.remove()
