"""Variant presets (`algorithm.preset`) and the variant options as config fields: resolution,
precedence, errors, the saved config, and a short training run of each from the CLI."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from conftest import make_config, parity
from grpokit.cli import main as cli_main
from grpokit.config.loading import config_from_dict, load_config, to_toml
from grpokit.config.presets import PRESETS, apply_preset, preset_fields
from grpokit.config.schema import AlgorithmConfig
from grpokit.config.variants import ENVIRONMENT_TASKS
from grpokit.errors import ConfigError
from grpokit.observe.tracking import read_metrics
from grpokit.rewards.registry import reward_specs
from grpokit.tasks import TASKS, get_task

BASE = {"model": {"path": "m"}, "data": {"task": "addition"}}


def build(**sections):
    raw = {**BASE, **sections}
    return config_from_dict(json.loads(json.dumps(raw)))  # a deep copy: the input must not be mutated anyway


# ---------------------------------------------------------------- resolution


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_sets_its_fields_and_records_its_name(name):
    algo = build(algorithm={"preset": name}).algorithm
    assert algo.preset == name
    for key, value in PRESETS[name]["algorithm"].items():
        assert getattr(algo, key) == value, key


def test_the_presets_say_what_the_papers_say():
    c = {n: build(algorithm={"preset": n}).algorithm for n in PRESETS}
    assert (c["grpo"].loss_type, c["grpo"].beta, c["grpo"].scale_rewards) == ("grpo", 0.04, "group")
    assert (c["dr_grpo"].loss_type, c["dr_grpo"].scale_rewards, c["dr_grpo"].beta) == ("dr_grpo", "none", 0.0)
    assert (c["dapo"].epsilon, c["dapo"].clip_high, c["dapo"].dynamic_sampling, c["dapo"].loss_type,
            c["dapo"].beta) == (0.2, 0.28, True, "dapo", 0.0)
    assert (c["gspo"].importance_sampling_level, c["gspo"].epsilon, c["gspo"].clip_high) == ("sequence", 3e-4, 4e-4)
    assert (c["cispo"].loss_type, c["cispo"].cispo_cap) == ("cispo", 5.0)  # ScaleRL's eps_max, TRL's epsilon_high
    assert (c["sapo"].loss_type, c["sapo"].sapo_temperature_pos, c["sapo"].sapo_temperature_neg) == ("sapo", 1.0, 1.05)
    assert (c["luspo"].loss_type, c["luspo"].importance_sampling_level, c["luspo"].epsilon) == ("luspo", "sequence",
                                                                                                3e-4)
    assert (c["vespo"].loss_type, c["vespo"].vespo_k_pos, c["vespo"].vespo_lambda_pos, c["vespo"].vespo_k_neg,
            c["vespo"].vespo_lambda_neg, c["vespo"].importance_sampling_level) == ("vespo", 2.0, 3.0, 3.0, 2.0, "token")
    assert all(not a.warnings for a in c.values())  # no preset sets something its own start-up note would question


def test_fields_you_set_win_over_the_preset():
    algo = build(algorithm={"preset": "grpo", "beta": 0.0, "epsilon": 0.1}).algorithm
    assert (algo.beta, algo.epsilon, algo.loss_type) == (0.0, 0.1, "grpo")


def test_preset_and_overrides_from_the_command_line_syntax(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\npath = "m"\n[data]\ntask = "addition"\n[algorithm]\nepsilon = 0.15\n')
    c = load_config(toml, ["algorithm.preset=dapo", "algorithm.epsilon_high=0.3"])
    assert (c.algorithm.preset, c.algorithm.epsilon, c.algorithm.epsilon_high) == ("dapo", 0.15, 0.3)
    assert c.algorithm.dynamic_sampling


def test_unknown_preset_is_a_config_error_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"algorithm.preset: unknown preset 'dappo' \(did you mean 'dapo'\?\)"):
        build(algorithm={"preset": "dappo"})
    with pytest.raises(ConfigError, match="algorithm.preset"):
        AlgorithmConfig(preset="ppo")
    with pytest.raises(ConfigError, match="algorithm.preset"):
        build(algorithm={"preset": ["dapo"]})


def test_no_preset_changes_nothing():
    raw = {**BASE, "algorithm": {"beta": 0.1}}
    assert apply_preset(raw) is raw
    # a Config resolves is_correction "auto" for its rollout mode (sync: "none")
    assert build(algorithm={}).algorithm == dataclasses.replace(AlgorithmConfig(), is_correction="none")


def test_preset_fields_is_a_copy():
    fields = preset_fields("dapo")
    fields["algorithm"]["epsilon_high"] = 9.0
    assert PRESETS["dapo"]["algorithm"]["epsilon_high"] == 0.28
    assert preset_fields("dapo")["adds_reward"] == "soft_overlong_penalty"
    assert "adds_reward" not in preset_fields("grpo")


# ---------------------------------------------------------------- dapo's soft overlong penalty


def test_dapo_adds_the_soft_overlong_penalty_after_the_tasks_verifier():
    r = build(algorithm={"preset": "dapo"}, rollout={"max_new_tokens": 20}).rewards
    assert r.functions == ("addition", "soft_overlong_penalty")
    assert r.args["soft_overlong_penalty"] == {"max_completion_length": 20, "overlong_buffer": 4}
    assert r.weights == ()
    small = build(algorithm={"preset": "dapo"}, rollout={"max_new_tokens": 2}).rewards
    assert small.args["soft_overlong_penalty"]["overlong_buffer"] == 1  # never 0 (that would be a hard cliff)
    default = build(algorithm={"preset": "dapo"}).rewards  # rollout.max_new_tokens left at its default (64)
    assert default.args["soft_overlong_penalty"] == {"max_completion_length": 64, "overlong_buffer": 13}


def test_dapo_appends_to_your_functions_and_weights_and_keeps_your_own_penalty():
    r = build(algorithm={"preset": "dapo"}, rewards={"functions": ["numeric_match", "format"], "weights": [1, 0.5]},
              rollout={"max_new_tokens": 10}).rewards
    assert r.functions == ("numeric_match", "format", "soft_overlong_penalty") and r.weights == (1.0, 0.5, 1.0)
    mine = {"functions": ["addition", "soft_overlong_penalty"],
            "args": {"soft_overlong_penalty": {"max_completion_length": 9, "overlong_buffer": 3}}}
    r = build(algorithm={"preset": "dapo"}, rewards=mine).rewards
    assert r.functions == ("addition", "soft_overlong_penalty")
    assert r.args["soft_overlong_penalty"] == {"max_completion_length": 9, "overlong_buffer": 3}
    r = build(algorithm={"preset": "dapo"}, rewards={"args": {"soft_overlong_penalty": {
        "max_completion_length": 5, "overlong_buffer": 2}}}).rewards  # your args for the penalty it adds
    assert r.args["soft_overlong_penalty"] == {"max_completion_length": 5, "overlong_buffer": 2}


def test_dapo_without_task_or_functions_says_what_to_set():
    with pytest.raises(ConfigError, match="adds soft_overlong_penalty to rewards.functions, which is empty"):
        config_from_dict({"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "algorithm": {"preset": "dapo"}})


def test_dapo_passes_the_verifiers_task_arguments_along():
    r = build(data={"task": "countdown", "task_args": {"format_score": 0.1, "num_numbers": 3}},
              algorithm={"preset": "dapo"}).rewards
    assert r.functions == ("countdown", "soft_overlong_penalty") and r.args["countdown"] == {"format_score": 0.1}


@pytest.mark.parametrize("task_name", sorted(TASKS))
def test_the_named_verifier_scores_like_the_tasks_own(task_name):
    # guards the preset's rule for naming a task's verifier (and its arguments) against drift
    task_args = {"format_score": 0.1} if task_name == "countdown" else {}
    task = get_task(task_name, **task_args)
    r = build(data={"task": task_name, "task_args": task_args}, algorithm={"preset": "dapo"}).rewards
    if task_name in ENVIRONMENT_TASKS:  # its reward is its environment's get_reward: only the penalty is named
        assert not task.reward_functions() and r.functions == ("soft_overlong_penalty",)
        return
    named = reward_specs(list(r.functions), args=r.args)[0]
    own = task.reward_functions()[0]
    rows = task.generate(20, seed=0)
    rng = random.Random(0)
    completions = [task.sft_target(row, rng) if i % 3 else "1+1" for i, row in enumerate(rows)]
    columns = {k: [row[k] for row in rows] for k in rows[0] if k != "prompt"}
    assert named.name == own.name
    assert named.fn(completions, **columns) == own.fn(completions, **columns)


# ---------------------------------------------------------------- the other options as fields


def test_option_fields_are_validated():
    with pytest.raises(ConfigError, match="algorithm.advantage_estimator: got 'ppo'"):
        AlgorithmConfig(advantage_estimator="ppo")
    with pytest.raises(ConfigError, match="applies to advantage_estimator = 'grpo' only"):
        AlgorithmConfig(advantage_estimator="rloo", scale_rewards="none")
    with pytest.raises(ConfigError, match="algorithm.entropy_coef"):
        AlgorithmConfig(entropy_coef=-0.1)
    with pytest.raises(ConfigError, match="algorithm.top_entropy_quantile"):
        AlgorithmConfig(top_entropy_quantile=1.2)
    assert AlgorithmConfig(top_entropy_quantile=0.2).uses_entropy and not AlgorithmConfig().uses_entropy


def test_resolved_config_round_trips_through_the_saved_toml(tmp_path):
    c = build(algorithm={"preset": "dapo", "advantage_estimator": "rloo", "kl_bias_correction": True},
              rollout={"max_new_tokens": 8})
    saved = tmp_path / "config.toml"
    saved.write_text(to_toml(c))
    assert load_config(saved) == c  # the preset re-applies under explicit values: nothing changes


# ---------------------------------------------------------------- training


def _toml(tmp_path, model_dir):
    path = tmp_path / "variant.toml"
    path.write_text(f"""[model]
path = {json.dumps(str(model_dir))}
[data]
task = "addition"
num_prompts = 64
[rollout]
group_size = 4
max_new_tokens = 5
[train]
steps = 1
prompts_per_step = 4
learning_rate = 1e-3
[output]
console = false
""")
    return path


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_trains_from_the_cli(tiny_model_dir, tmp_path, name):
    run = tmp_path / name
    code = cli_main(["train", str(_toml(tmp_path, tiny_model_dir)), "--set", f"algorithm.preset={json.dumps(name)}",
                     "--set", f"output.dir={json.dumps(str(run))}", "--set", "algorithm.max_resample_rounds=1"])
    assert code == 0
    row = read_metrics(run)[0]
    assert row["step"] == 1 and "reward" in row
    saved = load_config(run / "config.toml")
    assert saved.algorithm.preset == name
    assert ("kl" in row) == (name == "grpo")  # only the grpo preset has beta > 0
    if name == "dapo":
        assert "rewards/soft_overlong_penalty/mean" in row and "dynamic_sampling/draws" in row


def _weights(run):
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoint-1" / "model.safetensors"))


def _run(tmp_path, model_dir, name, algorithm, train=None, reward=None):
    from grpokit.training.loop import train as train_fn

    config = make_config(model_dir, tmp_path / name, steps=1, rollout={"ignore_eos": True}, algorithm=algorithm,
                         train=train)
    return train_fn(config, reward_functions=[reward] if reward else None)


def _constant_reward(completions, **kwargs):
    return [0.5 for _ in completions]


def test_entropy_bonus_moves_the_weights_even_when_no_group_has_signal(tiny_model_dir, tmp_path):
    # every advantage is 0: the zero-advantage fast path may skip them all, unless an entropy bonus needs them
    still = _run(tmp_path, tiny_model_dir, "still", {}, reward=_constant_reward)
    moved = _run(tmp_path, tiny_model_dir, "moved", {"entropy_coef": 0.01}, reward=_constant_reward)
    from safetensors.torch import load_file

    start = load_file(str(tiny_model_dir / "model.safetensors"))
    ws, wm = _weights(still), _weights(moved)
    assert all(torch.equal(ws[k], start[k]) for k in ws)
    assert any(not torch.equal(wm[k], start[k]) for k in wm)


@pytest.mark.parametrize("algorithm", [
    {"entropy_coef": 0.01, "top_entropy_quantile": 0.5},
    {"top_entropy_quantile": 0.3},
    {"beta": 0.04, "kl_bias_correction": True, "num_iterations": 2},
    {"advantage_estimator": "rloo"},
    {"advantage_estimator": "reinforce_pp", "std": "sample"},
])
def test_options_give_the_same_update_on_the_fused_and_the_plain_path(tiny_model_dir, tmp_path, algorithm):
    tag = "-".join(f"{k}{v}" for k, v in algorithm.items())
    a = _run(tmp_path, tiny_model_dir, f"fused-{tag}", algorithm, reward=parity)
    from grpokit.config.schema import TrainConfig

    fast_paths = {k: False for k in ("fused_logprobs", "skip_zero_advantage") if k in TrainConfig.__dataclass_fields__}
    b = _run(tmp_path, tiny_model_dir, f"plain-{tag}", algorithm, train=fast_paths, reward=parity)
    assert read_metrics(a)[0]["reward_std"] > 0
    wa, wb = _weights(a), _weights(b)
    # Adam's first step moves each weight by lr * g / (|g| + eps) (lr 1e-3 here): where |g| is near eps, the two
    # paths' float rounding of g shows as up to a few 1e-6 (2.3e-6 on an Intel Xeon with AVX-512, against 2e-6
    # allowed before). A real difference (a token weighted or masked otherwise) moves weights by up to 2 * lr.
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=1e-5)
