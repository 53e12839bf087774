"""Config: defaults, TOML + overrides, and an error naming the field for every bad value."""

from __future__ import annotations

import pytest

from grpokit.config.loading import config_from_dict, load_config, to_toml
from grpokit.config.schema import (
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    OutputConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)
from grpokit.errors import ConfigError

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
    ({"model": {"path": "m"}, "data": {"task": "addition", "path": "x.jsonl"}},
     "set exactly one of data.task or data.path"),
    ({"model": {"path": ""}, "data": {"task": "addition"}}, "model.path"),
    ({**BASE, "rewards": {"functions": ["a", "b"], "weights": [1.0]}}, "rewards.weights: has 1 values for 2 functions"),
    ({**BASE, "rollout": {"temperature": 0.0}}, "rollout.temperature: must be > 0"),
    # a step holds all its answers at once: past 2**20 it would only allocate until the machine gives up
    ({**BASE, "train": {"prompts_per_step": 10**23}}, "train.prompts_per_step: train.prompts_per_step 10000000000"),
    ({**BASE, "rollout": {"group_size": 2**21}}, "rollout.group_size: train.prompts_per_step 8 x rollout.group_size"),
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


# ------------------------------------------------------------------ types: every field, its name and the fix


@pytest.mark.parametrize("override, message", [
    ("train.steps=abc", "train.steps: must be an integer, got 'abc' (a string); e.g. train.steps = 100"),
    ("train.steps=2.5", "train.steps: must be an integer, got 2.5 (float); e.g. train.steps = 100"),
    ("train.steps=true", "train.steps: must be an integer, got true (a boolean)"),
    ("rollout.group_size=2.5", "rollout.group_size: must be an integer, got 2.5 (float)"),
    ('algorithm.dynamic_sampling="false"', "algorithm.dynamic_sampling: must be true or false, got 'false' "
                                           "(a string); write it without quotes: algorithm.dynamic_sampling = false"),
    ("algorithm.dynamic_sampling=1", "algorithm.dynamic_sampling: must be true or false, got 1 (int)"),
    ("train.learning_rate=inf", "train.learning_rate: must be a finite number, got inf (float)"),
    ("train.learning_rate=nan", "train.learning_rate: must be a finite number, got nan (float)"),
    ('train.learning_rate="1e-5"', "write it without quotes: train.learning_rate = 1e-5"),
    ("rollout.temperature=-inf", "rollout.temperature: must be a finite number"),
    ("train.adam_betas=[2.0,3.0]", "train.adam_betas: each must be in [0, 1), got [2.0, 3.0]"),
    ("train.adam_betas=[0.9]", "train.adam_betas: must be a list of 2 finite numbers, got [0.9] (a list)"),
    ("train.adam_betas=[0.9,nan]", "train.adam_betas: item 2 must be a finite number, got nan"),
    ("rewards.functions=[1]", "rewards.functions: item 1 must be a string, got 1 (int)"),
    ('rewards.functions=[""]', "rewards.functions: item 1 must not be empty"),
    ("rewards.functions=addition", 'rewards.functions: must be a list of strings, got \'addition\' (a string); '
                                   'e.g. rewards.functions = ["addition"]'),
    ("rewards.weights=[inf]", "rewards.weights: item 1 must be a finite number, got inf"),
    ('rewards.weights=["1"]', "rewards.weights: item 1 must be a finite number, got '1' (a string)"),
    ("rewards.args={addition=1}", "rewards.args.addition: must be a table, got 1 (int)"),
    ("rewards.args=[1]", "rewards.args: must be a table, got [1] (a list)"),
    ("rollout.stop_strings=[1]", "rollout.stop_strings: item 1 must be a string"),
    ("model.lora=8", "model.lora: must be a table, got 8 (int); e.g. model.lora = {r = 8, alpha = 16}"),
    ("model.lora={r=true}", "model.lora.r: must be an integer, got true (a boolean)"),
    ("model.lora={alpha=inf}", "model.lora.alpha: must be a finite number"),
    ("model.lora={target_modules=[1]}", "model.lora.target_modules: item 1 must be a string"),
    ("data.task_args=2", "data.task_args: must be a table, got 2 (int); e.g. data.task_args = {digits = 2}"),
    ("rollout.vllm=1", "rollout.vllm: must be a table"),
    ("rollout.vllm={gpu_memory_utilization='a'}", "rollout.vllm.gpu_memory_utilization: must be a finite number"),
    ("rollout.vllm={gpu_memory_utilization=1.5}", "rollout.vllm.gpu_memory_utilization: must be in (0, 1]"),
    ("rollout.vllm={max_model_len=1.5}", "rollout.vllm.max_model_len: must be an integer"),
    ("rollout.vllm={enforce_eager='yes'}", "rollout.vllm.enforce_eager: must be true or false"),
    ("rollout.vllm={dtype=16}", "rollout.vllm.dtype: must be a string, got 16 (int)"),
    ("output.dir=", "output.dir: must not be empty"),
    ("data.prompt_column=", "data.prompt_column: must not be empty"),
    ("model.device=gpu", "model.device: got 'gpu'; use auto, cpu, cuda"),
    ("output.save_every=1.5", "output.save_every: must be an integer, got 1.5 (float)"),
    ("output.completions_every=-1", "output.completions_every: must be >= 0"),
    ("train.weight_decay=-0.1", "train.weight_decay: must be >= 0"),
    ("train.logprob_chunk_size=0", "train.logprob_chunk_size: must be >= 1"),
    ("train.seed=-1", "train.seed: must be in [0, 2**63)"),
    ("train.learning_rate=1" + "0" * 400, "train.learning_rate: must be a finite number"),
])
def test_wrong_types_name_the_field_and_the_fix(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override], base=BASE)
    assert message in str(e.value)
    assert str(e.value).startswith(override.split("=")[0])


@pytest.mark.parametrize("make, message", [
    (lambda: TrainConfig(steps=2.5), "train.steps: must be an integer, got 2.5 (float)"),
    (lambda: TrainConfig(steps=True), "train.steps: must be an integer, got true (a boolean)"),
    (lambda: TrainConfig(learning_rate=float("inf")), "train.learning_rate: must be a finite number"),
    (lambda: TrainConfig(adam_betas=(2.0, 3.0)), "train.adam_betas: each must be in [0, 1)"),
    (lambda: TrainConfig(adam_betas=(0.9, "0.99")), "train.adam_betas: item 2 must be a finite number"),
    (lambda: RolloutConfig(group_size=2.5), "rollout.group_size: must be an integer"),
    (lambda: RolloutConfig(temperature=float("nan")), "rollout.temperature: must be a finite number"),
    (lambda: RolloutConfig(stop_strings="\n"), "rollout.stop_strings: must be a list of strings"),
    (lambda: AlgorithmConfig(dynamic_sampling="false"), "algorithm.dynamic_sampling: must be true or false"),
    (lambda: OutputConfig(dir=2024), 'output.dir: must be a string, got 2024 (int); quote it: output.dir = "2024"'),
    (lambda: ModelConfig(path="m", lora=[8]), "model.lora: must be a table"),
    (lambda: DataConfig(task="additon"), "data.task: unknown task 'additon' (did you mean 'addition'?)"),
    (lambda: DataConfig(task="addition", task_args="digits=2"), "data.task_args: must be a table"),
    (lambda: RewardConfig(functions=("a",), weights=(True,)), "rewards.weights: item 1 must be a finite number"),
    (lambda: RewardConfig(args={"a": 1}), "rewards.args.a: must be a table"),
    (lambda: Config(model="m", data=DataConfig(task="addition")), "model: must be a ModelConfig"),
])
def test_python_api_is_type_checked_too(make, message):
    with pytest.raises(ConfigError) as e:
        make()
    assert message in str(e.value)


def test_ints_become_floats_and_lists_tuples():
    c = TrainConfig(learning_rate=1, adam_betas=[0, 0.5])
    assert c.learning_rate == 1.0 and type(c.learning_rate) is float and c.adam_betas == (0.0, 0.5)
    r = RewardConfig(functions=["a", "b"], weights=[1, 2])
    assert r.functions == ("a", "b") and r.weights == (1.0, 2.0) and all(type(w) is float for w in r.weights)


def test_set_on_a_string_field_keeps_the_raw_text():
    c = load_config(None, ["output.dir=2024", "model.path=123", "data.prompt_column=true"],
                    base={"model": {"path": "m"}, "data": {"path": "x.jsonl"}})
    assert (c.output.dir, c.model.path, c.data.prompt_column) == ("2024", "123", "true")
    assert load_config(None, ['output.dir="runs/a b"'], base=BASE).output.dir == "runs/a b"  # quoted: TOML
    with pytest.raises(ConfigError, match="data.task: unknown task '12'"):  # the text, then checked as a name
        load_config(None, ["data.task=12"], base=BASE)


def test_a_number_for_a_string_field_in_a_toml_file_says_quote_it(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\npath = "m"\n[data]\ntask = "addition"\n[output]\ndir = 2024\n')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == 'output.dir: must be a string, got 2024 (int); quote it: output.dir = "2024"'


def test_a_non_utf8_byte_names_the_file_line_and_byte(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[model]\npath = "m"\n# café\n[data]\ntask = "addition"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: line 3: byte 0xe9 is not UTF-8; re-save the file as UTF-8"


def test_data_task_is_checked_with_a_suggestion():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.path=", "data.task=additon"], base=BASE)
    assert str(e.value).startswith("data.task: unknown task 'additon' (did you mean 'addition'?); built-in tasks: "
                                   "addition, countdown")


def test_task_names_match_the_task_registry():
    from grpokit.config.variants import TASK_NAMES
    from grpokit.tasks import TASKS

    assert list(TASK_NAMES) == sorted(TASKS)


def test_a_preset_does_not_see_badly_typed_values_first():
    # apply_preset merges into [rewards]; a wrong type is reported by name before it does.
    with pytest.raises(ConfigError, match="rewards.functions: must be a list of strings, got 5"):
        load_config(None, ["algorithm.preset=dapo", "rewards.functions=5"], base=BASE)
    with pytest.raises(ConfigError, match="rewards.args: must be a table"):
        load_config(None, ["algorithm.preset=dapo", "rewards.args=[1]"], base=BASE)


def test_set_into_a_section_that_is_not_a_table(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('train = 5\n[model]\npath = "m"\n[data]\ntask = "addition"\n')
    with pytest.raises(ConfigError, match=r"\[train\] must be a table"):
        load_config(path, ["train.steps=3"])


def test_good_vllm_options_are_kept_and_typed():
    r = RolloutConfig.__new__(RolloutConfig)  # engine = "vllm" needs vLLM installed; check the options alone
    object.__setattr__(r, "vllm", {"gpu_memory_utilization": 1, "enforce_eager": True, "dtype": "bfloat16"})
    from grpokit.config.options import check_vllm

    check_vllm(r)
    assert r.vllm == {"gpu_memory_utilization": 1.0, "enforce_eager": True, "dtype": "bfloat16"}
    assert type(r.vllm["gpu_memory_utilization"]) is float
