"""`train.gradient_checkpointing`: each decoder layer keeps only its input and runs again in the
backward. The loss and gradients are those of the plain path for every loss shape (per token, per
answer, sequence ratio, KL; fused head with its one-pass backward or not), the layers really run twice
under gradients and not at all twice without them, far fewer bytes are kept for the backward, and a
run with it trains to the same weights as one without."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_config, parity
from grpokit.errors import SetupError
from grpokit.models import checkpointing
from grpokit.models.checkpointing import decoder_layers, enable_activation_checkpointing
from grpokit.models.forward import ForwardOptions, completion_logprobs
from grpokit.models.loading import load_model
from grpokit.training.loop import train
from test_fast_paths import CASES, _batch, _config, _loss_and_grads, _rollout

# The checkpointed path replays the same kernels on the same inputs, and runs without the shared prompt
# forward; its gradients are compared with the plain path's run the same way (shared_prompt_forward off).


@pytest.fixture
def pair(tiny_model_dir):
    """The same tiny model twice: plain, and with every decoder layer checkpointed."""
    from grpokit.models.loading import load_tokenizer

    plain = load_model(tiny_model_dir, device="cpu").eval()
    checked = load_model(tiny_model_dir, device="cpu").eval()
    assert enable_activation_checkpointing(checked) == 2
    return plain, checked, load_tokenizer(tiny_model_dir)


@pytest.mark.parametrize("algo", CASES + [dict(loss_type="sapo"), dict(loss_type="vespo")])
@pytest.mark.parametrize("regime", ["on_policy", "off_policy", "kl"])
@pytest.mark.parametrize("fused", [True, False])
def test_loss_and_gradients_match_the_plain_path(pair, tiny_model_dir, algo, regime, fused):
    plain, checked, tok = pair
    beta = 0.04 if regime == "kl" else 0.0
    batch = _batch(_rollout((plain, tok)), off_policy=regime != "on_policy", ref=beta > 0)
    config = _config(tiny_model_dir, fused=fused, skip=True, beta=beta, **algo)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, shared_prompt_forward=False))
    (loss_a, stats_a, grads_a) = _loss_and_grads(config, plain, batch)
    (loss_b, stats_b, grads_b) = _loss_and_grads(config, checked, batch)
    assert loss_b == pytest.approx(loss_a, rel=1e-6, abs=1e-8)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], atol=1e-7, rtol=1e-5)


def _attention_calls(model, fn):
    calls = []
    hooks = [layer.self_attn.register_forward_hook(lambda *a: calls.append(1)) for layer in decoder_layers(model)]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return len(calls)


def test_layers_run_again_in_the_backward_only_under_gradients(pair):
    plain, checked, tok = pair
    r = _rollout((plain, tok))
    args = (r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)

    def step(model, share):
        def run():
            logp, _ = completion_logprobs(model, *args, options=ForwardOptions(share_prompts=share))
            logp.sum().backward()
        return run

    assert _attention_calls(plain, step(plain, False)) == 2  # 2 layers, once each
    assert _attention_calls(checked, step(checked, False)) == 4  # forward + the backward's replay
    with torch.no_grad():  # sampling and scoring: no replay, and the KV cache works as before
        assert _attention_calls(checked, lambda: completion_logprobs(checked, *args)) == 4  # prompt + answers pass
        expected, _ = completion_logprobs(plain, *args)
        torch.testing.assert_close(completion_logprobs(checked, *args)[0], expected)


def _bytes_saved_for_backward(model, args) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = completion_logprobs(model, *args, options=ForwardOptions(share_prompts=False, fused=False))
    logp.sum().backward()
    return total


def test_far_fewer_bytes_are_kept_for_the_backward(tmp_path):
    from grpokit.models.tiny import build_tiny_model

    build_tiny_model(tmp_path / "m", hidden_size=64, num_layers=6, num_heads=4, num_kv_heads=2, seed=0)
    plain = load_model(tmp_path / "m", device="cpu").eval()
    checked = load_model(tmp_path / "m", device="cpu").eval()
    enable_activation_checkpointing(checked)
    gen = torch.Generator().manual_seed(0)
    N, P, T = 8, 8, 64
    args = (torch.randint(3, 90, (N, P), generator=gen), torch.ones(N, P, dtype=torch.long),
            torch.randint(3, 90, (N, T), generator=gen), torch.ones(N, T, dtype=torch.long))
    kept_plain, kept_checked = _bytes_saved_for_backward(plain, args), _bytes_saved_for_backward(checked, args)
    # the layer inputs (6 x [N, P+T, H]) and the head's chunks remain; every layer's inside goes
    assert kept_checked < 0.25 * kept_plain, (kept_checked, kept_plain)


def test_a_run_with_it_trains_to_the_weights_of_a_run_without(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    def run(name, **train_options):
        config = make_config(tiny_model_dir, tmp_path / name, num_prompts=16, prompts_per_step=2,
                             model={"device": "cpu"},
                             train={"steps": 2, "learning_rate": 1e-2, "shared_prompt_forward": False, **train_options})
        return load_file(str(train(config, reward_functions=[parity]) / "checkpoint-2" / "model.safetensors"))

    plain, checked = run("plain"), run("checked", gradient_checkpointing=True)
    assert plain.keys() == checked.keys()
    for k in plain:
        torch.testing.assert_close(checked[k], plain[k], atol=1e-6, rtol=1e-5)


def test_a_model_without_checkpointable_layers_is_one_error(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointing, "decoder_layers", lambda model: [])
    config = make_config(tiny_model_dir, tmp_path / "run", num_prompts=16, prompts_per_step=2,
                         model={"device": "cpu"}, train={"steps": 1, "gradient_checkpointing": True})
    with pytest.raises(SetupError, match="train.gradient_checkpointing: .* set it to false"):
        train(config, reward_functions=[parity])
    assert not (tmp_path / "run" / "checkpoint-1").exists()
