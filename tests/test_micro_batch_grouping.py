"""Length-grouped micro-batches (train.micro_batch_grouping = "length", training/update.py micro_batches_of):
answers of similar length share a micro-batch, so each trims less padding, and the loss and its gradient
are those of the row-order micro-batches, to float64 rounding, for every loss type (or the grouping keeps
row order where it would change them).

The float64 parity runs each answer's whole sequence (shared_prompt_forward = false): the shared prompt
forward, which runs where a micro-batch holds answers to the same prompt (row order: a group; by length:
fewer), is itself equal to the whole-sequence forward only to ~5e-9 in float64 (the same gap in row
order), so with it the parity holds to that level (the last test)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from grpokit.config.schema import AlgorithmConfig, Config, DataConfig, ModelConfig, RolloutConfig, TrainConfig
from grpokit.config.variants import GLOBAL_TOKEN_LOSSES
from grpokit.models.loading import load_model, load_tokenizer
from grpokit.rollout.decode import sample_groups
from grpokit.rollout.request import RolloutRequest, SamplingParams
from grpokit.training.generate import GenerationBatch
from grpokit.training.setup import Policy
from grpokit.training.update import _micro_step, loss_spec, micro_batches_of, optimize, token_budget_split

G, T_MAX, MICRO = 4, 24, 4
# heavy-tailed answer lengths in an order that mixes long and short answers in every row-order micro-batch
LENGTHS = [24, 1, 2, 3, 17, 2, 1, 5, 3, 24, 2, 9]


@pytest.fixture(scope="module")
def tiny64(tiny_model_dir):
    return load_model(tiny_model_dir, device="cpu").double().eval(), load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def rollout(tiny64):
    """12 answers (3 prompts x G) whose completion masks end at LENGTHS."""
    model, tok = tiny64
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("12+7=", "3+45=", "100+1=")]
    sampling = SamplingParams(T_MAX, (tok.eos_token_id,), tok.pad_token_id, temperature=1.0, ignore_eos=True)
    r = sample_groups(model, RolloutRequest(prompts, G, sampling, torch.Generator().manual_seed(0)))
    mask = (torch.arange(T_MAX)[None, :] < torch.tensor(LENGTHS)[:, None]).to(r.completion_mask.dtype)  # [N, T]
    return dataclasses.replace(r, completion_mask=mask, completion_ids=torch.where(mask.bool(), r.completion_ids,
                               tok.pad_token_id), logprobs=r.logprobs.double() * mask)


def _config(tiny_model_dir, grouping: str, shared_prompts: bool = False, **algo) -> Config:
    return Config(model=ModelConfig(path=str(tiny_model_dir), device="cpu"), data=DataConfig(path="unused.jsonl"),
                  rollout=RolloutConfig(group_size=G, max_new_tokens=T_MAX, temperature=0.8),
                  algorithm=AlgorithmConfig(**algo),
                  train=TrainConfig(prompts_per_step=3, micro_batch_size=MICRO, micro_batch_grouping=grouping,
                                    max_grad_norm=0.0, logprob_chunk_size=7, shared_prompt_forward=shared_prompts))


def _batch(rollout, *, off_policy: bool, beta: float) -> GenerationBatch:
    gen = torch.Generator().manual_seed(1)
    N = rollout.num_sequences
    adv = torch.randn(N, generator=gen, dtype=torch.float64)
    adv[:2] = 0.0  # zero-advantage answers (skipped by the forward) in a micro-batch
    noise = lambda: 0.3 * torch.randn(rollout.logprobs.shape, generator=gen, dtype=torch.float64)  # noqa: E731
    old = (rollout.logprobs + noise()) * rollout.completion_mask if off_policy else None
    ref = (rollout.logprobs + noise()) * rollout.completion_mask if beta > 0 else None
    return GenerationBatch(SimpleNamespace(rollout=rollout), adv, rollout.completion_mask.clone(), old, ref)


def _loss_and_grads(config, model, batch, rows):
    """optimize()'s accumulation over one minibatch `rows`: the summed micro-batch losses and the gradient."""
    model.zero_grad(set_to_none=True)
    micro = micro_batches_of(config, batch, rows)
    n_items = batch.loss_mask[rows].sum().clamp(min=1)
    spec, policy = loss_spec(config), Policy(model, None, True, None, None)
    loss = sum(_micro_step(config, spec, policy, batch, batch.old_logp, m, n_items, len(micro))[0] for m in micro)
    return loss, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, micro


def _padded_tokens(batch, micro) -> int:
    """What the forward computes on: each micro-batch's rows times its longest answer."""
    return sum(len(m) * int(batch.rollout.completion_mask[m].sum(-1).max()) for m in micro)


CASES = [
    dict(loss_type="dapo"),
    dict(loss_type="dapo", entropy_coef=0.01),  # with an entropy term: fixed-size micro-batches
    dict(loss_type="grpo"),
    dict(loss_type="bnpo"),
    dict(loss_type="dr_grpo"),
    dict(loss_type="cispo", epsilon_high=0.28),
    dict(loss_type="sapo"),
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="vespo"),
    dict(loss_type="dapo", importance_sampling_level="sequence"),  # GSPO
    dict(loss_type="grpo", off_policy_mask_threshold=0.1),
    dict(loss_type="dr_grpo", entropy_coef=0.01),  # the bonus inside the loss type's aggregation
    dict(loss_type="dapo", entropy_coef=0.01, entropy_aggregation="token_mean"),  # per micro-batch: row order
    dict(loss_type="grpo", top_entropy_quantile=0.5),  # the quantile of each micro-batch's tokens: row order
]
ROW_ORDER_ONLY = ("bnpo", "token_mean", "top_entropy_quantile")


@pytest.mark.parametrize("algo", CASES, ids=lambda a: "-".join(f"{v}" for v in a.values()))
@pytest.mark.parametrize("regime", ["off_policy_kl"])  # on-policy is its special case (ratio 1)
@pytest.mark.parametrize("minibatch", [12, 10], ids=["full", "short_last_micro_batch"])
def test_length_grouping_gives_the_row_order_loss_and_gradient(tiny64, tiny_model_dir, rollout, algo, regime,
                                                                minibatch):
    model, _ = tiny64
    beta = 0.04 if regime == "off_policy_kl" else 0.0
    batch = _batch(rollout, off_policy=regime != "on_policy", beta=beta)
    rows = torch.arange(minibatch)
    loss_rows, grads_rows, micro_rows = _loss_and_grads(_config(tiny_model_dir, "rows", beta=beta, **algo), model,
                                                        batch, rows)
    loss_len, grads_len, micro_len = _loss_and_grads(_config(tiny_model_dir, "length", beta=beta, **algo), model,
                                                     batch, rows)
    assert sorted(torch.cat(micro_len).tolist()) == rows.tolist()
    grouped = not any(k in ROW_ORDER_ONLY or v in ROW_ORDER_ONLY for k, v in algo.items())
    if grouped:  # the grouping computes on fewer padded tokens
        assert _padded_tokens(batch, micro_len) < _padded_tokens(batch, micro_rows)
    else:
        assert [m.tolist() for m in micro_len] == [m.tolist() for m in micro_rows]
    if algo["loss_type"] in GLOBAL_TOKEN_LOSSES and "entropy_coef" not in algo:  # any sizes, under the budget
        P = batch.rollout.prompt_ids.shape[1]
        longest = int(batch.rollout.completion_mask[rows].sum(-1).max())
        assert max(_padded_tokens(batch, [m]) + len(m) * P for m in micro_len) <= MICRO * (P + longest)
    else:
        assert [len(m) for m in micro_len] == [len(m) for m in micro_rows]
    assert loss_len == pytest.approx(loss_rows, rel=1e-12, abs=1e-14)
    assert grads_len.keys() == grads_rows.keys()
    for k in grads_rows:
        torch.testing.assert_close(grads_len[k], grads_rows[k], rtol=1e-10, atol=1e-13)


def test_length_grouping_with_the_shared_prompt_forward(tiny64, tiny_model_dir, rollout):
    model, _ = tiny64
    batch = _batch(rollout, off_policy=True, beta=0.04)
    rows = torch.arange(12)
    loss_rows, grads_rows, _ = _loss_and_grads(_config(tiny_model_dir, "rows", True, beta=0.04), model, batch, rows)
    loss_len, grads_len, _ = _loss_and_grads(_config(tiny_model_dir, "length", True, beta=0.04), model, batch, rows)
    assert loss_len == pytest.approx(loss_rows, rel=1e-12, abs=1e-14)
    for k in grads_rows:
        torch.testing.assert_close(grads_len[k], grads_rows[k], rtol=1e-5, atol=1e-7)


def test_row_weighted_losses_keep_the_short_last_micro_batch(tiny_model_dir, rollout):
    """grpo weighs a row by 1/(rows of its micro-batch): the 2 rows of a short last micro-batch stay there;
    dapo divides by the minibatch's tokens: every row may move, and the answers the zero-advantage skip leaves
    out (rows 0 and 1) share a micro-batch of their own, where no forward runs."""
    batch = _batch(rollout, off_policy=False, beta=0.0)
    rows = torch.arange(10)
    grpo = micro_batches_of(_config(tiny_model_dir, "length", loss_type="grpo"), batch, rows)
    assert grpo[-1].tolist() == [8, 9]
    assert [LENGTHS[i] for i in torch.cat(grpo[:-1])] == sorted(LENGTHS[:8], reverse=True)
    dapo = micro_batches_of(_config(tiny_model_dir, "length", loss_type="dapo"), batch, rows)
    assert [LENGTHS[i] for i in torch.cat(dapo[:-1])] == sorted(LENGTHS[2:10], reverse=True)
    assert dapo[-1].tolist() == [0, 1]


def test_optimize_groups_by_length_by_default(tiny64, tiny_model_dir, rollout, monkeypatch):
    """optimize() takes its micro-batches from micro_batches_of; the default config groups by length."""
    model, _ = tiny64
    assert TrainConfig().micro_batch_grouping == "length"
    seen = []
    real = _micro_step

    def recording(config, spec, policy, batch, old, rows, *args):
        seen.append(rows.tolist())
        return real(config, spec, policy, batch, old, rows, *args)

    monkeypatch.setattr("grpokit.training.update._micro_step", recording)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    policy = Policy(model, None, True, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
    optimize(_config(tiny_model_dir, "length"), policy, _batch(rollout, off_policy=False, beta=0.0))
    # dapo (the default): a token budget of 4 x (6 prompt + 24 answer tokens), the short answers in one
    # micro-batch of 7, the two zero-advantage answers (rows 0 and 1) in one of their own
    assert [[LENGTHS[i] for i in m] for m in seen] == [[24, 17, 9], [5, 3, 3, 2, 2, 2, 1], [24, 1]]


def test_micro_batch_grouping_is_checked():
    with pytest.raises(ValueError, match="train.micro_batch_grouping"):
        TrainConfig(micro_batch_grouping="sorted")


def _compositions(n: int):
    """Every way to cut n ordered items into consecutive non-empty groups (their sizes)."""
    if n == 0:
        yield []
        return
    for first in range(1, n + 1):
        for rest in _compositions(n - first):
            yield [first, *rest]


@pytest.mark.parametrize("seed", range(30))
def test_token_budget_split_is_the_cheapest_split_under_the_budget(seed):
    """The dynamic programme against every split of up to 9 sorted answers: the least padded answer tokens plus
    each micro-batch's distinct prompts and overhead, and no micro-batch over the budget."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 10, (1,), generator=gen))
    lengths = sorted(torch.randint(1, 60, (n,), generator=gen).tolist(), reverse=True)
    prompts = torch.randint(0, 3, (n,), generator=gen).tolist()
    prompt_tokens, overhead = seed % 4 * 8, seed % 3 * 16
    budget = int(torch.randint(lengths[0] + prompt_tokens, 4 * (lengths[0] + prompt_tokens) + 1, (1,), generator=gen))

    def cost(sizes):
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        if any(s * (lengths[a] + prompt_tokens) > budget for s, a in zip(sizes, starts)):
            return None
        return sum(s * lengths[a] + len(set(prompts[a:a + s])) * prompt_tokens + overhead
                   for s, a in zip(sizes, starts))

    got = token_budget_split(lengths, prompts, prompt_tokens, budget, overhead)
    assert sum(got) == n and cost(got) is not None
    assert cost(got) == min(c for c in map(cost, _compositions(n)) if c is not None)


@pytest.mark.parametrize("setting", [dict(model=dict(fsdp=True)),
                                     dict(train=dict(optimizer_in_backward=True, micro_batch_size=0))],
                         ids=["fsdp", "optimizer_in_backward"])
def test_no_token_budget_where_the_micro_step_count_is_fixed(tiny_model_dir, rollout, setting):
    """FSDP gathers weights inside every forward (each process must run as many micro-steps) and the AdamW step
    in the backward needs its one backward: fixed-size micro-batches there, still sorted by length."""
    config = _config(tiny_model_dir, "length", loss_type="dapo")
    config = dataclasses.replace(config, **{k: dataclasses.replace(getattr(config, k), **v)
                                            for k, v in setting.items()})
    micro = micro_batches_of(config, _batch(rollout, off_policy=False, beta=0.0), torch.arange(12))
    assert [len(m) for m in micro] == ([MICRO] * 3 if "model" in setting else [12])
    assert [LENGTHS[i] for i in torch.cat(micro)] == (sorted(LENGTHS, reverse=True) if "model" in setting
                                                      else LENGTHS)


@pytest.mark.parametrize("shared_prompts", [True, False], ids=["shared_prompt_forward", "every_row_its_prompt"])
def test_long_prompts_keep_their_groups_together(tiny_model_dir, rollout, shared_prompts):
    """Sorting by length scatters a prompt's answers over micro-batches, and the shared prompt forward then runs
    the prompt once per micro-batch instead of once: with 200-token prompts and answers of 9-10 tokens the
    row order computes less and is kept; without the shared forward every row runs its prompt anyway and the
    sorted split (less padding) is taken."""
    lengths = torch.tensor([10, 9, 9, 10, 9, 10, 10, 9, 9, 9, 10, 10])
    mask = (torch.arange(T_MAX)[None, :] < lengths[:, None]).to(rollout.completion_mask.dtype)  # [N, T]
    prompts = rollout.prompt_ids[:, :1].repeat(1, 200) + torch.arange(12)[:, None] // G  # [N, 200]: 3 prompts
    long = dataclasses.replace(rollout, completion_mask=mask, prompt_ids=prompts, prompt_mask=torch.ones_like(prompts))
    batch = _batch(long, off_policy=True, beta=0.0)
    micro = micro_batches_of(_config(tiny_model_dir, "length", shared_prompts, loss_type="dapo"), batch,
                             torch.arange(12))
    row_order = [list(range(k, k + MICRO)) for k in range(0, 12, MICRO)]
    assert ([m.tolist() for m in micro] == row_order) == shared_prompts


def test_answers_of_one_length_keep_row_order_without_the_split_search(tiny_model_dir, rollout, monkeypatch):
    """All answers one length (EOS ignored), none skipped, and row order at the least cost any split can have
    (no prompt's answers straddle two micro-batches): the search (a millisecond per step on a 128-answer
    batch) is not run. With a zero-advantage answer it is (that answer's micro-batch of its own would run no
    forward; here the micro-step it adds costs more). With 200-token prompts whose groups of 4 straddle
    micro-batches of 6, it is, and it finds the cheaper split: one micro-batch per prompt."""
    import grpokit.training.update as update

    mask = torch.ones_like(rollout.completion_mask)  # [N, T]: every answer T_MAX tokens
    same = dataclasses.replace(rollout, completion_mask=mask)
    batch = _batch(same, off_policy=False, beta=0.0)
    batch.advantages[:2] = 1.0  # no zero-advantage answers
    searched = []
    real = update.token_budget_split
    monkeypatch.setattr(update, "token_budget_split", lambda *a, **k: searched.append(1) or real(*a, **k))
    config = _config(tiny_model_dir, "length", loss_type="dapo")
    micro = micro_batches_of(config, batch, torch.arange(12))
    assert [m.tolist() for m in micro] == [list(range(k, k + MICRO)) for k in range(0, 12, MICRO)] and not searched
    batch.advantages[0] = 0.0
    micro = micro_batches_of(config, batch, torch.arange(12))
    assert searched and [len(m) for m in micro] == [MICRO] * 3
    prompts = rollout.prompt_ids[:, :1].repeat(1, 200) + torch.arange(12)[:, None] // G  # [N, 200]: 3 prompts
    long = dataclasses.replace(same, prompt_ids=prompts, prompt_mask=torch.ones_like(prompts))
    batch = _batch(long, off_policy=False, beta=0.0)
    batch.advantages[:2] = 1.0
    shared = _config(tiny_model_dir, "length", True, loss_type="dapo")
    shared = dataclasses.replace(shared, train=dataclasses.replace(shared.train, micro_batch_size=6))
    searched.clear()
    micro = micro_batches_of(shared, batch, torch.arange(12))
    assert searched and [m.tolist() for m in micro] == [list(range(k, k + G)) for k in range(0, 12, G)]
