"""The decode's oneDNN matmuls on packed weights (`rollout.packed_weights`): the same logits and samples
as the plain path, the modules put back afterwards, the plain path wherever packing does not apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grpokit.models.loading import load_model_and_tokenizer
from grpokit.models.packed import packed_linears
from grpokit.rollout.engines import HFEngine, SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model_and_tokenizer(tiny_model_dir, device="cpu")


def linears(model) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def test_packed_logits_match_the_plain_path_and_the_modules_are_restored(tiny):
    model, _ = tiny
    ids = torch.randint(3, 40, (5, 9))  # [5, 9]
    with torch.inference_mode():
        want = model(input_ids=ids).logits  # [5, 9, V]
        with packed_linears(model, rows=5) as n:
            assert n == len(linears(model)) > 0  # every projection and the head
            assert all("forward" in m.__dict__ for m in linears(model))
            got = model(input_ids=ids).logits
    assert not any("forward" in m.__dict__ for m in linears(model))
    # fp32 accumulation in another order: float32 rounding, no more
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_weights_are_packed_too():
    layer = nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = layer(x)
        with packed_linears(layer, rows=7) as n:
            got = layer(x)
    assert n == 1
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_a_forward_with_gradients_inside_the_block_takes_the_plain_path():
    """The packed copy is detached: a forward that needs gradients must not go through it."""
    layer = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with packed_linears(layer, rows=3) as n:
        assert n == 1
        layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    with torch.no_grad(), packed_linears(layer, rows=3):
        y = layer(x)  # under no_grad: packed
    torch.testing.assert_close(y, x @ layer.weight.detach().T + layer.bias.detach(), rtol=1e-5, atol=1e-6)


def test_modules_are_restored_when_the_block_raises():
    layer = nn.Linear(8, 4)
    with pytest.raises(RuntimeError, match="boom"):
        with packed_linears(layer, rows=2):
            raise RuntimeError("boom")
    assert "forward" not in layer.__dict__


def test_what_cannot_be_packed_runs_as_before():
    class MyLinear(nn.Linear):  # a subclass may have its own forward: left alone
        pass

    model = nn.Sequential(MyLinear(4, 4), nn.Linear(4, 4).to(torch.float64))
    with packed_linears(model, rows=2) as n:
        assert n == 0
    with packed_linears(nn.Linear(4, 4), rows=2, enabled=False) as n:
        assert n == 0


def test_the_engine_samples_the_same_answers_packed_or_not(tiny):
    """Same generator, same prompts: the same tokens (greedy and sampled) and log-probs to float32 rounding."""
    model, tok = tiny
    prompts = [tok("1+2=")["input_ids"], tok("30+4=")["input_ids"]]
    for temperature in (0.0, 1.0):
        s = SamplingParams(max_new_tokens=8, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                           temperature=temperature)
        runs = [HFEngine(model, tok, packed_weights=p).generate(prompts, group_size=4, sampling=s,
                                                                generator=torch.Generator().manual_seed(3))
                for p in (False, True)]
        assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
        torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, rtol=0, atol=1e-5)
    assert not any("forward" in m.__dict__ for m in linears(model))
