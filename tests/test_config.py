"""Config: defaults, TOML + overrides, and an error naming the field for every bad value."""

from __future__ import annotations

import pytest

from grpokit.config import (AlgorithmConfig, Config, ConfigError, DataConfig, ModelConfig, RolloutConfig,
                            TrainConfig, config_from_dict, load_config, to_toml)

BASE = {"model": {"path": "m"}, "data": {"task": "addition"}}


def test_defaults_follow_design():
    c = config_from_dict(BASE)
    assert c.algorithm.loss_type == "dapo" and c.algorithm.beta == 0.0 and c.algorithm.epsilon == 0.2
    assert c.algorithm.clip_high == 0.2 and c.algorithm.scale_rewards == "group" and c.algorithm.std == "population"
    assert c.algorithm.num_iterations == 1 and not c.needs_old_logprobs
    assert c.generation_batch_size == 8 * 8 == c.minibatch_size == c.micro_batch_size


def test_toml_file_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\npath = "m"\n[data]\ntask = "addition"\n[train]\nsteps = 5\n')
    c = load_config(path, ["train.steps=7", "algorithm.epsilon_high=0.28", 'rollout.stop_strings=["\\n"]',
                           "algorithm.loss_type=grpo"])
    assert c.train.steps == 7 and c.algorithm.clip_high == 0.28 and c.rollout.stop_strings == ("\n",)
    assert c.algorithm.loss_type == "grpo"


def test_resolved_config_round_trips_through_toml(tmp_path):
    c = load_config(None, ["train.steps=3", "data.task_args={digits = 3}", "rewards.functions=['a.py:f']"], base=BASE)
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(c))
    assert load_config(path) == c


@pytest.mark.parametrize("raw, needle", [
    ({**BASE, "trian": {}}, "unknown section [trian] (did you mean 'train'?)"),
    ({**BASE, "train": {"learnig_rate": 1.0}}, "unknown key train.learnig_rate (did you mean 'learning_rate'?)"),
    ({"data": {"task": "addition"}}, "missing section [model]"),
    ({**BASE, "rollout": {"group_size": 1}}, "rollout.group_size: must be >= 2"),
    ({**BASE, "algorithm": {"epsilon": 1.5}}, "algorithm.epsilon: must be in (0, 1)"),
    ({**BASE, "algorithm": {"beta": -0.1}}, "algorithm.beta: must be >= 0"),
    ({**BASE, "algorithm": {"loss_type": "ppo"}}, "algorithm.loss_type: got 'ppo'; choose one of 'grpo'"),
    ({**BASE, "algorithm": {"scale_rewards": "std"}}, "algorithm.scale_rewards"),
    ({**BASE, "train": {"minibatch_size": 48}}, "train.minibatch_size: 48 must divide the generation batch of 64"),
    ({**BASE, "train": {"micro_batch_size": 5}}, "train.micro_batch_size: 5 must divide"),
    ({"model": {"path": "m"}, "data": {"task": "addition", "path": "x.jsonl"}}, "set exactly one of data.task or data.path"),
    ({"model": {"path": ""}, "data": {"task": "addition"}}, "model.path"),
    ({**BASE, "rewards": {"functions": ["a", "b"], "weights": [1.0]}}, "rewards.weights: has 1 values for 2 functions"),
    ({**BASE, "rollout": {"temperature": 0.0}}, "rollout.temperature: must be > 0"),
])
def test_bad_values_name_the_field(raw, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert needle in str(e.value)


def test_bad_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["train.steps"], base=BASE)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\npath=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_same_config_from_python():
    c = Config(model=ModelConfig(path="m"), data=DataConfig(task="addition"),
               rollout=RolloutConfig(group_size=4), algorithm=AlgorithmConfig(num_iterations=2),
               train=TrainConfig(prompts_per_step=2, micro_batch_size=4))
    assert c.generation_batch_size == 8 and c.micro_batch_size == 4 and c.needs_old_logprobs
    with pytest.raises(Exception):
        c.train.steps = 3  # frozen
