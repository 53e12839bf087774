"""grpokit.trl: the trainer object behaves like TRL's, not only takes its arguments.

(a) `trainer.model` is the loaded module, `train()` trains that object in place (a reference the user
holds sees the new weights, equal to the final checkpoint's), `trainer.model = ...` works, and what
TRL's scripts read (`processing_class`, `accelerator`, `is_world_process_zero()`, `reward_func_names`,
`reward_processing_classes`, `save_model()`, `push_to_hub` refused) is there. (b) The results:
`TrainOutput.metrics`, `state.log_history` and `evaluate()` carry TRL's keys, checked against TRL's own
trainer run on the same tiny model (CPU). (c) The datasets TRL accepts: IterableDataset (training and
evaluation), a DatasetDict of eval sets (prefixed metrics), environment-owned data, a PeftModel.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from conftest import parity
from grpokit.errors import ConfigError
from grpokit.trl import GRPOConfig, GRPOTrainer

ROWS = [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(2)]
RUN = dict(max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
           learning_rate=1e-2, disable_tqdm=True, per_device_eval_batch_size=4, logging_steps=1)


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def ordinal(completions, **kwargs):
    """A reward with signal in every group (the answers' places differ), so every step changes the weights."""
    return [float(i % 4) for i in range(len(completions))]


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# TRL's keys grpokit does not log (docs/TRL.md): in training rows the terminated answers' min / max length.
NOT_LOGGED = {"completions/min_terminated_length", "completions/max_terminated_length"}


@pytest.fixture(scope="module")
def trl_run(tiny_model_dir, tmp_path_factory):
    """TRL 1.16's own GRPOTrainer on the same tiny model and rows: what its object holds and returns."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    out = tmp_path_factory.mktemp("trl-out")
    args = trl.GRPOConfig(output_dir=str(out), use_cpu=True, report_to="none", bf16=False, save_strategy="no",
                          **{k: v for k, v in RUN.items()})
    trainer = trl.GRPOTrainer(model=str(tiny_model_dir), reward_funcs=ordinal, args=args,
                              train_dataset=Dataset.from_list(ROWS))
    before = {"model": type(trainer.model), "state": type(trainer.state), "names": trainer.reward_func_names,
              "classes": trainer.reward_processing_classes}
    output = trainer.train()
    log = [dict(row) for row in trainer.state.log_history]  # before the evaluations add theirs
    evaluated = trainer.evaluate(Dataset.from_list(ROWS[:4]))
    named = trainer.evaluate({"a": Dataset.from_list(ROWS[:4]), "b": Dataset.from_list(ROWS[4:])})
    return {**before, "output": output, "log": log, "eval": evaluated, "named": named,
            "state_after": trainer.state}


def test_the_model_is_loaded_and_trained_in_place(tiny_model_dir, tmp_path, trl_run, capsys):
    from transformers import PreTrainedTokenizerBase, TrainerState
    from transformers.trainer_utils import TrainOutput

    from grpokit.training.checkpoint import list_checkpoints

    args = GRPOConfig(output_dir=str(tmp_path / "o"), **RUN)
    trainer = GRPOTrainer(str(tiny_model_dir), ordinal, args=args, train_dataset=ROWS)
    model = trainer.model  # the user's reference, before training
    assert isinstance(model, torch.nn.Module) and isinstance(model, trl_run["model"])
    assert isinstance(trainer.processing_class, PreTrainedTokenizerBase)
    assert isinstance(trainer.state, TrainerState) and trainer.state.global_step == 0
    assert trainer.reward_func_names == trl_run["names"] == ["ordinal"]
    assert trainer.reward_processing_classes == trl_run["classes"] == [None]
    assert trainer.is_world_process_zero() and trainer.accelerator.is_main_process
    trainer.accelerator.print("printed once")
    assert "printed once" in capsys.readouterr().out
    before = _weights(model)
    output = trainer.train()
    assert trainer.model is model  # trained in place, not replaced by a reload
    after = _weights(model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    from safetensors.torch import load_file

    final = load_file(str(list_checkpoints(trainer.run_dir)[-1] / "model.safetensors"))
    assert all(torch.equal(after[k], final[k]) for k in final)  # the object grpokit trained and saved
    # the TrainOutput and the TrainerState, as TRL's
    assert isinstance(output, TrainOutput) and output.global_step == trl_run["output"].global_step == 2
    assert set(output.metrics) == set(trl_run["output"].metrics)
    assert output.training_loss == output.metrics["train_loss"] and math.isfinite(output.training_loss)
    assert output.training_loss == pytest.approx(sum(r["loss"] for r in trainer.state.log_history[:2]) / 2)
    ours, theirs = list(trainer.state.log_history), trl_run["log"]  # (an evaluate() below appends its row)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 2]
    assert [r["epoch"] for r in ours] == [r["epoch"] for r in theirs]  # prompts used / rows
    for mine, trls in zip(ours, theirs):
        assert set(trls) - set(mine) <= NOT_LOGGED, set(trls) - set(mine)
    # num_tokens, TRL's running count: each step adds its answers' prompt tokens (every prompt has 4 characters
    # here) and the tokens generated (completions/mean_length per answer), as TRL's rows do
    answers = RUN["per_device_train_batch_size"]
    for rows in (ours[:2], theirs[:2]):
        added = [b["num_tokens"] - a for a, b in zip([0.0] + [r["num_tokens"] for r in rows], rows)]
        prompts = [n - r["completions/mean_length"] * answers for n, r in zip(added, rows)]
        assert prompts == pytest.approx([4.0 * answers] * 2), prompts
    for state, rows in ((trainer.state, ours), (trl_run["state_after"], theirs)):  # the state holds the last count
        assert state.num_input_tokens_seen == rows[1]["num_tokens"] > 0
    # evaluate() reports that count as eval_num_tokens, unchanged (TRL counts no tokens in evaluation)
    assert trainer.evaluate(ROWS[:4])["eval_num_tokens"] == trainer.state.num_input_tokens_seen
    assert trl_run["eval"]["eval_num_tokens"] == trl_run["state_after"].num_input_tokens_seen
    assert set(ours[-1]) == set(theirs[-1])  # train_runtime, ..., total_flos, train_loss, epoch, step
    assert (trainer.state.global_step, trainer.state.max_steps, trainer.state.epoch) == (
        trl_run["state_after"].global_step, trl_run["state_after"].max_steps, trl_run["state_after"].epoch)
    # save_model writes the module as it is now; trainer.model can be replaced, as in TRL
    trainer.save_model(str(tmp_path / "final"))
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    assert all(torch.equal(after[k], v) for k, v in saved.state_dict().items())
    with pytest.raises(ConfigError, match="does not upload to the Hugging Face Hub.*hf upload"):
        trainer.push_to_hub()


def test_evaluate_returns_trls_keys_and_the_loss(tiny_model_dir, tmp_path, trl_run):
    from datasets import Dataset, DatasetDict

    args = GRPOConfig(output_dir=str(tmp_path / "o"), **RUN)
    trainer = GRPOTrainer(str(tiny_model_dir), [length, parity], args=args, train_dataset=ROWS,
                          eval_dataset=Dataset.from_list(ROWS[:4]))
    metrics = trainer.evaluate()
    trls = {k.replace("/ordinal/", "/length/") for k in trl_run["eval"]} | {"eval_rewards/parity/mean",
                                                                              "eval_rewards/parity/std"}
    assert trls <= set(metrics), trls - set(metrics)
    assert metrics["eval_num_tokens"] == trainer.state.num_input_tokens_seen == 0  # nothing trained yet
    assert {"eval_accuracy", "eval_pass@4"} <= set(metrics) and math.isfinite(metrics["eval_loss"])
    # the loss and the per-function rewards come from the same answers as eval_reward
    assert metrics["eval_reward"] == pytest.approx(metrics["eval_rewards/length/mean"]
                                                   + metrics["eval_rewards/parity/mean"], rel=1e-5)
    assert trainer.state.log_history[-1]["eval_loss"] == metrics["eval_loss"]
    # a DatasetDict (or a dict): each set evaluated, its metrics prefixed with its name (transformers' rule)
    named = trainer.evaluate(DatasetDict({"a": Dataset.from_list(ROWS[:4]), "b": Dataset.from_list(ROWS[4:])}))
    assert {k for k in trl_run["named"] if k.startswith(("eval_a_", "eval_b_"))} <= set(named)  # loss, speed
    assert named["eval_a_reward"] == pytest.approx(metrics["eval_reward"])  # the same rows, the same seed
    assert {"eval_a_loss", "eval_b_loss", "eval_b_rewards/parity/mean", "eval_b_completions/mean_length"} <= set(named)
    # an IterableDataset is read whole
    streamed = trainer.evaluate(Dataset.from_list(ROWS[:4]).to_iterable_dataset(), metric_key_prefix="test")
    assert streamed["test_reward"] == pytest.approx(metrics["eval_reward"]) and "test_loss" in streamed
    with pytest.raises(ConfigError, match="grpokit's evaluation during training scores one dataset"):
        GRPOTrainer(str(tiny_model_dir), length, train_dataset=ROWS, eval_dataset={"a": ROWS, "b": ROWS},
                    args=GRPOConfig(output_dir=str(tmp_path / "o"), eval_strategy="steps", **RUN))


def test_eval_loss_with_a_kl_term_is_trls_loss_at_ratio_one(tiny_model_dir, tmp_path):
    """beta > 0: the KL to the reference enters eval_loss (0 before training: the policy is the reference)."""
    args = GRPOConfig(output_dir=str(tmp_path / "o"), beta=0.5, **RUN)
    trainer = GRPOTrainer(str(tiny_model_dir), parity, args=args, train_dataset=ROWS, eval_dataset=ROWS[:2])
    before = trainer.evaluate()
    assert before["eval_kl"] == pytest.approx(0.0, abs=1e-6)
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_kl"] > 1e-6 and math.isfinite(after["eval_loss"])


def test_an_iterable_training_dataset_needs_max_steps_and_is_read_as_far_as_the_run_goes(tiny_model_dir, tmp_path):
    from datasets import Dataset

    stream = Dataset.from_list(ROWS).to_iterable_dataset()
    with pytest.raises(ConfigError, match="max_steps must be set to a positive value if dataloader does not have a "
                                          "length"):
        GRPOTrainer(str(tiny_model_dir), length, train_dataset=stream,
                    args=GRPOConfig(output_dir=str(tmp_path / "o"), **{**RUN, "max_steps": -1}))
    trainer = GRPOTrainer(str(tiny_model_dir), ordinal, train_dataset=stream,
                          args=GRPOConfig(output_dir=str(tmp_path / "o"), **{**RUN, "max_steps": 1}))
    assert trainer.rows == ROWS[:1]  # one step of one prompt
    # trainer.model can be replaced before train(), as in TRL: the object assigned is the one trained
    from transformers import AutoModelForCausalLM

    given, replaced = trainer.model, AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    trainer.model = replaced
    before, untouched = _weights(replaced), _weights(given)
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.model is replaced
    assert any(not torch.equal(before[k], v) for k, v in _weights(replaced).items())
    assert all(torch.equal(untouched[k], v) for k, v in _weights(given).items())


def test_a_peft_model_trains_its_own_adapter(tmp_path):
    from peft import LoraConfig, get_peft_model

    from grpokit.models.tiny import build_tiny_model

    base, tokenizer = build_tiny_model(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)
    peft_model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # a trained adapter, not peft's zero init
    args = GRPOConfig(output_dir=str(tmp_path / "o"), **RUN)
    with pytest.raises(ConfigError, match="a PeftModel instance together with a peft_config"):
        GRPOTrainer(peft_model, length, args=args, train_dataset=ROWS, processing_class=tokenizer,
                    peft_config=LoraConfig(r=2))
    with pytest.raises(ConfigError, match="a PeftModel with beta > 0 is not supported"):
        GRPOTrainer(peft_model, length, args=GRPOConfig(output_dir=str(tmp_path / "o"), beta=0.1, **RUN),
                    train_dataset=ROWS, processing_class=tokenizer)
    trainer = GRPOTrainer(peft_model, ordinal, args=args, train_dataset=ROWS, processing_class=tokenizer)
    assert trainer.model is peft_model
    assert trainer.config.model.lora == {"r": 2, "alpha": 4.0, "target_modules": ["q_proj", "v_proj"]}
    before = _weights(peft_model)
    trainer.train()
    after = _weights(peft_model)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)  # the given adapter trained, the base did not
    trainer.save_model(str(tmp_path / "final"))  # TRL's peft save: the adapter
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "final").iterdir()}
    config = json.loads((tmp_path / "o" / "trl-model" / "config.json").read_text())
    assert config["model_type"] == "qwen2"  # the base weights grpokit reads, without the adapter


ENV_SOURCE = '''
class Counter:
    """A TRL-style environment that owns the data: reset gives the prompt."""

    def reset(self, **row):
        self.count = 0
        return "count to three"

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


def test_an_environment_owns_the_data(tiny_model_dir, tmp_path):
    from grpokit.models.tiny import TOOL_CHAT_TEMPLATE

    folder = tmp_path / "tool-model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    namespace: dict = {}
    exec(ENV_SOURCE, namespace)
    with pytest.raises(ConfigError, match="max_steps must be set to a positive value to define the training length"):
        GRPOTrainer(str(folder), args=GRPOConfig(output_dir=str(tmp_path / "o"), **{**RUN, "max_steps": -1}),
                    environment_factory=namespace["Counter"])
    with pytest.raises(ConfigError, match="`train_dataset` is required unless an `environment_factory` is provided"):
        GRPOTrainer(str(folder), length, args=GRPOConfig(output_dir=str(tmp_path / "o"), **RUN))
    args = GRPOConfig(output_dir=str(tmp_path / "o"), **{**RUN, "max_steps": 1, "max_completion_length": 8})
    trainer = GRPOTrainer(str(folder), args=args, environment_factory=namespace["Counter"])
    assert trainer.rows == [{"prompt": [{"role": "user", "content": ""}]}]  # TRL's placeholder: one batch of prompts
    trainer.train()
    assert "rewards/Counter/mean" in trainer.state.log_history[0]


@pytest.mark.parametrize("trl_args, expected", [
    (dict(use_liger_kernel=True), "use_liger_kernel=True: already satisfied"),
    (dict(dataloader_num_workers=4, dataloader_pin_memory=False), "dataloader_num_workers, dataloader_pin_memory: no "
                                                                 "effect on training: grpokit's loop reads no "
                                                                 "DataLoader"),
    (dict(accelerator_config={"dispatch_batches": False, "even_batches": True}), "accelerator_config: no effect"),
])
def test_arguments_accepted_with_a_note(trl_args, expected, tiny_model_dir, tmp_path, capsys):
    GRPOTrainer(str(tiny_model_dir), length, train_dataset=ROWS,
                args=GRPOConfig(output_dir=str(tmp_path / "o"), **RUN, **trl_args))
    assert expected in capsys.readouterr().out


def test_generation_kwargs_stop_strings_and_the_refused_rest(tmp_path):
    from grpokit.trl.mapping import grpokit_config

    for kwargs, stops in [({"stop_strings": ["\n\n", "END"]}, ("\n\n", "END")), ({"stop": "END", "do_sample": True},
                                                                               ("END",))]:
        c = grpokit_config(GRPOConfig(generation_kwargs=kwargs), model_path="m", dtype="float32", num_rows=64)
        assert c.rollout.stop_strings == stops
    assert grpokit_config(GRPOConfig(shuffle_dataset=False), model_path="m", dtype="float32",
                          num_rows=64).data.shuffle is False  # the dataset's own order (data.shuffle)
    cases = [(dict(generation_kwargs={"repetition_penalty": 1.1, "stop": "x"}), r"refused keys: repetition_penalty"),
             (dict(generation_kwargs={"do_sample": False}), "refused keys: do_sample"),
             (dict(accelerator_config={"split_batches": True}), "split_batches would change the batches"),
             (dict(dataloader_num_workers=-1), "dataloader_num_workers=-1 .must be >= 0"),
             (dict(entropy_coef=-0.01), "entropy_coef=-0.01 .grpokit's entropy bonus needs a coefficient >= 0")]
    # entropy_coef with any loss type: TRL's aggregation of the bonus (tests/test_entropy_bonus.py)
    algo = grpokit_config(GRPOConfig(loss_type="grpo", entropy_coef=0.01), model_path="m", dtype="float32",
                          num_rows=64).algorithm
    assert (algo.entropy_coef, algo.entropy_aggregation) == (0.01, "token_mean")
    for trl_args, match in cases:
        with pytest.raises(ConfigError, match=match):
            GRPOConfig(**trl_args)


def test_the_trainer_accelerator_names_what_it_lacks(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(str(tiny_model_dir), length, train_dataset=ROWS,
                          args=GRPOConfig(output_dir=str(tmp_path / "o"), **RUN))
    assert (trainer.accelerator.num_processes, trainer.accelerator.process_index) == (1, 0)
    assert trainer.accelerator.unwrap_model(trainer.model) is trainer.model
    with pytest.raises(AttributeError, match="grpokit does not run on Accelerate"):
        trainer.accelerator.gather
    trainer.model = "not a model"
    with pytest.raises(ConfigError, match="trainer.model: a str was assigned; train.. trains a torch module"):
        trainer.train()


def test_a_hub_id_loads_from_the_cache(tiny_model_dir, tmp_path, monkeypatch):
    """`model="org/name"` is the Hub snapshot in the (offline) Hugging Face cache, loaded as the module."""
    from huggingface_hub import constants

    storage = tmp_path / "hf-hub" / "models--org--tiny-policy"
    shutil.copytree(tiny_model_dir, storage / "snapshots" / "0123abcd")
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no local folder called org/
    trainer = GRPOTrainer("org/tiny-policy", length, train_dataset=ROWS, args=GRPOConfig(output_dir="o", **RUN))
    assert isinstance(trainer.model, torch.nn.Module) and trainer.config.model.path == "org/tiny-policy"
    assert trainer.model.config.model_type == "qwen2" and trainer.processing_class("1+1=")["input_ids"]
