"""Reward models (a sequence-classification folder) as reward functions: grpokit.rewards.reward_model.

1. A tiny Llama reward model whose score is known by hand: the decoder layers add nothing (o_proj and
   down_proj are zero), so the final hidden state is the last token's embedding; every embedding is +-1
   (its RMS is exactly 1, so the final norm, with eps 0, leaves it as it is): a constant +1 and then the
   token id's 7 bits as +-1; the score head weighs them so that the score is the token id of the last
   token that is not padding. The char tokenizer's ids: <pad> 0, <bos> 1, <eos> 2, '0'..'9' 3..12,
   'a'..'z' 13..38, 'A'..'Z' 39..64, punctuation 65..96 ('?' 85), ' ' 97, '\\n' 98.
2. Parity with TRL 1.16: `GRPOTrainer._calculate_rewards` itself, run on a stand-in trainer, scores the
   same texts of a random reward model (plain and chat prompts, different lengths, padding, chunks).
3. Folders that are no reward model: one RewardLoadError line naming the folder.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from grpokit.errors import RewardLoadError
from grpokit.models.tiny import build_char_tokenizer, build_tiny_model
from grpokit.rewards.core import RewardSpec, compute_rewards
from grpokit.rewards.reward_model import (
    RewardModel,
    check_reward_model_folder,
    is_reward_model_folder,
    load_reward_model,
)

# The score head: 63.5 on the constant +1, 2**(k-1) on bit k's +-1: sum = 63.5 + (id - 63.5) = id.
HEAD = [63.5, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]


def _save_seq_cls(path, *, num_labels=1, hidden=8, seed=0, tokenizer=True, bits=False, arch="llama",
                  vocab_size=None):
    """A tiny LlamaForSequenceClassification (or GPT2ForSequenceClassification) + char tokenizer at `path`.
    The GPT-2 one's tokenizer adds <bos> as special token (which the reward texts must not get). `vocab_size`:
    the embedding's rows (default: the tokenizer's size)."""
    from tokenizers import processors
    from transformers import AutoConfig, AutoModelForSequenceClassification

    tok = build_char_tokenizer()
    if arch == "gpt2":
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if arch == "gpt2":  # absolute positions: a left-padded text would score differently
        config = AutoConfig.for_model("gpt2", vocab_size=len(tok), n_embd=hidden, n_layer=1, n_head=2,
                                      n_positions=64, num_labels=num_labels, **ids)
    else:
        config = AutoConfig.for_model(
            "llama", vocab_size=vocab_size or len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
            num_labels=num_labels,
            rms_norm_eps=0.0 if bits else 1e-6, **ids)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    if bits:
        with torch.no_grad():
            ids = torch.arange(len(tok))
            signs = ((ids[:, None] >> torch.arange(7)) & 1).float() * 2 - 1  # [V, 7] bit k as +-1
            model.model.embed_tokens.weight.copy_(torch.cat([torch.ones(len(tok), 1), signs], dim=1))
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            model.model.norm.weight.fill_(1.0)
            model.score.weight.copy_(torch.tensor([HEAD]))
    model.save_pretrained(str(path))
    if tokenizer:
        tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward-models")
    out = SimpleNamespace(bits=_save_seq_cls(root / "bits-rm", bits=True),
                          random=_save_seq_cls(root / "random-rm", hidden=16, seed=3, arch="gpt2"))
    # The same bits model whose tokenizer has no pad token: EOS pads (as in TRL).
    out.eos_pad = root / "eos-pad-rm"
    shutil.copytree(out.bits, out.eos_pad)
    cfg_path = out.eos_pad / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("pad_token", None)
    cfg_path.write_text(json.dumps(cfg))
    return out


# ---- 1. scores known by hand ------------------------------------------------------------------------


def test_scores_are_the_last_real_token_id(folders):
    rm = load_reward_model(str(folders.bits), batch_size=2)
    assert isinstance(rm, RewardModel) and rm.__name__ == "bits-rm"
    assert not rm.model.training and not any(p.requires_grad for p in rm.model.parameters())
    prompts = ["2+2=", "Say b: ", "x", "Long prompt here: ", "?"]
    completions = ["4", "ab", "x y", "Z", ""]
    # last characters: '4' -> 7, 'b' -> 14, 'y' -> 37, 'Z' -> 64, '?' (the prompt's, empty completion) -> 85
    expected = [7.0, 14.0, 37.0, 64.0, 85.0]
    # Padding on the right of shorter texts is skipped (else a pad's score, 0.0); extra arguments are ignored.
    assert rm(prompts, completions, completion_ids=[[0]] * 5, answer=["4"] * 5, trainer_state=None) == expected
    assert load_reward_model(str(folders.bits), batch_size=32)(prompts, completions) == expected
    assert rm([], []) == []


def test_chat_prompts_use_the_reward_tokenizer_template(folders):
    rm = load_reward_model(str(folders.bits), batch_size=3)
    prompts = [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "be brief"},
                                                     {"role": "user", "content": "2+2?"}]]
    completions = [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "four"}]]
    assert rm.texts(prompts, completions) == ["user: hi\nassistant: 4\n",
                                              "system: be brief\nuser: 2+2?\nassistant: four\n"]
    assert rm(prompts, completions) == [98.0, 98.0]  # the template's last '\n'
    # Plain string completions of chat prompts are wrapped as assistant messages (as grpokit passes them).
    assert rm.texts(prompts, ["4", "four"]) == rm.texts(prompts, completions)


def test_eos_pads_when_the_tokenizer_has_no_pad_token(folders):
    rm = load_reward_model(str(folders.eos_pad))
    assert rm.tokenizer.pad_token == "<eos>" and rm.model.config.pad_token_id == 2
    # A trailing <eos> is padding now, so the score is that of the token before it (as in TRL).
    assert rm(["q: ", "q: ", "q: "], ["ab<eos>", "ab", "a"]) == [14.0, 14.0, 13.0]


def test_as_a_reward_spec_in_compute_rewards(folders):
    rm = load_reward_model(str(folders.bits))
    per_fn, total = compute_rewards([RewardSpec(rm.__name__, rm, weight=0.5)], ["p", "p"], ["a", "b"],
                                    [[13], [14]], {"answer": ["a", "b"]})
    assert per_fn[:, 0].tolist() == [13.0, 14.0] and total.tolist() == [6.5, 7.0]


# ---- 2. parity with TRL's own scoring ----------------------------------------------------------------


def _trl_rewards(path, prompts, completions):
    """TRL 1.16's scores: `GRPOTrainer._calculate_rewards` on a stand-in with the attributes it reads; the
    model and tokenizer made as `GRPOTrainer.__init__` makes them for a reward model id."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import GRPOTrainer
    from trl.trainer.utils import get_config_model_id

    model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1)
    tok = AutoTokenizer.from_pretrained(get_config_model_id(model.config))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.config.get_text_config().pad_token_id = tok.pad_token_id
    cpu = torch.device("cpu")
    trainer = object.__new__(GRPOTrainer)  # no __init__: only what _calculate_rewards reads
    vars(trainer).update(
        reward_funcs=[model], reward_processing_classes=[tok],
        reward_func_names=[get_config_model_id(model.config).split("/")[-1]],
        accelerator=SimpleNamespace(device=cpu, is_main_process=True), args=SimpleNamespace(device=cpu, report_to=[]),
        is_deepspeed_enabled=False, state=SimpleNamespace(global_step=0), environments=None, chat_template_kwargs={},
        _log_completion_extra=lambda column, values: None, _log_metric=lambda name, value: None)
    inputs = [{"prompt": p, "answer": "x"} for p in prompts]
    out = GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, [[0]] * len(prompts))
    return out[:, 0], trainer.reward_func_names[0]


CHAT = [[{"role": "user", "content": "What is 12+30?"}],
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}],
        [{"role": "user", "content": "hi"}]]


@pytest.mark.parametrize("kind", ["plain", "chat", "eos_pad"])
def test_parity_with_trl(folders, kind):
    if kind == "chat":
        prompts = [CHAT[i % 3] for i in range(7)]
        answers = ["42", "red", "hello there, how are you?", "4 2", "", "blue\n", "x"]
        completions = [[{"role": "assistant", "content": a}] for a in answers]
    else:
        prompts = ["What is 12+30? ", "Q: colour?\nA:", "hi", "a much longer prompt than the others: ", "",
                   "7*6=", "?"]
        completions = ["42", " red", " hello there, how are you?", "4 2", "empty prompt", "42<eos>", ""]
    path = folders.eos_pad if kind == "eos_pad" else folders.random
    expected, trl_name = _trl_rewards(path, prompts, completions)
    rm = load_reward_model(str(path), batch_size=3)  # chunks of 3, 3 and 1, each padded to its own length
    got = torch.tensor(rm(prompts, completions))
    assert rm.__name__ == trl_name
    assert torch.allclose(got, expected, rtol=0, atol=1e-6), (got, expected)
    assert len(set(got.tolist())) > 3  # the random model's scores tell the texts apart


# ---- 3. folders that are no reward model ----------------------------------------------------------------


def _causal(path):
    build_tiny_model(path, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1)
    return path


def _two_labels(path):
    return _save_seq_cls(path, num_labels=2)


def _no_config(path):
    build_char_tokenizer(path)
    return path


def _bad_config(path):
    _save_seq_cls(path)
    (path / "config.json").write_text("{ not json")
    return path


def _no_tokenizer(path):
    return _save_seq_cls(path, tokenizer=False)


@pytest.mark.parametrize("make, says", [
    (_causal, "is a causal LM (Qwen2ForCausalLM), not a reward model; a reward model is an "
              "AutoModelForSequenceClassification with num_labels = 1"),
    (_two_labels, "has num_labels = 2"),
    (_no_config, "has no config.json"),
    (_bad_config, "its config.json cannot be read"),
    (_no_tokenizer, "has no tokenizer files"),
    (lambda path: path / "missing", "no such folder"),
])
def test_bad_folders_are_one_error_line_naming_the_folder(tmp_path, make, says):
    path = str(make(tmp_path / "rm"))
    for load in (check_reward_model_folder, load_reward_model):
        with pytest.raises(RewardLoadError) as e:
            load(path)
        message = str(e.value)
        assert says in message and repr(path) in message and "\n" not in message, message


def test_damaged_weights_and_routing(folders, tmp_path):
    damaged = tmp_path / "damaged-rm"
    shutil.copytree(folders.bits, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    check_reward_model_folder(str(damaged))  # the config is fine: only loading finds the damage
    with pytest.raises(RewardLoadError) as e:
        load_reward_model(str(damaged))
    assert repr(str(damaged)) in str(e.value) and "loading the model failed" in str(e.value)
    assert "\n" not in str(e.value)

    # No architectures recorded, a known model type: the check passes, the load finds the head missing.
    headless = _causal(tmp_path / "headless-rm")
    cfg = json.loads((headless / "config.json").read_text())
    cfg.pop("architectures")
    cfg["id2label"], cfg["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    (headless / "config.json").write_text(json.dumps(cfg))
    check_reward_model_folder(str(headless))
    with pytest.raises(RewardLoadError, match="has no weights for score.weight, so they would be random"):
        load_reward_model(str(headless))

    assert is_reward_model_folder(str(folders.bits)) and is_reward_model_folder(str(folders.bits) + "/")
    assert not is_reward_model_folder(str(tmp_path))  # a folder without config.json
    assert not any(is_reward_model_folder(ref) for ref in ("", "format", "rewards.py:score"))
    assert load_reward_model(str(folders.bits) + "/", dtype="float32").__name__ == "bits-rm"
    with pytest.raises(RewardLoadError, match="dtype 'int8'"):
        load_reward_model(str(folders.bits), dtype="int8")
    with pytest.raises(RewardLoadError, match="batch_size"):
        load_reward_model(str(folders.bits), batch_size=0)


# ---- 4. faults found at load, not at the first step ---------------------------------------------------------


def test_a_tokenizer_past_the_embedding_is_refused_at_load(tmp_path):
    """An embedding of 20 rows for a tokenizer of 99 tokens: an IndexError at the first batch, before."""
    from transformers import AutoModelForSequenceClassification

    from grpokit.rewards.registry import reward_entries

    path = str(_save_seq_cls(tmp_path / "small-rm", vocab_size=20))
    with pytest.raises(RewardLoadError) as e:
        load_reward_model(path)
    message = str(e.value)
    assert repr(path) in message and "has 99 tokens but the model's embedding only 20 rows" in message
    assert "resize_token_embeddings" in message and "\n" not in message
    model = AutoModelForSequenceClassification.from_pretrained(path)  # a loaded object: the same check
    with pytest.raises(RewardLoadError, match=r"^reward_functions\[1\]: .* 99 tokens .* only 20 rows"):
        reward_entries([len, model])


def test_a_classifier_config_over_causal_weights_is_one_line_without_transformers_report(tmp_path):
    """transformers' multi-line LOAD REPORT (score.weight | MISSING) is not logged before the error line.
    Its library logger does not propagate to the root (caplog): a handler on it sees what it would print."""
    import logging

    folder = _causal(tmp_path / "headless-rm")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["Qwen2ForSequenceClassification"]
    cfg["id2label"], cfg["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    (folder / "config.json").write_text(json.dumps(cfg))
    good = _save_seq_cls(tmp_path / "good-rm")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    try:
        with pytest.raises(RewardLoadError, match="has no weights for score.weight, so they would be random"):
            load_reward_model(str(folder))
        assert load_reward_model(str(good)).__name__ == "good-rm"  # a good one loads silently too
    finally:
        library.removeHandler(handler)
    assert not seen, seen


def test_chat_prompts_for_a_reward_model_without_a_chat_template_fail_at_start_up(folders, tmp_path):
    from dataclasses import replace

    from conftest import make_config, parity
    from grpokit.config.schema import RewardConfig
    from grpokit.training.rollout_setup import resolve_reward_specs

    nochat = tmp_path / "nochat-rm"
    shutil.copytree(folders.bits, nochat)
    (nochat / "chat_template.jinja").unlink()
    assert load_reward_model(str(nochat)).tokenizer.chat_template is None
    config = replace(make_config(tmp_path, tmp_path / "run"), rewards=RewardConfig(functions=(str(nochat),)))
    rows = [{"prompt": "plain"}, {"prompt": [{"role": "user", "content": "hi"}]}]
    says = r"^reward model 'nochat-rm': the prompts are chat messages but its tokenizer has no chat template.*row 2"
    with pytest.raises(RewardLoadError, match=says):
        resolve_reward_specs(config, None, rows=rows)
    with pytest.raises(RewardLoadError, match=says):  # named among Python callables, too
        resolve_reward_specs(config, None, [parity, str(nochat)], rows=rows)
    assert [s.name for s in resolve_reward_specs(config, None, rows=rows[:1])] == ["nochat-rm"]  # plain: fine
    assert [s.name for s in resolve_reward_specs(config, None, [str(folders.bits)], rows=rows)] == ["bits-rm"]
