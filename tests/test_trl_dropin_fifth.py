"""grpokit.trl against issue 52's drop-in points (each failed before its fix):

1. `save_model()` prints no progress bar (transformers' "Writing model shards"), as grpokit's own saves;
2. reward functions get TRL's `trainer_state`, a transformers TrainerState that advances with training, in the
   drop-in and in grpokit's own loop (the CLI's `rewards.functions`);
3. a Qwen3-style chat template that rewrites earlier turns trains with tools: `tools.history = "split"` is chosen
   for it, with one note line (the drop-in, and grpokit's own `train`);
4. iterable datasets: TRL's `dataloader_num_workers = 0` for an IterableDataset train set, and its
   `get_train_dataloader()` / `get_eval_dataloader()`;
5. `use_liger_kernel` with a peft adapter on `lm_head` or a prompt-learning config: TRL's refusals, naming them.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import make_config
from grpokit.errors import ConfigError
from grpokit.trl import GRPOConfig, GRPOTrainer
from test_history_split import THINK_TEMPLATE, add  # the tool, and a template that drops earlier turns' <think>

ROWS = [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(2)]
RUN = dict(max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
           learning_rate=1e-2, disable_tqdm=True, logging_steps=1)


def ordinal(completions, **kwargs):
    """A reward with signal in every group, so every step changes the weights."""
    return [float(i % 4) for i in range(len(completions))]


# ---- 1. save_model prints no progress bar ------------------------------------------------------------


def test_save_model_prints_no_progress_bar(tiny_model_dir, tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # a user's setting (another test's CLI call may have turned it off)
    try:
        trainer = GRPOTrainer(str(tiny_model_dir), ordinal, args=GRPOConfig(output_dir=str(tmp_path / "o"), **RUN),
                              train_dataset=ROWS)
        capfd.readouterr()
        trainer.save_model(str(tmp_path / "saved"))
        out = capfd.readouterr()
        assert "Writing model shards" not in out.err + out.out and "it/s]" not in out.err + out.out, out.err
        assert (tmp_path / "saved" / "model.safetensors").is_file()
        assert hf_logging.is_progress_bar_enabled()  # the user's own bars stay on afterwards
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


# ---- 2. trainer_state reaches the reward functions -----------------------------------------------------


def test_reward_functions_get_trls_trainer_state_that_advances(tiny_model_dir, tmp_path):
    """TRL's test_train_with_reward_func_accessing_trainer_state, and what the state says: TRL's optimizer steps
    (num_iterations=2: two per generation batch, so generations at global_step 0 and 2 of max_steps 4)."""
    from transformers import TrainerState

    seen = []

    def staged(completions, trainer_state=None, **kwargs):
        assert isinstance(trainer_state, TrainerState)
        seen.append((trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch))
        return ordinal(completions)

    args = GRPOConfig(output_dir=str(tmp_path / "o"), **{**RUN, "max_steps": 4}, num_iterations=2)
    trainer = GRPOTrainer(str(tiny_model_dir), staged, args=args, train_dataset=ROWS)
    trainer.train()
    assert [s[0] for s in seen] == [0, 2] and {s[1] for s in seen} == {4}
    assert [s[2] for s in seen] == [0.0, pytest.approx(1 / 8)]  # one prompt of 8 used before the second draw


REWARD_FILE = '''
import json


def staged(completions, trainer_state=None, **kwargs):
    with open({log!r}, "a") as f:
        f.write(json.dumps([trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch,
                            len(completions)]) + "\\n")
    return [float(i % 4) for i in range(len(completions))]
'''


def test_the_clis_reward_functions_get_a_trainer_state_that_advances(tiny_model_dir, tmp_path):
    """A `rewards.functions = ["file.py:fn"]` reward of a `grpokit train` config, loaded and called as the CLI's;
    in the evaluation during training ([eval]) too, with the steps done by then."""
    from grpokit.config.schema import RewardConfig
    from grpokit.training.loop import train

    log = tmp_path / "seen.jsonl"
    (tmp_path / "staged.py").write_text(REWARD_FILE.format(log=str(log)))
    config = make_config(tiny_model_dir, tmp_path / "run", steps=3, prompts_per_step=2, num_prompts=8,
                         eval={"every": 2, "num_prompts": 1, "samples_per_prompt": 2, "greedy": False})
    config = dataclasses.replace(config, rewards=RewardConfig(functions=(f"{tmp_path / 'staged.py'}:staged",)))
    train(config)
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    drawn = [s for s in seen if s[3] == 8]  # training: 2 prompts x 4 answers; evaluation: 1 x 2
    assert [s[0] for s in drawn] == [0, 1, 2] and {s[1] for s in seen} == {3}
    assert [s[2] for s in drawn] == [0.0, pytest.approx(0.25), pytest.approx(0.5)]  # 2 of 8 prompts a step
    assert [s[0] for s in seen if s[3] == 2] == [2, 3]  # evaluated after steps 2 and 3


# ---- 3. a template that rewrites earlier turns trains with tools ---------------------------------------


# Qwen3's way: the assistant header opens <think>, and only the last assistant turn keeps it
QWEN3_LIKE = THINK_TEMPLATE


@pytest.fixture(scope="module")
def qwen3_like_dir(tmp_path_factory):
    from grpokit.models.tiny import TOOL_WORDS, build_char_tokenizer, build_tiny_model

    path = tmp_path_factory.mktemp("qwen3-like")
    tokenizer = build_char_tokenizer(words=("<think>", "</think>", *TOOL_WORDS))
    tokenizer.chat_template = QWEN3_LIKE
    build_tiny_model(path, tokenizer=tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seed=0)
    return path


def _notes(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("note:") and "tools.history" in line]


def test_the_dropin_trains_a_qwen3_like_template_with_tools_on_the_split_history(qwen3_like_dir, tool_model_dir,
                                                                                  tmp_path, capfd):
    """TRL's test_train_with_tools on a Qwen3-family template: TRL swaps in a prefix-preserving template, the
    drop-in trains the conversations as the model's own template renders them (tools.history = "split")."""
    args = GRPOConfig(output_dir=str(tmp_path / "o"), **{**RUN, "max_steps": 1, "max_completion_length": 8})
    trainer = GRPOTrainer(str(qwen3_like_dir), ordinal, args=args, train_dataset=ROWS, tools=[add])
    assert trainer.config.tools.history == "split"
    output = trainer.train()
    assert output.global_step == 1 and trainer.state.log_history[-1]["train_loss"] is not None
    assert len(_notes(capfd.readouterr().err)) == 1  # said once, at construction (the loop sees "split" given)
    plain = GRPOTrainer(str(tool_model_dir), ordinal, args=GRPOConfig(output_dir=str(tmp_path / "p"), **RUN),
                        train_dataset=ROWS, tools=[add])
    assert plain.config.tools.history == "append" and not _notes(capfd.readouterr().err)  # appends as it is


def test_grpokits_own_train_chooses_the_split_history_for_such_a_template(qwen3_like_dir, tmp_path, capfd):
    """The CLI's path (`grpokit train` with [tools]): the refusal lived in the shared start-up checks."""
    from grpokit.training.loop import train

    config = make_config(qwen3_like_dir, tmp_path / "run", steps=1, num_prompts=8, max_new_tokens=6)
    run = train(config, reward_functions=[ordinal], tools=[add])
    assert len(_notes(capfd.readouterr().err)) == 1
    assert 'history = "split"' in (run / "config.toml").read_text()  # what the run folder records is what ran


# ---- 4. iterable datasets: TRL's data loader workers -------------------------------------------------


def test_an_iterable_train_set_forces_num_workers_zero(tiny_model_dir, tmp_path, capfd):
    """TRL's test_iterable_dataset_forces_num_workers_zero and test_train_with_iterable_dataset's args check."""
    from datasets import Dataset

    stream = Dataset.from_list(ROWS).to_iterable_dataset()
    args = GRPOConfig(output_dir=str(tmp_path / "o"), dataloader_num_workers=4, **RUN)
    trainer = GRPOTrainer(str(tiny_model_dir), ordinal, args=args, train_dataset=stream)
    assert trainer.args.dataloader_num_workers == 0
    assert trainer.args.accelerator_config.dispatch_batches is False
    assert "`dataloader_num_workers=0`" in capfd.readouterr().err  # TRL's warning, as one line
    loader = trainer.get_train_dataloader()
    assert loader.num_workers == 0
    first = next(iter(loader))  # one generation batch: each prompt num_generations times, as TRL's sampler gives
    assert len(first) == 4 and len({row["prompt"] for row in first}) == 1


def test_an_iterable_eval_set_keeps_the_map_style_train_sets_workers(tiny_model_dir, tmp_path):
    """TRL's test_iterable_eval_keeps_map_style_train_workers."""
    from datasets import Dataset

    args = GRPOConfig(output_dir=str(tmp_path / "o"), per_device_eval_batch_size=4, dataloader_num_workers=4,
                      **{k: v for k, v in RUN.items() if k != "per_device_eval_batch_size"})
    trainer = GRPOTrainer(str(tiny_model_dir), ordinal, args=args, train_dataset=Dataset.from_list(ROWS),
                          eval_dataset=Dataset.from_list(ROWS[:2]).to_iterable_dataset())
    assert trainer.args.dataloader_num_workers == 4  # not disabled by the iterable eval set
    assert trainer.get_train_dataloader().num_workers == 4
    assert trainer.get_eval_dataloader().num_workers == 0  # the iterable eval loader alone: one worker
    assert trainer.args.dataloader_num_workers == 4  # scoped, not persisted
    batch = next(iter(trainer.get_eval_dataloader()))
    assert [row["prompt"] for row in batch] == [ROWS[0]["prompt"]] * 4  # num_generations_eval per prompt
    no_eval = GRPOTrainer(str(tiny_model_dir), ordinal, args=GRPOConfig(output_dir=str(tmp_path / "p"), **RUN),
                          train_dataset=ROWS)
    with pytest.raises(ConfigError, match="eval_dataset"):
        no_eval.get_eval_dataloader()


# ---- 5. use_liger_kernel with peft: TRL's refusals ---------------------------------------------------


def test_liger_with_a_peft_adapter_on_lm_head_or_prompt_learning_is_refused_naming_it(tiny_model_dir, tmp_path):
    """TRL's test_liger_kernel_with_peft_lm_head_raises / _prompt_learning_raises (and _non_lm_head_target_allowed:
    accepted, grpokit's chunked log-probs being the fused path)."""
    from peft import LoraConfig, PromptTuningConfig, TaskType

    liger = GRPOConfig(output_dir=str(tmp_path / "o"), use_liger_kernel=True, **RUN)
    with pytest.raises(ConfigError, match="lm_head") as refused:
        GRPOTrainer(str(tiny_model_dir), ordinal, args=liger, train_dataset=ROWS,
                    peft_config=LoraConfig(target_modules=["q_proj", "v_proj", "lm_head"]))
    assert "use_liger_kernel" in str(refused.value) and "target_modules" in str(refused.value)
    with pytest.raises(ConfigError, match="prompt-learning"):
        GRPOTrainer(str(tiny_model_dir), ordinal, args=liger, train_dataset=ROWS,
                    peft_config=PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=8))
    trainer = GRPOTrainer(str(tiny_model_dir), ordinal, args=liger, train_dataset=ROWS,
                          peft_config=LoraConfig(target_modules=["q_proj", "v_proj"]))
    assert isinstance(trainer.model, torch.nn.Module)
    plain = GRPOConfig(output_dir=str(tmp_path / "p"), **RUN)  # TRL 1.16 refuses an lm_head adapter without Liger too
    with pytest.raises(ConfigError, match="lm_head"):
        GRPOTrainer(str(tiny_model_dir), ordinal, args=plain, train_dataset=ROWS,
                    peft_config=LoraConfig(target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ConfigError, match="prompt-learning"):
        GRPOTrainer(str(tiny_model_dir), ordinal, args=plain, train_dataset=ROWS,
                    peft_config=PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=8))
