"""rollout/layer_loop.py: one-token decode steps as a plain loop over a Llama-family model's layers.

The loop must be the model's own computation: the same samples and log-probs as decoding through the
model (left-padded prompts, answers ending at EOS so rows leave the batch, the oneDNN packed weights),
and it must step aside wherever it would not be (another architecture, LoRA layers, hooks, a sliding
window, transformers' own cache)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from grpokit.models.loading import load_model, load_tokenizer
from grpokit.models.onednn import packed_linears
from grpokit.models.tiny import build_tiny_model
from grpokit.rollout.decode import Decoder, DecodeSpeed, sample_groups
from grpokit.rollout.layer_loop import LayerLoop, layer_loop_for
from grpokit.rollout.request import RolloutRequest, SamplingParams

PROMPTS = ["12+7=", "3+45=", "100+100="]  # different lengths: left padding in the attention mask


def _sample(model, tok, layer_loop: bool, packed: bool = False, **kw):
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    with packed_linears(model, 3 * 4, packed):
        request = RolloutRequest(ids, 4, SamplingParams(24, (tok.eos_token_id,), tok.pad_token_id, temperature=1.0),
                                 torch.Generator().manual_seed(3))
        return sample_groups(model, request, speed=DecodeSpeed(layer_loop=layer_loop, **kw))


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_and_tok(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"loop-{request.param}")
    build_tiny_model(path, arch=request.param, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=0)
    return load_model(path, device="cpu"), load_tokenizer(path)


@pytest.mark.parametrize("packed", [False, True], ids=["aten", "onednn_packed"])
def test_the_layer_loop_samples_what_the_model_samples(model_and_tok, packed):
    model, tok = model_and_tok
    assert layer_loop_for(model, Decoder(model, capacity=64).cache) is not None  # it runs here
    with_model = _sample(model, tok, layer_loop=False, packed=packed)
    with_loop = _sample(model, tok, layer_loop=True, packed=packed)
    assert with_model.completion_mask.sum(-1).tolist() == with_loop.completion_mask.sum(-1).tolist()
    assert torch.equal(with_model.completion_ids, with_loop.completion_ids)
    torch.testing.assert_close(with_loop.logprobs, with_model.logprobs, rtol=0, atol=1e-5)
    assert (with_loop.completion_mask.sum(-1) < 24).any(), "some answers end early (rows leave the batch)"


def test_the_layer_loop_logits_match_the_model_step_by_step(model_and_tok):
    """Prefill through the model, then each step through both: the next-token logits agree to float rounding."""
    model, tok = model_and_tok
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])  # row 1 left-padded
    mask = (ids != 0).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        steps = [Decoder(model, capacity=16, layer_loop=flag) for flag in (False, True)]
        assert steps[0].layer_loop is None and steps[1].layer_loop is not None
        for step in steps:
            step(ids, mask, positions)
        token, pos = torch.tensor([[11], [12]]), positions[:, -1:] + 1
        for _ in range(5):
            mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
            a, b = (step(token, mask, pos) for step in steps)
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            token, pos = a.argmax(-1, keepdim=True), pos + 1


@pytest.mark.parametrize("packed", [False, True], ids=["aten", "onednn_packed"])
def test_a_bf16_model_steps_through_the_loop_with_sdpa_attention(model_and_tok, packed):
    """bf16 weights: the loop keeps SDPA for the attention (scores in float32 inside the kernel), with the
    left-padding mask; its next-token logits agree with the model's to bf16 rounding, step by step."""
    from grpokit.models.onednn import kernel_available

    if packed and not kernel_available(torch.bfloat16):
        pytest.skip("no oneDNN bf16 linear kernel on this CPU")
    model = model_and_tok[0]
    model = type(model)(model.config).to(torch.bfloat16).eval()
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in model_and_tok[0].state_dict().items()})
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])  # row 1 left-padded
    mask = (ids != 0).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode(), packed_linears(model, 2, packed):
        steps = [Decoder(model, capacity=16, layer_loop=flag) for flag in (False, True)]
        assert steps[1].layer_loop is not None
        for step in steps:
            step(ids, mask, positions)
        token, pos = torch.tensor([[11], [12]]), positions[:, -1:] + 1
        for _ in range(4):
            mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
            a, b = (step(token, mask, pos).float() for step in steps)
            assert (a - b).abs().max() <= 0.05 * a.abs().max()  # bf16 rounding, not a different computation
            token, pos = a.argmax(-1, keepdim=True), pos + 1


def test_the_layer_loop_steps_aside_where_it_is_not_the_models_computation(model_and_tok, tmp_path):
    model, _ = model_and_tok
    preallocated = Decoder(model, capacity=32).cache
    assert layer_loop_for(model, DynamicCache(config=model.config)) is None  # transformers' concatenating cache
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)  # a hook must see its calls
    try:
        assert layer_loop_for(model, preallocated) is None
    finally:
        handle.remove()
    assert layer_loop_for(model, preallocated) is not None
    model.config._attn_implementation = "eager"  # another kernel: its rounding is the model's own
    try:
        assert layer_loop_for(model, preallocated) is None
    finally:
        model.config._attn_implementation = "sdpa"
    if model.config.model_type != "qwen2":  # (Llama has no sliding window)
        return
    window = model.config.sliding_window, model.config.use_sliding_window
    model.config.sliding_window, model.config.use_sliding_window = 8, True
    try:
        assert layer_loop_for(model, preallocated) is None
    finally:
        model.config.sliding_window, model.config.use_sliding_window = window


def test_lora_layers_decode_through_the_model(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_model(tiny_model_dir, device="cpu"),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    base = model.get_base_model()
    assert layer_loop_for(base, Decoder(base, capacity=32).cache) is None  # q_proj is a LoRA layer now
    assert layer_loop_for(model, Decoder(model, capacity=32).cache) is None


def test_other_architectures_decode_through_the_model(tmp_path):
    path = tmp_path / "gpt2"
    build_tiny_model(path, arch="gpt2", hidden_size=32, num_layers=2, num_heads=4, seed=0)
    model = load_model(path, device="cpu")
    assert layer_loop_for(model, Decoder(model, capacity=32).cache) is None


def test_multi_turn_sampling_is_the_same_with_the_layer_loop(tiny_model_dir, monkeypatch):
    """The multi-turn sampler's one-token steps take the loop (masks with holes, compacted caches); tool results
    of several tokens go through the model. Same conversations, same log-probs."""
    from grpokit.rollout.multiturn import sample_conversations
    from grpokit.rollout.tools import ToolBox, ToolCall

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    model, tok = load_model(tiny_model_dir, device="cpu"), load_tokenizer(tiny_model_dir)
    digits = [tok.convert_tokens_to_ids(d) for d in "0123456789="]
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]

    def sample(layer_loop: bool):
        request = RolloutRequest(ids, 3, SamplingParams(24, tuple(digits), tok.pad_token_id),
                                 torch.Generator().manual_seed(0), tools=ToolBox([add]))
        return sample_conversations(
            model, request, tokenizer=tok, max_tool_turns=2, speed=DecodeSpeed(layer_loop=layer_loop),
            parse_calls=lambda text, **_: [ToolCall("add", {"a": len(text), "b": 1})],
            render_results=lambda results: tok.encode("<" + ",".join(r.content for r in results) + ">",
                                                      add_special_tokens=False))

    (a, stats) = sample(False)
    calls = []
    real = LayerLoop.__call__
    monkeypatch.setattr(LayerLoop, "__call__", lambda self, *x: calls.append(1) or real(self, *x))
    b, _ = sample(True)
    assert max(stats.turns) > 1 and len(calls) > 10  # tool results were fed; the sampled tokens took the loop
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.tool_mask, b.tool_mask)
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-5)
