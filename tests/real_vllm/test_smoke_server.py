"""The real vLLM server (CPU build) does what grpokit's server engine (rollout/vllm/server.py) relies on: token-id
prompts sampled with a seed and the sampled tokens' processed log-probs (with the temperature), and in-place weight
reloads through the dev endpoint /collective_rpc. Also run against an older vLLM release (`-m vllm_smoke`)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from .conftest import vllm_call

PROMPT = [1, 5, 6, 7, 8, 9]


def _completion(url, model, **kwargs) -> dict:
    payload = {"model": str(model), "prompt": PROMPT, "return_token_ids": True, **kwargs}
    return vllm_call(url, "POST", "/v1/completions", payload)


def _prompt_logprobs(url, model) -> list[float]:
    """The model's log-prob of each prompt token after the first (no sampling involved)."""
    reply = _completion(url, model, max_tokens=1, temperature=1.0, prompt_logprobs=0)
    entries = reply["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT), entries
    return [entry[str(token)]["logprob"] for token, entry in zip(PROMPT[1:], entries[1:])]


@pytest.mark.vllm_smoke
def test_samples_token_ids_with_processed_logprobs(fresh_server, vllm_model_dir):
    from transformers import AutoModelForCausalLM

    temperature, steps = 0.7, 6
    request = dict(n=2, max_tokens=steps, temperature=temperature, top_p=1.0, top_k=-1, seed=1234, logprobs=0,
                   ignore_eos=True, skip_special_tokens=False)
    first = _completion(fresh_server, vllm_model_dir, **request)
    second = _completion(fresh_server, vllm_model_dir, **request)
    choices = sorted(first["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    again = sorted(second["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in again] == [c["token_ids"] for c in choices]  # the seed fixes the samples
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir).float().eval()
    for choice in choices:
        tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        assert len(tokens) == len(logprobs) == steps
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1].double()
        picked = torch.tensor(tokens).unsqueeze(1)
        expected = torch.log_softmax(logits / temperature, -1).gather(1, picked).squeeze(1)
        raw = torch.log_softmax(logits, -1).gather(1, picked).squeeze(1)
        got = torch.tensor(logprobs, dtype=torch.float64)
        # the sampling distribution's log-probs (temperature applied), not the model's raw ones
        assert torch.allclose(got, expected, atol=2e-3), (got, expected)
        assert not torch.allclose(got, raw, atol=2e-3)


@pytest.mark.vllm_smoke
def test_reload_weights_from_a_folder_and_back(fresh_server, vllm_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    base = _prompt_logprobs(fresh_server, vllm_model_dir)
    # the same weights with the (tied) embedding zeroed: every logit 0, every token's log-prob -log(vocab size);
    # the folder holds the weights only: vLLM reads the architecture from the served model, not from here
    weights = load_file(str(vllm_model_dir / "model.safetensors"))
    assert "model.embed_tokens.weight" in weights
    weights["model.embed_tokens.weight"] = torch.zeros_like(weights["model.embed_tokens.weight"])
    save_file(weights, str(tmp_path / "model.safetensors"))
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]

    def reload(folder) -> None:
        reply = vllm_call(fresh_server, "POST", "/collective_rpc",
                          {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
        assert reply == {"results": [None]}, reply
        vllm_call(fresh_server, "POST", "/reset_prefix_cache")

    reload(tmp_path)
    uniform = -math.log(json.loads((vllm_model_dir / "config.json").read_text())["vocab_size"])
    zeroed = _prompt_logprobs(fresh_server, vllm_model_dir)
    assert zeroed == pytest.approx([uniform] * len(base), abs=1e-4)
    assert base != pytest.approx(zeroed, abs=1e-2)
    reload(vllm_model_dir)
    assert _prompt_logprobs(fresh_server, vllm_model_dir) == pytest.approx(base, abs=1e-5)
