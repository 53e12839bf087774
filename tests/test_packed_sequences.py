"""Packed sequences (train.packed_sequences, models/packing.py): a micro-batch's answers run as one row without
padding, each attending to its prompt (from the shared prompt forward's KV cache) and to its own earlier tokens.

The loss and its gradient are the padded forward's, to float64 rounding, for every loss type (the parity below
runs optimize()'s micro-steps both ways); the variable-length attention is checked against a dense masked
attention; the micro-batch planner fills a packed micro-batch by its real tokens under the same token budget;
and packing is off wherever its forward would not be the padded one (a sliding window, a layer that ignores the
layout) or where it cannot run (FSDP, activation checkpointing, images)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import grpokit.models.forward as forward
import test_micro_batch_grouping as grouping
from grpokit.config.schema import TrainConfig
from grpokit.models.forward import ForwardOptions, completion_logprobs
from grpokit.models.packing import PackedLayout, packing_applies, varlen_attention
from grpokit.training.setup import Policy
from grpokit.training.update import _micro_step, loss_spec, micro_batches_of, token_budget_split
from test_micro_batch_grouping import CASES, LENGTHS, MICRO, _batch, _compositions, _config

tiny64, rollout = grouping.tiny64, grouping.rollout  # the grouping tests' model and answers (module fixtures)


def _loss_grads_micro(config, model, batch, rows, packing: bool):
    """optimize()'s accumulation over the minibatch `rows`, packed or padded: loss, gradient, micro-batches."""
    model.zero_grad(set_to_none=True)
    micro = micro_batches_of(config, batch, rows, packing)
    n_items = batch.loss_mask[rows].sum().clamp(min=1)
    spec, policy = loss_spec(config), Policy(model, None, True, None, None, packing=packing)
    loss = sum(_micro_step(config, spec, policy, batch, batch.old_logp, m, n_items, len(micro))[0] for m in micro)
    return loss, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, micro


@pytest.fixture
def packed_calls(monkeypatch):
    """How many micro-steps ran the packed forward (and so did not fall back to the padded one)."""
    calls = []
    real = forward.packed_completion_hidden

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(forward, "packed_completion_hidden", counting)
    return calls


@pytest.fixture
def float64_norm(monkeypatch):
    """Qwen2's RMSNorm computes in float32 whatever the model's dtype, so a prompt's gradient, summed over the
    answers that share its forward, rounds to float32 differently when micro-batches group answers differently
    (~6e-8 relative). For a float64 parity the norm keeps float64 (same formula)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(Qwen2RMSNorm, "forward", norm)


@pytest.mark.parametrize("algo", CASES, ids=lambda a: "-".join(f"{v}" for v in a.values()))
@pytest.mark.parametrize("minibatch", [12, 10], ids=["full", "short_last_micro_batch"])
def test_packed_micro_steps_give_the_padded_loss_and_gradient(tiny64, tiny_model_dir, rollout, algo, minibatch,
                                                              packed_calls, float64_norm):
    """Off-policy with a KL term, zero-advantage answers skipped, the one-pass backward where the loss allows it:
    the packed micro-steps (their own micro-batches, planned by real tokens) against the padded ones."""
    model, _ = tiny64
    batch = _batch(rollout, off_policy=True, beta=0.04)
    rows = torch.arange(minibatch)
    config = _config(tiny_model_dir, "length", True, beta=0.04, **algo)
    loss_pad, grads_pad, _ = _loss_grads_micro(config, model, batch, rows, packing=False)
    assert not packed_calls
    loss_packed, grads_packed, micro = _loss_grads_micro(config, model, batch, rows, packing=True)
    assert sorted(torch.cat(micro).tolist()) == rows.tolist()
    assert packed_calls and all(packed_calls)  # every micro-step with answers of several lengths ran packed
    assert loss_packed == pytest.approx(loss_pad, rel=1e-11, abs=1e-13)
    assert grads_packed.keys() == grads_pad.keys()
    for k in grads_pad:
        torch.testing.assert_close(grads_packed[k], grads_pad[k], rtol=1e-9, atol=1e-12)


def test_packed_log_probs_entropies_and_one_pass_backward_match_the_padded_forward(tiny64, rollout, packed_calls,
                                                                                   float64_norm):
    model, _ = tiny64
    r = rollout
    args = (model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    mask = r.completion_mask.double()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * mask

    def run(packed: bool, one_pass: bool):
        model.zero_grad(set_to_none=True)
        flat = weights.reshape(-1)
        grad_fn = (lambda lp, at: flat[at] if not isinstance(at, int) else flat[at:at + len(lp)]) if one_pass \
            else None
        logp, entropy = completion_logprobs(*args, with_entropy=True, grad_fn=grad_fn,
                                            options=ForwardOptions(chunk_size=5, packed=packed))
        (logp * weights).sum().backward()
        return logp.detach() * mask, entropy.detach() * mask, [p.grad.clone() for p in model.parameters()]

    want = run(False, False)
    for one_pass in (False, True):
        got = run(True, one_pass)
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
        for g, w in zip(got[2], want[2]):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert packed_calls == [True, True]
    packed_logp, _ = completion_logprobs(*args, options=ForwardOptions(packed=True))
    assert bool((packed_logp[~r.completion_mask.bool()] == 0).all())  # padding positions hold 0


def _dense_attention(q, k, v, q_lens, k_lens, scale):
    """The reference: every answer's block of a dense [Q, K] score matrix, causal at its bottom right."""
    Q, h, d = q.shape
    allowed = torch.zeros(Q, k.shape[0], dtype=torch.bool)
    qs, ks = 0, 0
    for n_q, n_k in zip(q_lens, k_lens):
        allowed[qs:qs + n_q, ks:ks + n_k] = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
        qs, ks = qs + n_q, ks + n_k
    kk = k.repeat_interleave(h // k.shape[1], dim=1)  # [K, h, d]
    vv = v.repeat_interleave(h // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale  # [h, Q, K]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_varlen_attention_is_causal_within_each_answer(heads):
    """Answers whose keys are their queries (no prompt), and answers after a prompt of 1-6 tokens: the output
    and every input's gradient against the dense masked attention."""
    gen = torch.Generator().manual_seed(sum(heads))
    h, h_kv = heads
    q_lens = [5, 1, 3, 7, 2]
    k_lens = [5, 4, 3, 13, 3]
    Q, K, d = sum(q_lens), sum(k_lens), 8
    q = torch.randn(Q, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(K, h_kv, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(K, h_kv, d, generator=gen, dtype=torch.float64, requires_grad=True)
    layout = PackedLayout(None, torch.arange(K), q_lens, k_lens, torch.tensor([0, 5, 6, 9, 16, 18]),
                          torch.tensor([0, 5, 9, 12, 25, 28]))
    out = varlen_attention(q, k, v, layout, scale=d ** -0.5)
    want = _dense_attention(q, k, v, q_lens, k_lens, d ** -0.5)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    seed = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * seed).sum(), (q, k, v))
    wants = torch.autograd.grad((want * seed).sum(), (q, k, v))
    for g, w in zip(grads, wants):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", range(30))
def test_packed_token_budget_split_is_the_cheapest_split_under_the_budget(seed):
    """Packed, a micro-batch computes the sum of its answers' lengths plus its distinct prompts, and holds the sum
    of (prompt + length) over its answers (a single answer over the budget runs alone): the dynamic programme
    against every split of up to 9 answers in row order."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 10, (1,), generator=gen))
    lengths = torch.randint(1, 60, (n,), generator=gen).tolist()
    prompts = torch.randint(0, 3, (n,), generator=gen).tolist()
    prompt_tokens, overhead = seed % 4 * 8, seed % 3 * 16
    budget = int(torch.randint(max(lengths) // 2 + prompt_tokens, 3 * (max(lengths) + prompt_tokens) + 1, (1,),
                               generator=gen))

    def tokens(a, s):  # computed: each distinct prompt once
        return sum(lengths[a:a + s]) + len(set(prompts[a:a + s])) * prompt_tokens

    def held(a, s):  # held: every answer's attention holds its prompt's keys
        return sum(lengths[a:a + s]) + s * prompt_tokens

    def cost(sizes):
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        if any(held(a, s) > budget and s > 1 for s, a in zip(sizes, starts)):
            return None
        return sum(tokens(a, s) + overhead for s, a in zip(sizes, starts))

    got = token_budget_split(lengths, prompts, prompt_tokens, budget, overhead, packed=True)
    assert sum(got) == n and cost(got) is not None
    assert cost(got) == min(c for c in map(cost, _compositions(n)) if c is not None)


def test_packed_micro_batches_keep_row_order_and_fill_the_budget_with_real_tokens(tiny_model_dir, rollout):
    """dapo: padded, the sorted answers are cut where rows x longest answer fits 4 x (prompt + 24); packed, the
    answers stay in row order (a prompt's answers together: its forward runs once) and a micro-batch holds as
    many as their real tokens and their prompts' keys allow, in no more micro-steps. grpo's micro-batches keep
    their 4 rows."""
    batch = _batch(rollout, off_policy=False, beta=0.0)
    rows = torch.arange(12)
    config = _config(tiny_model_dir, "length", True, loss_type="dapo")
    padded, packed = micro_batches_of(config, batch, rows), micro_batches_of(config, batch, rows, packed=True)
    P = rollout.prompt_ids.shape[1]
    assert len(packed) <= len(padded)
    moving = [m for m in packed if not set(m.tolist()) <= {0, 1}]  # rows 0 and 1: the zero-advantage skip's
    assert torch.cat(moving).tolist() == list(range(2, 12))
    for m in moving:  # each answer's attention holds its prompt's keys: (prompt + length) per answer
        assert sum(LENGTHS[i] + P for i in m.tolist()) <= MICRO * (P + max(LENGTHS))
    grpo = micro_batches_of(_config(tiny_model_dir, "length", True, loss_type="grpo"), batch, rows, packed=True)
    assert [m.tolist() for m in grpo] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    # a shuffled minibatch (minibatch_size < N draws its rows at random): packed, a prompt's answers come together
    shuffled = torch.tensor([7, 2, 11, 4, 9, 0, 5, 10, 3, 8, 1, 6])
    grouped = micro_batches_of(config, batch, shuffled, packed=True)
    prompt_of = [i // 4 for i in torch.cat([m for m in grouped if not set(m.tolist()) <= {0, 1}]).tolist()]
    assert prompt_of == sorted(prompt_of)


def test_packing_applies_only_where_it_is_the_padded_forward(tiny_model_dir, monkeypatch):
    from grpokit.models.tiny import build_tiny_model

    plain, _ = build_tiny_model(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    assert packing_applies(plain.eval())
    llama, _ = build_tiny_model(arch="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1)
    assert packing_applies(llama.eval())
    windowed, _ = build_tiny_model(arch="mistral", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    assert windowed.config.sliding_window == 4096  # Mistral's default: its cache is not plain full attention
    assert not packing_applies(windowed.eval())
    # a layer that ignores the layout (here: the registered kernel attends over the whole packed row)
    import grpokit.models.packing as packing

    def whole_row(q, k, v, layout, scale, dropout=0.0):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale,
            enable_gqa=True)[0].transpose(0, 1)[:q.shape[0]]

    monkeypatch.setattr(packing, "varlen_attention", whole_row)
    other, _ = build_tiny_model(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seed=1)
    assert not packing_applies(other.eval())


def test_the_kernel_switch_leaves_every_sub_config_as_it_was():
    """transformers' `_attn_implementation` setter writes into every sub-config: the packed forward's switch must
    not, or a vision tower set to its own kernel would come back with the text model's."""
    from types import SimpleNamespace

    from transformers import Qwen2VLConfig

    from grpokit.models.packing import PACKED_ATTENTION, _attention_implementation

    config = Qwen2VLConfig()
    config._attn_implementation = {"": "sdpa", "text_config": "sdpa", "vision_config": "eager"}
    model = SimpleNamespace(config=config)
    with _attention_implementation(model, PACKED_ATTENTION):
        assert config.get_text_config()._attn_implementation == PACKED_ATTENTION
        assert config.vision_config._attn_implementation == "eager"
    assert (config._attn_implementation, config.get_text_config()._attn_implementation,
            config.vision_config._attn_implementation) == ("sdpa", "sdpa", "eager")


def test_build_policy_packs_where_it_can(tiny_model_dir):
    from grpokit.training.setup import build_policy

    base = _config(tiny_model_dir, "length", True)
    assert TrainConfig().packed_sequences
    assert build_policy(base).packing
    for change in (dict(packed_sequences=False), dict(shared_prompt_forward=False),
                   dict(gradient_checkpointing=True)):
        config = dataclasses.replace(base, train=dataclasses.replace(base.train, **change))
        assert not build_policy(config).packing, change


def test_images_and_empty_prompts_run_padded(tiny64, rollout):
    from types import SimpleNamespace

    policy = Policy(tiny64[0], None, True, None, None, packing=True)
    assert policy.packs_sequences(SimpleNamespace(rollout=rollout))
    assert not policy.packs_sequences(SimpleNamespace(rollout=dataclasses.replace(rollout, media=object())))
    empty = rollout.prompt_mask.clone()
    empty[3] = 0
    assert not policy.packs_sequences(SimpleNamespace(rollout=dataclasses.replace(rollout, prompt_mask=empty)))


def test_a_model_that_cannot_pack_says_so_at_the_start(tmp_path, tiny_model_dir):
    """A sliding-window Mistral: packing does not apply, the run prints one line saying its micro-batches run
    padded; with packing off, or where FSDP or checkpointing rules it out by design, no line."""
    from grpokit.models.tiny import build_tiny_model
    from grpokit.training.setup import build_policy, packing_note

    build_tiny_model(tmp_path, arch="mistral", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    assert '"sliding_window": 4096' in (tmp_path / "config.json").read_text()  # Mistral's default window
    base = _config(tiny_model_dir, "length", True)
    windowed = dataclasses.replace(base, model=dataclasses.replace(base.model, path=str(tmp_path)))
    policy = build_policy(windowed)
    assert not policy.packing
    note = packing_note(windowed, policy)
    assert note.startswith("train.packed_sequences: ") and "run padded" in note
    off = dataclasses.replace(windowed, train=dataclasses.replace(windowed.train, packed_sequences=False))
    assert packing_note(off, policy) is None
    assert packing_note(base, build_policy(base)) is None  # the plain model packs
