"""grpokit.trl: reward models in `reward_funcs`, and evaluation (eval_dataset, load_best_model_at_end, evaluate()).

(a) A reward model's folder in a one-step run: its scores reach the metrics under TRL's name, equal to
grpokit's RewardModel on the same texts. (b) A reward-model object with its reward_processing_class
(TRL's pad fix-up), a Hub id (an offline Hugging Face cache in tmp_path) and a function, named as TRL
names them, scoring as the folder does; what is not a reward model is refused. (c) eval_strategy="steps"
evaluates every step; load_best_model_at_end makes the best checkpoint (best.json) the trainer's model
and what save_model writes; trainer.evaluate() scores that model exactly as the evaluation during
training did. The run-level checks of [eval] and keep_best themselves live in grpokit's own tests.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from conftest import parity
from grpokit.errors import ConfigError
from grpokit.models.tiny import build_char_tokenizer
from grpokit.rewards.reward_model import RewardModel, load_reward_model
from grpokit.trl import GRPOConfig, GRPOTrainer

ROWS = [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(2)]
RUN = dict(max_steps=1, per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
           learning_rate=1e-2, disable_tqdm=True)


def _save_seq_cls(path, *, num_labels=1, hidden=8, seed=0):
    """A tiny random LlamaForSequenceClassification + character tokenizer saved at `path`."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    tok = build_char_tokenizer()
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, num_labels=num_labels,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_reward_model_folder_scores_the_run_under_trls_name(tmp_path, tiny_model_dir):
    from grpokit.observe.tracking import read_jsonl

    folder = _save_seq_cls(tmp_path / "tiny-rm")
    args = GRPOConfig(output_dir=str(tmp_path / "o"), log_completions=True, logging_steps=1,
                      reward_weights=[1.0, 0.5], **RUN)
    trainer = GRPOTrainer(str(tiny_model_dir), [str(folder), length], args=args, train_dataset=ROWS)
    assert isinstance(trainer.reward_funcs[0], RewardModel) and trainer.reward_funcs[0].__name__ == "tiny-rm"
    trainer.train()
    answers = read_jsonl(trainer.run_dir / "completions.jsonl")
    scores = load_reward_model(str(folder))([a["prompt"] for a in answers], [a["completion"] for a in answers])
    assert [a["rewards"]["tiny-rm"] for a in answers] == pytest.approx(scores, abs=1e-6)
    row = trainer.state.log_history[0]
    assert row["rewards/tiny-rm/mean"] == pytest.approx(sum(scores) / len(scores), rel=1e-5)
    assert row["reward"] == pytest.approx(row["rewards/tiny-rm/mean"] + 0.5 * row["rewards/length/mean"], rel=1e-5)


def _offline_hub(tmp_path, monkeypatch, repo: str, folder) -> None:
    """`folder` as the cached snapshot of Hub model `repo` in an offline cache under tmp_path."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-hub"
    storage = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, storage / "snapshots" / "0123abcd")
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no local folder called org/


def test_reward_model_objects_hub_ids_and_processing_classes(tmp_path, tiny_model_dir, monkeypatch):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    folder = _save_seq_cls(tmp_path / "tiny-rm")
    _offline_hub(tmp_path, monkeypatch, "org/hub-rm", folder)
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).train()  # _name_or_path: the folder
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.pad_token = None  # TRL's fix-up: EOS pads, and the model learns the pad id
    args = GRPOConfig(output_dir=str(tmp_path / "o"), **RUN)
    trainer = GRPOTrainer(str(tiny_model_dir), [model, "org/hub-rm", length], args=args, train_dataset=ROWS,
                          reward_processing_classes=[tokenizer, None, tokenizer])  # ignored for a function
    by_object, by_hub, function = trainer.reward_funcs
    assert [by_object.__name__, by_hub.__name__] == ["tiny-rm", "hub-rm"] and function is length
    assert by_object.tokenizer is tokenizer and tokenizer.pad_token == tokenizer.eos_token
    assert model.config.pad_token_id == tokenizer.eos_token_id and not model.training
    prompts, completions = ["1+1=", "12+30=", "x"], ["2", "42 ok", ""]
    expected = load_reward_model(str(folder))(prompts, completions)
    assert by_object(prompts, completions) == pytest.approx(expected, abs=1e-6)
    assert by_hub(prompts, completions) == pytest.approx(expected, abs=1e-6)
    # a reward model given by name loads in model_init_kwargs' dtype, as TRL loads it
    in_bf16 = GRPOTrainer(str(tiny_model_dir), "org/hub-rm", train_dataset=ROWS,
                          args=GRPOConfig(output_dir=str(tmp_path / "o"), model_init_kwargs={"torch_dtype": "bfloat16"},
                                          **RUN))
    assert in_bf16.reward_funcs[0].model.dtype == torch.bfloat16 and in_bf16.config.model.dtype == "bfloat16"
    # a single processing class for a single reward model (TRL's rule), and what is no reward model
    only = GRPOTrainer(str(tiny_model_dir), model, args=args, train_dataset=ROWS, reward_processing_classes=tokenizer)
    assert only.reward_funcs[0].tokenizer is tokenizer
    two_labels = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(str(folder), num_labels=2))
    for bad, match in [(two_labels, "num_labels = 2 is not a reward model"),
                       (torch.nn.Linear(2, 1), "a torch module but no transformers PreTrainedModel")]:
        with pytest.raises(ConfigError, match=match):
            GRPOTrainer(str(tiny_model_dir), bad, args=args, train_dataset=ROWS)


def test_evaluation_keeps_and_loads_the_best_checkpoint(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from grpokit.training.checkpoint import list_checkpoints

    run = {**RUN, "max_steps": 2, "per_device_train_batch_size": 8, "max_completion_length": 8}  # scores that move
    args = GRPOConfig(output_dir=str(tmp_path / "o"), **run, eval_strategy="steps", eval_steps=1, save_steps=1,
                      num_generations_eval=4, per_device_eval_batch_size=4, load_best_model_at_end=True,
                      metric_for_best_model="reward")
    held_out = [{"prompt": "1+2="}, {"prompt": "3+3="}]
    trainer = GRPOTrainer(str(tiny_model_dir), parity, args=args, train_dataset=ROWS, eval_dataset=held_out)
    c = trainer.config
    assert (c.eval.every, c.eval.num_prompts, c.eval.samples_per_prompt, c.output.keep_best) == (
        1, 2, 4, "eval/mean_reward")
    before = trainer.evaluate(metric_key_prefix="test")  # the model given, before training
    assert {"test_loss", "test_reward", "test_accuracy", "test_pass@4", "test_runtime"} <= set(before)
    model = trainer.model
    trainer.train()
    # TRL's rows: an evaluation is its own eval_... row (eval_reward = grpokit's eval/mean_reward)
    scores = {row["step"]: row["eval_reward"] for row in trainer.state.log_history if "eval_runtime" in row}
    log = trainer.state.log_history  # an evaluation row carries the step's num_tokens, as TRL's does
    assert all(row["eval_num_tokens"] == log[i - 1]["num_tokens"] > 0 for i, row in enumerate(log)
               if "eval_runtime" in row)
    best = json.loads((trainer.run_dir / "best.json").read_text())
    assert set(scores) == {1, 2} and best["value"] == max(scores.values()) == scores[best["step"]]
    s = trainer.state
    assert (s.best_metric, s.best_global_step, s.best_model_checkpoint) == (
        best["value"], best["step"], str(trainer.run_dir / best["checkpoint"]))
    # evaluate() scores the model train() leaves, the best checkpoint's, as the evaluation during training did
    assert trainer.evaluate()["eval_reward"] == pytest.approx(best["value"], abs=1e-6)
    # the best checkpoint's weights were loaded into the trainer's model, in place (transformers' _load_best_model)
    assert trainer.model is model
    expected = AutoModelForCausalLM.from_pretrained(str(trainer.run_dir / best["checkpoint"]))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected.parameters()))
    other = next(p for p in list_checkpoints(trainer.run_dir) if p.name != best["checkpoint"])
    assert (other / "model.safetensors").read_bytes() != (
        trainer.run_dir / best["checkpoint"] / "model.safetensors").read_bytes()  # a step trained in between
    trainer.save_model(str(tmp_path / "final"))
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), expected.parameters()))


def test_evaluate_draws_the_answers_once_and_counts_them_as_grpokits_evaluation(tmp_path, tiny_model_dir,
                                                                                  monkeypatch):
    from grpokit.data.files import load_prompts
    from grpokit.models.loading import max_positions_of
    from grpokit.rollout import decode, engines
    from grpokit.rollout.request import SamplingParams
    from grpokit.training import evaluation
    from grpokit.training.rollout_setup import resolve_reward_specs
    from grpokit.training.setup import PreparedData, eval_max_new_tokens, tokenize_prompts

    draws, real = [], decode.sample_groups

    def counted(*args, **kwargs):
        draws.append(len(args[1].prompt_ids))  # the prompts of one batch
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "sample_groups", counted)
    monkeypatch.setattr(engines, "sample_groups", counted)
    args = GRPOConfig(output_dir=str(tmp_path / "o"), num_generations_eval=4, per_device_eval_batch_size=4, **RUN)
    trainer = GRPOTrainer(str(tiny_model_dir), parity, args=args, train_dataset=ROWS, eval_dataset=ROWS)
    metrics = trainer.evaluate()
    assert draws == [len(ROWS)]  # one batch of prompts, sampled once (loss, rewards and accuracy share it)
    assert math.isfinite(metrics["eval_loss"])  # from those answers
    # grpokit's own evaluation of the same model, rows and seed draws the same answers: the same numbers
    config = trainer.config
    table = tokenize_prompts(config, PreparedData(load_prompts(ROWS, prompt_column="prompt"), None),
                             trainer.processing_class, max_positions_of(config.model.path), None)
    sampling = SamplingParams(eval_max_new_tokens(config), tuple(table.eos_token_ids),
                              trainer.processing_class.pad_token_id, args.temperature, args.top_p, args.top_k)
    own = evaluation.evaluate(trainer.model, trainer.processing_class, table.rows, table.ids,
                              resolve_reward_specs(config, None, trainer.reward_funcs), evaluation.EvalSettings(
                                  sampling, samples_per_prompt=4, correct_threshold=config.eval.correct_threshold,
                                  greedy=False, seed=args.seed))
    assert (metrics["eval_reward"], metrics["eval_accuracy"], metrics["eval_pass@4"]) == pytest.approx(
        (own["mean_reward"], own["accuracy"], own["pass@4"]), abs=1e-9)
    assert 0 < own["accuracy"] < 1  # answers of both kinds: the comparison can tell counts apart


ENV_SOURCE = '''
class Counter:
    """A TRL-style environment: reset with the row, one tool method, its own reward."""

    def reset(self, **row):
        self.count = 0

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)
'''


def test_evaluate_runs_environment_factorys_environments_as_training_does(tool_model_dir, tmp_path, monkeypatch):
    # evaluate() draws through the rollout side training uses: each answer its own instance, reset with its row,
    # calling its methods; the environment's get_reward among the rewards. The random model never writes a call:
    # every turn "calls" increment, as in the training tests.
    from grpokit.rollout import engines
    from grpokit.rollout.multiturn import sample_conversations
    from grpokit.rollout.tools import ToolCall

    monkeypatch.setattr(engines, "sample_conversations", lambda *a, **k: sample_conversations(
        *a, parse_calls=lambda text, **_: [ToolCall("increment", {"step": 1})], **k))
    namespace: dict = {}
    exec(ENV_SOURCE, namespace)
    seen = []

    def own_counts(completions, environments, **kwargs):
        seen.append(environments)
        return [float(env.count) for env in environments]

    args = GRPOConfig(output_dir=str(tmp_path / "o"), num_generations_eval=2,
                      **{**RUN, "max_completion_length": 48})
    trainer = GRPOTrainer(str(tool_model_dir), own_counts, args=args, eval_dataset=ROWS[:2],
                          environment_factory=namespace["Counter"])
    metrics = trainer.evaluate()
    assert metrics["eval_rewards/Counter/mean"] > 0  # the answers called their own environments' tool
    assert metrics["eval_rewards/own_counts/mean"] == pytest.approx(metrics["eval_rewards/Counter/mean"])
    assert len(seen[0]) == 2 * 2 and len({id(env) for env in seen[0]}) == 4  # one instance per answer
