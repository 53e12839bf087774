"""LoRA through peft on the tiny model: adapters train, the reference is the base (adapters off,
no second copy), checkpoints hold the adapter and a merged model, resume is exact."""

from __future__ import annotations

from functools import partial

import pytest
import torch

peft = pytest.importorskip("peft")

import grpokit.training.setup as setup_mod  # noqa: E402
from conftest import comparable, make_config, parity  # noqa: E402
from grpokit.config.schema import ModelConfig  # noqa: E402
from grpokit.errors import ConfigError  # noqa: E402
from grpokit.models.forward import completion_logprobs  # noqa: E402
from grpokit.models.loading import load_model  # noqa: E402
from grpokit.models.lora import AdapterDisabled, adapter_of, apply_lora, merged_state_dict, trainable_parameters  # noqa: E402
from grpokit.observe.tracking import read_metrics  # noqa: E402
from grpokit.training.loop import train  # noqa: E402

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}


# This file's runs: LoRA on the CPU with a reference (beta > 0), 32 prompts taken 2 a step.
lora_config = partial(make_config, num_prompts=32, prompts_per_step=2, learning_rate=1e-2,
                      model={"device": "cpu", "lora": LORA}, algorithm={"beta": 0.04})


def _randomise_adapters(model):
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)


def _logprobs(model, seq=(5, 6, 7, 8), completion=(9, 10, 11)):
    ids, mask = torch.tensor([list(seq)]), torch.ones(1, len(seq), dtype=torch.long)
    comp, cmask = torch.tensor([list(completion)]), torch.ones(1, len(completion), dtype=torch.long)
    with torch.no_grad():
        return completion_logprobs(model, ids, mask, comp, cmask)[0]


def test_adapters_train_the_reference_is_the_base_without_a_second_copy(tiny_model_dir, tmp_path, monkeypatch):
    loads = []
    real_load = setup_mod.load_model
    monkeypatch.setattr(setup_mod, "load_model", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    run = train(lora_config(tiny_model_dir, tmp_path / "r"), reward_functions=[parity])
    assert len(loads) == 1  # β > 0 and no reference model loaded: the adapters are switched off instead
    rows = read_metrics(run)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-9) and rows[1]["kl"] > 0  # adapters start at zero (B = 0)
    ckpt = run / "checkpoint-2"
    assert (ckpt / "adapter" / "adapter_config.json").is_file()

    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    merged = AutoModelForCausalLM.from_pretrained(ckpt)
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ckpt / "adapter")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(base(input_ids=ids).logits, want, atol=1e-4)
    b, m = base.state_dict(), merged.state_dict()
    changed = {k for k in b if not torch.equal(b[k], m[k])}
    assert changed and all(any(t in k for t in LORA["target_modules"]) for k in changed)  # only adapted layers


def test_adapter_disabled_view_scores_with_the_base_weights(tiny_model_dir):
    base = load_model(tiny_model_dir, device="cpu")
    model = apply_lora(load_model(tiny_model_dir, device="cpu"), LORA)
    _randomise_adapters(model)
    trainable, total = trainable_parameters(model)
    assert 0 < trainable < total / 5
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    ref = AdapterDisabled(model)
    torch.testing.assert_close(_logprobs(ref), _logprobs(base))
    assert not torch.allclose(_logprobs(model), _logprobs(base), atol=1e-4)  # the adapters are on again after
    assert ref.device == model.device and adapter_of(model) is not None
    merged = merged_state_dict(adapter_of(model))
    base.load_state_dict(merged)
    torch.testing.assert_close(_logprobs(base), _logprobs(model), atol=1e-5, rtol=1e-5)


def test_lora_resume_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path):
    straight = train(lora_config(tiny_model_dir, tmp_path / "s", steps=2), reward_functions=[parity])
    train(lora_config(tiny_model_dir, tmp_path / "r", steps=1, output={"save_every": 1}), reward_functions=[parity])
    resumed = train(lora_config(tiny_model_dir, tmp_path / "r", steps=2, output={"save_every": 1}),
                    reward_functions=[parity], resume=True)
    assert comparable(read_metrics(straight)) == comparable(read_metrics(resumed))
    from safetensors.torch import load_file

    a = load_file(str(straight / "checkpoint-2" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "checkpoint-2" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_config_errors():
    with pytest.raises(ConfigError, match="model.lora: unknown key"):
        ModelConfig(path="m", lora={"rank": 8})
    with pytest.raises(ConfigError, match="model.lora.r: must be an integer >= 1"):
        ModelConfig(path="m", lora={"r": 0})
    with pytest.raises(ValueError, match="needs a model with LoRA adapters"):
        AdapterDisabled(torch.nn.Linear(2, 2))


def test_a_peft_model_given_as_such_is_one_error_naming_both_ways(tiny_model_dir, tmp_path):
    """train(model=PeftModel) crashed in the first forward (a PeftModel returns no `last_hidden_state`)."""
    from peft import LoraConfig, get_peft_model

    from grpokit.errors import SetupError

    peft_model = get_peft_model(load_model(str(tiny_model_dir)), LoraConfig(r=2, target_modules=["q_proj"]))
    for lora in ({}, {"r": 2}):
        config = make_config(tiny_model_dir, tmp_path / "run", steps=1, model={"lora": lora})
        with pytest.raises(SetupError, match=r"^train\(model=...\): a peft PeftModel is given; pass the model without "
                                             r"adapters and set model.lora .* grpokit.trl.GRPOTrainer"):
            train(config, reward_functions=[parity], model=peft_model)
    assert not list((tmp_path / "run").glob("checkpoint-*"))
