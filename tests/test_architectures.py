"""grpokit on the decoder families people fine-tune: one tiny random model per architecture.

Each architecture is a tiny config (2 layers, hidden 32) saved with
`save_pretrained` and reloaded with `from_pretrained` beside the char
tokenizer, so the same loading path as a user's model is exercised. The
`arch_model_dir` fixture gives that folder for each architecture; a test that
takes it runs once per architecture.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import make_config, parity
from grpokit.models.tiny import build_char_tokenizer
from grpokit.rollout.decode import sample_groups
from grpokit.rollout.request import RolloutRequest, SamplingParams
from test_rollout import recomputed_logprobs  # the independent recompute, shared with the rollout tests

PROMPTS = ["1+2=", "What is 17 + 25?", "hi"]  # mixed lengths → left padding
# Sharper than the default init (0.02), so that a wrong position or mask moves
# the log-probs by far more than the 1e-4 tolerance.
INIT = 0.2
ROPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=INIT)

ARCHS = {
    "llama": lambda: transformers.LlamaConfig(**ROPE, head_dim=8),
    "qwen2": lambda: transformers.Qwen2Config(**ROPE),
    "qwen3": lambda: transformers.Qwen3Config(**ROPE, head_dim=8),
    # A window shorter than prompt + completion, so the sliding-window cache layers are used.
    "mistral": lambda: transformers.MistralConfig(**ROPE, head_dim=8, sliding_window=12),
    "gemma": lambda: transformers.GemmaConfig(**ROPE, head_dim=8),
    "phi3": lambda: transformers.Phi3Config(**ROPE),
    # Absolute learned positions and dropout 0.1: wrong positions or train-mode sampling show.
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                            initializer_range=INIT),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, initializer_range=INIT),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def arch_model_dir(arch, tmp_path_factory) -> Path:
    """A saved tiny random model of `arch` with the char tokenizer, in Hugging Face format."""
    path = tmp_path_factory.mktemp(arch)
    tok = build_char_tokenizer(path)
    config = ARCHS[arch]()
    config.vocab_size = len(tok)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = (
        tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def load(path: Path):
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_rollout_logprobs_equal_recomputed(arch_model_dir):
    model, tok = load(arch_model_dir)
    model.train()  # sampling must switch dropout off by itself
    r = sample_groups(model, RolloutRequest(
        [tok.encode(p) for p in PROMPTS], 3, SamplingParams(
            10, tuple(range(3, 15)),  # frequent enough that rows finish and get dropped
            tok.pad_token_id, temperature=0.8), torch.Generator().manual_seed(0)))
    assert model.training
    model.eval()
    lengths = r.completion_lengths
    assert r.num_sequences == 9 and lengths.min() < lengths.max()  # rows ended at different steps
    torch.testing.assert_close(r.logprobs, recomputed_logprobs(model, r, 0.8), atol=1e-4, rtol=0)


def test_batched_greedy_equals_per_prompt(arch_model_dir):
    model, tok = load(arch_model_dir)
    prompts = [tok.encode(p) for p in PROMPTS]
    sampling = SamplingParams(8, pad_token_id=tok.pad_token_id, temperature=0.0)
    batched = sample_groups(model, RolloutRequest(prompts, 1, sampling))
    for b, p in enumerate(prompts):
        single = sample_groups(model, RolloutRequest([p], 1, sampling))
        assert batched.completion_ids[b].tolist() == single.completion_ids[0].tolist()
        torch.testing.assert_close(batched.logprobs[b], single.logprobs[0], atol=1e-4, rtol=0)


def test_one_training_step_changes_the_weights(arch_model_dir, tmp_path):
    """The whole loop (rollout, rewards, scoring through the chunked head or the model's own
    logits, backward, optimizer step, checkpoint) runs on every decoder family, with β > 0 and μ = 2
    so the reference and old-logprob passes run too."""
    from safetensors.torch import load_file

    from grpokit.training.loop import train

    config = make_config(arch_model_dir, tmp_path / "run", steps=1, num_prompts=16, prompts_per_step=2,
                         max_new_tokens=4, algorithm={"beta": 0.04, "num_iterations": 2})
    run = train(config, reward_functions=[parity])
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["grad_norm"] > 0 and row["kl"] >= 0
    before = {k: v for k, v in load_file(str(next(arch_model_dir.glob("*.safetensors")))).items()}
    after = load_file(str(next((run / "checkpoint-1").glob("*.safetensors"))))
    assert any(not torch.equal(before[k], after[k]) for k in before if k in after)
