"""The rollout engine: exact log-probs, seeds, batching, stopping, row dropping, bad input."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpokit.models.forward import position_ids_from_mask
from grpokit.models.tiny import build_tiny_model
from grpokit.rollout.batch import Rollout
from grpokit.rollout.decode import DecodeSpeed, sample_groups
from grpokit.rollout.request import RolloutRequest, SamplingParams
from grpokit.rollout.sampling import exponential_race, filter_candidates, sample_tokens

PROMPTS = ["1+2=", "What is 17 + 25? Answer:", "hello"]  # mixed lengths → left padding


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen2 + char tokenizer, saved and reloaded the way a user's model is."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    build_tiny_model(path, max_positions=64)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok


@pytest.fixture(scope="module")
def prompts(tiny):
    return [tiny[1].encode(p) for p in PROMPTS]


def rollout(tiny, prompts, *, group_size=2, generator=None, tokenizer=None, speed=DecodeSpeed(), **sampling
            ) -> Rollout:
    model, tok = tiny
    sampling = {"max_new_tokens": 12, "eos_token_ids": (tok.eos_token_id,), "pad_token_id": tok.pad_token_id,
                **sampling}
    request = RolloutRequest(prompts, group_size, SamplingParams(**sampling),
                             generator or torch.Generator().manual_seed(0))
    return sample_groups(model, request, tokenizer=tokenizer, speed=speed)


def recomputed_logprobs(model, r: Rollout, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the chosen tokens, from one forward over prompt + completion."""
    ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)  # [N, P+T]
    mask = torch.cat([r.prompt_mask, r.completion_mask], dim=1)  # [N, P+T]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    p, t = r.prompt_ids.shape[1], r.completion_ids.shape[1]
    logp = (logits[:, p - 1: p - 1 + t] / temperature).log_softmax(-1)  # [N, T, V]
    return logp.gather(2, r.completion_ids[..., None])[..., 0] * r.completion_mask


def first_hit_lengths(completions: torch.Tensor, hit) -> list[int | None]:
    """Per row, 1 + index of the first position where hit(row, j) is true, or None."""
    out = []
    for row in range(completions.shape[0]):
        js = [j for j in range(completions.shape[1]) if hit(row, j)]
        out.append(js[0] + 1 if js else None)
    return out


# ----------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_recomputed(tiny, prompts, temperature):
    r = rollout(tiny, prompts, temperature=temperature, group_size=3)
    assert r.logprobs.dtype == torch.float32
    assert r.completion_mask.sum() > r.num_sequences  # real completions, not just one token
    expected = recomputed_logprobs(tiny[0], r, temperature)
    torch.testing.assert_close(r.logprobs, expected, atol=1e-4, rtol=0)
    assert (r.logprobs[r.completion_mask == 0] == 0).all()


def test_logprobs_ignore_top_k_filter(tiny, prompts):
    r = rollout(tiny, prompts, temperature=0.9, top_k=5, top_p=0.8)
    torch.testing.assert_close(r.logprobs, recomputed_logprobs(tiny[0], r, 0.9), atol=1e-4, rtol=0)


def test_shapes_and_layout(tiny, prompts):
    r = rollout(tiny, prompts, group_size=4)
    n, p = 3 * 4, max(map(len, prompts))
    assert r.num_sequences == n and r.prompt_ids.shape == (n, p) == r.prompt_mask.shape
    assert r.completion_ids.shape == r.completion_mask.shape == r.logprobs.shape
    assert r.completion_ids.shape[1] == int(r.completion_lengths.max()) <= 12
    for b, ids in enumerate(prompts):  # rows b*G .. b*G+G-1 hold prompt b, left-padded
        for row in range(b * 4, b * 4 + 4):
            assert r.prompt_ids[row, p - len(ids):].tolist() == ids
            assert r.prompt_mask[row].tolist() == [0] * (p - len(ids)) + [1] * len(ids)
    assert r.sequence_ids.shape == r.sequence_mask.shape == (n, p + r.completion_ids.shape[1])
    pos = position_ids_from_mask(r.sequence_mask)
    assert (pos[:, -1] == r.sequence_mask.sum(-1) - 1).all()


def test_outputs_usable_in_autograd(tiny, prompts):
    r = rollout(tiny, prompts)
    logits = torch.randn(*r.completion_ids.shape, 99, requires_grad=True)
    picked = logits.log_softmax(-1).gather(2, r.completion_ids[..., None])  # not inference tensors
    (picked[..., 0] * r.completion_mask).sum().backward()
    assert logits.grad is not None


def test_model_mode_restored(tiny, prompts):
    model = tiny[0]
    model.train()
    try:
        rollout(tiny, prompts)
        assert model.training
    finally:
        model.eval()


# ----------------------------------------------------------------------------- seeds, batching


def test_same_seed_same_samples_different_seed_different(tiny, prompts):
    a = rollout(tiny, prompts, generator=torch.Generator().manual_seed(7))
    b = rollout(tiny, prompts, generator=torch.Generator().manual_seed(7))
    c = rollout(tiny, prompts, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids[:, 0], c.completion_ids[:, 0])


def test_group_samples_differ(tiny, prompts):
    r = rollout(tiny, prompts, group_size=4)
    first = r.completion_ids[0:4, :3].tolist()  # the same prompt's samples are not copies
    assert len({tuple(x) for x in first}) > 1


@pytest.mark.parametrize("eos_offset", [None, 3])
def test_batched_equals_per_prompt_greedy(tiny, prompts, eos_offset):
    eos = tiny[1].eos_token_id
    if eos_offset is not None:  # a token greedy decoding emits, so rows end at different steps
        eos = int(rollout(tiny, prompts, temperature=0).completion_ids[2, eos_offset])
    batched = rollout(tiny, prompts, temperature=0, eos_token_ids=(eos,), group_size=2)
    for b, p in enumerate(prompts):
        single = rollout(tiny, [p], temperature=0, eos_token_ids=(eos,), group_size=2)
        t = single.completion_ids.shape[1]
        rows = slice(2 * b, 2 * b + 2)
        assert torch.equal(batched.completion_ids[rows, :t], single.completion_ids)
        assert torch.equal(batched.completion_mask[rows, :t], single.completion_mask)
        assert batched.completion_mask[rows, t:].sum() == 0
        assert torch.equal(batched.truncated[rows], single.truncated)
        torch.testing.assert_close(batched.logprobs[rows, :t], single.logprobs, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- stopping


def test_eos_ends_row_and_is_masked_in(tiny, prompts):
    free = rollout(tiny, prompts, temperature=0, eos_token_ids=())
    assert free.truncated.all() and (free.completion_lengths == 12).all()
    eos = int(free.completion_ids[0, 4])  # a token row 0 emits at step 4 (maybe earlier too)
    r = rollout(tiny, prompts, temperature=0, eos_token_ids=(eos, 10**6))
    expected = first_hit_lengths(free.completion_ids, lambda i, j: free.completion_ids[i, j] == eos)
    assert expected[0] is not None
    for row, length in enumerate(expected):
        got = int(r.completion_lengths[row])
        assert got == (length or 12) and bool(r.truncated[row]) == (length is None)
        assert r.completion_ids[row, :got].tolist() == free.completion_ids[row, :got].tolist()
        if length is not None:
            assert r.completion_ids[row, got - 1] == eos  # the EOS itself is in, masked 1
        width = r.completion_ids.shape[1]
        assert r.completion_mask[row].tolist() == [1] * got + [0] * (width - got)
        assert (r.completion_ids[row, got:] == tiny[1].pad_token_id).all()


def test_ignore_eos_gives_full_length(tiny, prompts):
    every_token = list(range(len(tiny[1])))  # every step would end every row
    assert (rollout(tiny, prompts, eos_token_ids=every_token).completion_lengths == 1).all()
    r = rollout(tiny, prompts, eos_token_ids=every_token, ignore_eos=True)
    assert (r.completion_lengths == 12).all() and r.truncated.all()


def test_stop_strings_stop_generation(tiny, prompts):
    model, tok = tiny
    free = rollout(tiny, prompts, temperature=0, eos_token_ids=())
    text0 = tok.decode(free.completion_ids[0], skip_special_tokens=True)
    stop = text0[3:5]
    r = rollout(tiny, prompts, temperature=0, eos_token_ids=(), stop_strings=(stop, "@@@@"),
                tokenizer=tok)

    def hit(i, j):
        return stop in tok.decode(free.completion_ids[i, : j + 1], skip_special_tokens=True)

    expected = first_hit_lengths(free.completion_ids, hit)
    assert expected[0] is not None and expected[0] < 12
    assert r.completion_lengths.tolist() == [e or 12 for e in expected]
    assert r.truncated.tolist() == [e is None for e in expected]
    for row, e in enumerate(expected):
        kept = r.completion_ids[row, : int(r.completion_lengths[row])]
        if e is not None:
            assert tok.decode(kept, skip_special_tokens=True).endswith(stop)  # stop token kept


# ----------------------------------------------------------------------------- filtering


def test_top_k_1_and_tiny_top_p_equal_greedy(tiny, prompts):
    greedy = rollout(tiny, prompts, temperature=0)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        r = rollout(tiny, prompts, temperature=1.0, **kw)
        assert torch.equal(r.completion_ids, greedy.completion_ids)
        torch.testing.assert_close(r.logprobs, greedy.logprobs, atol=1e-5, rtol=0)


def test_samples_stay_inside_top_k_and_nucleus(tiny, prompts):
    model = tiny[0]
    for kw in (dict(top_k=3), dict(top_p=0.3), dict(top_k=10, top_p=0.5)):
        r = rollout(tiny, prompts, temperature=1.0, group_size=4, **kw)
        logp = recomputed_logprobs(model, r, 1.0)  # [N, T]
        ids, mask = r.sequence_ids, r.sequence_mask
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask,
                           position_ids=position_ids_from_mask(mask)).logits.float()
        p = r.prompt_ids.shape[1]
        probs = logits[:, p - 1: -1].softmax(-1)  # [N, T, V]
        chosen = logp.exp()[..., None]
        rank = (probs > chosen + 1e-6).sum(-1)  # tokens strictly more likely than the chosen one
        real = r.completion_mask.bool()
        if "top_k" in kw:
            assert (rank[real] < kw["top_k"]).all()
        if "top_p" in kw and "top_k" not in kw:
            mass_before = (probs * (probs > chosen + 1e-6)).sum(-1)
            assert (mass_before[real] < kw["top_p"] + 1e-5).all()


def test_filter_candidates_by_hand():
    z = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    vals, idx = filter_candidates(z, top_k=0, top_p=0.65)  # 0.4 + 0.3 reaches 0.65
    assert idx.tolist() == [[1, 3, 2, 0]]
    assert torch.isfinite(vals).tolist() == [[True, True, False, False]]
    vals, idx = filter_candidates(z, top_k=3, top_p=1.0)
    assert idx.tolist() == [[1, 3, 2]] and torch.isfinite(vals).all()
    vals, idx = filter_candidates(z, top_k=2, top_p=0.5)  # renormalised: 4/7 ≥ 0.5 alone
    assert torch.isfinite(vals).tolist() == [[True, False]]


@pytest.mark.parametrize("kw, probs", [
    (dict(), [0.1, 0.4, 0.2, 0.3]),
    (dict(temperature=0.5), [1 / 30, 16 / 30, 4 / 30, 9 / 30]),
    (dict(top_k=2), [0, 4 / 7, 0, 3 / 7]),
    (dict(top_p=0.65), [0, 4 / 7, 0, 3 / 7]),
])
def test_gumbel_sampler_matches_distribution(kw, probs):
    n = 40_000
    z = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]])).expand(n, 4)
    tokens, logp = sample_tokens(z, **{"temperature": 1.0, **kw},
                                 generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4).float() / n
    torch.testing.assert_close(freq, torch.tensor(probs), atol=0.01, rtol=0)
    t = kw.get("temperature", 1.0)
    torch.testing.assert_close(logp, (z / t).log_softmax(-1).gather(1, tokens[:, None])[:, 0])


def test_exponential_race_never_picks_zero_weight():
    w = torch.tensor([[0.0, 1.0, 0.0, 2.0]]).expand(5000, 4)
    picks = exponential_race(w, torch.Generator().manual_seed(0))
    assert set(picks.tolist()) == {1, 3}


# ----------------------------------------------------------------------------- cost


def record_batch_shapes(model):
    shapes = []
    handle = model.register_forward_pre_hook(
        lambda mod, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    return shapes, handle


def test_prefill_on_b_rows_and_finished_rows_dropped(tiny, prompts):
    model, tok = tiny
    shapes, handle = record_batch_shapes(model)
    try:  # a third of the vocabulary ends a row: rows finish at many different steps
        r = rollout(tiny, prompts, group_size=4, eos_token_ids=list(range(3, 35)),
                    max_new_tokens=16)
    finally:
        handle.remove()
    lengths = r.completion_lengths
    assert shapes[0] == (3, max(map(len, prompts)))  # prefill: B rows, not N = 12
    assert len(shapes) == int(lengths.max())  # no forward after the last token is sampled
    decode_rows = [s[0] for s in shapes[1:]]
    assert all(s[1] == 1 for s in shapes[1:])
    assert decode_rows == [int((lengths > t).sum()) for t in range(1, len(shapes))]
    assert decode_rows[-1] < 12  # some rows really were dropped


def test_no_forward_after_all_rows_finished(tiny, prompts):
    model, tok = tiny
    shapes, handle = record_batch_shapes(model)
    try:
        r = rollout(tiny, prompts, eos_token_ids=list(range(len(tok))))
    finally:
        handle.remove()
    assert len(shapes) == 1 and (r.completion_lengths == 1).all() and not r.truncated.any()


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kw, match", [
    (dict(prompt_ids=[]), "prompt_ids is empty"),
    (dict(prompt_ids=[[5, 6], []]), "prompt 1 is empty"),
    (dict(group_size=0), "group_size must be >= 1"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(prompt_ids=[[5], [5] * 60], max_new_tokens=8),
     "prompt 1 has 60 tokens.*max_position_embeddings=64"),
    (dict(stop_strings=["x"]), "stop_strings need a tokenizer"),
    (dict(prompt_ids=[[5, 10_000]]), "prompt 0 has a token id outside the vocabulary"),
])
def test_bad_inputs_raise(tiny, prompts, kw, match):
    args = {"prompt_ids": prompts, **kw}
    with pytest.raises(ValueError, match=match):
        rollout(tiny, args.pop("prompt_ids"), **args)


def test_prompt_exactly_at_position_limit_is_accepted(tiny):
    r = rollout(tiny, [[5] * 56], max_new_tokens=8, eos_token_ids=())
    assert r.completion_ids.shape == (2, 8)


def test_old_keyword_spelling_warns_and_samples_the_same(tiny, prompts):
    """`sample_groups(model, prompt_ids, group_size=..., ...)` (before `RolloutRequest`) still works, warning."""
    model, tok = tiny
    with pytest.warns(DeprecationWarning, match="RolloutRequest"):
        old = sample_groups(model, prompts, group_size=2, max_new_tokens=12, eos_token_ids=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, temperature=0.9, top_k=5, stop_strings=["@@"],
                            tokenizer=tok, generator=torch.Generator().manual_seed(0), sampler="gumbel",
                            share_prefill=False)
    new = rollout(tiny, prompts, temperature=0.9, top_k=5, stop_strings=("@@",), tokenizer=tok,
                  speed=DecodeSpeed(sampler="gumbel", share_prefill=False))
    for a, b in zip(old.__dict__.values(), new.__dict__.values()):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
