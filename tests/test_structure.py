"""One source for each fact, the speed options as options, and the old import paths.

The config's variant names (`config/variants.py`, torch-free) must be exactly the names the math
dispatches on; the loop, the update and the multi-process reduction ask the config's properties
instead of repeating a condition; the former ablation switches are config options that reach the
sampler and the forward; code written against the flat layout still imports.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import subprocess
import sys

import pytest
import torch

from grpokit.algorithms.advantages import ESTIMATORS
from grpokit.algorithms.objectives import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, LossSpec, policy_loss
from grpokit.config import variants
from grpokit.config.presets import PRESETS
from grpokit.config.schema import AlgorithmConfig, Config, DataConfig, ModelConfig, RolloutConfig, TrainConfig
from grpokit.models.forward import completion_logprobs
from grpokit.models.loading import load_model, load_tokenizer
from grpokit.rollout.decode import DecodeSpeed, sample_groups
from grpokit.rollout.engines import HFEngine, build_engine
from grpokit.rollout.request import RolloutRequest, SamplingParams
from grpokit.rollout.sampling import SAMPLERS
from grpokit.tasks import TASKS


def test_the_configs_variant_names_are_the_ones_the_math_implements():
    assert set(variants.LOSS_TYPES) == set(LOSS_TYPES)
    assert set(variants.ADVANTAGE_ESTIMATORS) == set(ESTIMATORS)
    assert set(variants.IMPORTANCE_SAMPLING_LEVELS) == set(IMPORTANCE_SAMPLING_LEVELS)
    assert tuple(PRESETS) == variants.PRESET_NAMES
    assert set(variants.TASK_NAMES) == set(TASKS)
    assert set(variants.GLOBAL_TOKEN_LOSSES) <= set(variants.LOSS_TYPES)
    clip_stats = {t for t in LOSS_TYPES if "clip_ratio/region_mean" in policy_loss(
        torch.zeros(1, 2), None, torch.ones(1), torch.ones(1, 2), LossSpec(loss_type=t, max_completion_length=2))[1]}
    assert set(variants.CLIPPED_LOSSES) == clip_stats
    assert set(variants.SAMPLERS) == set(SAMPLERS)


@pytest.mark.parametrize("loss_type", variants.LOSS_TYPES)
def test_which_losses_sum_over_the_global_token_count(loss_type):
    assert AlgorithmConfig(loss_type=loss_type).sums_over_global_tokens == (loss_type in ("dapo", "cispo", "vespo"))


@pytest.mark.parametrize("beta, entropy_coef, quantile, skip, expected", [
    (0.0, 0.0, 1.0, True, True),
    (0.04, 0.0, 1.0, True, False),  # the KL term has a gradient at advantage 0
    (0.0, 0.01, 1.0, True, False),  # so does the entropy bonus
    (0.0, 0.0, 0.2, True, False),  # and the answer's tokens count in the entropy quantile
    (0.0, 0.0, 1.0, False, False),  # switched off
])
def test_when_zero_advantage_answers_may_skip_the_forward(beta, entropy_coef, quantile, skip, expected):
    config = Config(model=ModelConfig(path="m"), data=DataConfig(path="d.jsonl"),
                    algorithm=AlgorithmConfig(beta=beta, entropy_coef=entropy_coef, top_entropy_quantile=quantile),
                    train=TrainConfig(skip_zero_advantage=skip))
    assert config.skips_zero_advantage is expected


def test_the_rollout_speed_options_reach_the_sampler(tiny_model_dir):
    config = Config(model=ModelConfig(path=str(tiny_model_dir), device="cpu"), data=DataConfig(path="d.jsonl"),
                    rollout=RolloutConfig(sampler="gumbel", preallocated_kv_cache=False, shared_prefill=False,
                                          layer_loop=False))
    engine = build_engine(config, model=None, tokenizer=None)
    assert isinstance(engine, HFEngine)
    speed = dataclasses.asdict(engine.speed)
    assert speed == {"sampler": "gumbel", "preallocate_kv_cache": False, "share_prefill": False,
                     "layer_loop": False, "between_steps": None}  # the hook: an async worker's, never the config's


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, device="cpu").eval(), load_tokenizer(tiny_model_dir)


def _sample(tiny, **speed):
    model, tok = tiny
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("12+7=", "3+45=", "100+1=")]
    request = RolloutRequest(prompts, 4, SamplingParams(6, (tok.eos_token_id,), tok.pad_token_id, temperature=1.0),
                             torch.Generator().manual_seed(0))
    return sample_groups(model, request, tokenizer=tok, speed=DecodeSpeed(**speed))


@pytest.mark.parametrize("speed", [{"preallocate_kv_cache": False}, {"share_prefill": False}])
def test_cache_and_prefill_options_change_the_cost_not_the_samples(tiny, speed):
    fast, slow = _sample(tiny), _sample(tiny, **speed)
    assert torch.equal(fast.completion_ids, slow.completion_ids)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0)


def test_the_gumbel_sampler_draws_exact_samples_with_the_same_log_probs(tiny):
    r = _sample(tiny, sampler="gumbel")
    model, _ = tiny
    with torch.no_grad():
        recomputed, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    torch.testing.assert_close(recomputed * r.completion_mask, r.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("old, new, name", [
    ("grpokit.trainer", "grpokit.training.loop", "train"),
    ("grpokit.trainer", "grpokit.training.optimizer", "lr_lambda"),
    ("grpokit.trainer", "grpokit.errors", "StoppedNow"),
    ("grpokit.objectives", "grpokit.algorithms.objectives", "policy_loss"),
    ("grpokit.objectives", "grpokit.algorithms.logprobs", "token_logprobs"),
    ("grpokit.advantages", "grpokit.algorithms.advantages", "group_advantages"),
    ("grpokit.modeling", "grpokit.models.loading", "load_model"),
    ("grpokit.modeling", "grpokit.models.forward", "completion_logprobs"),
    ("grpokit.engines", "grpokit.rollout.vllm", "VLLMEngine"),
    ("grpokit.rollout.vllm_server", "grpokit.rollout.vllm.server", "ServerClient"),
    ("grpokit.rollout.vllm_weights", "grpokit.rollout.vllm.weights", "FolderReload"),
    ("grpokit.engines", "grpokit.algorithms.mismatch", "truncated_importance_weights"),
    ("grpokit.distributed", "grpokit.observe.metrics", "reduce_metrics"),
    ("grpokit.tiny", "grpokit.models.tiny", "build_tiny_model"),
    ("grpokit.tracking", "grpokit.observe.metrics", "reward_summary"),
    ("grpokit.presets", "grpokit.config.presets", "PRESETS"),
    ("grpokit.run_setup", "grpokit.evaluate", "eval_rows_and_specs"),
])
def test_modules_of_the_flat_layout_still_import_and_say_where_they_moved(old, new, name):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_every_old_module_path_imports_and_leaves_the_new_modules_untouched():
    import grpokit

    for old, homes in grpokit._MOVED.items():
        with pytest.warns(DeprecationWarning):
            sys.modules.pop(old, None)
            importlib.import_module(old)
        for home in homes:  # the new module keeps its own name and spec (reload, find_spec work)
            module = importlib.import_module(home)
            assert module.__spec__.name == home and importlib.util.find_spec(home).origin == module.__file__
    with pytest.raises(AttributeError, match="it moved"):
        importlib.import_module("grpokit.distributed").SUMMED_LOSSES


def test_the_public_names_and_packages_are_unchanged():
    import grpokit
    from grpokit.config import Config, ConfigError, load_config  # noqa: F401
    from grpokit.data import DataError, load_prompts  # noqa: F401
    from grpokit.rewards import RewardSpec, compute_rewards, get_reward  # noqa: F401
    from grpokit.tasks import get_task  # noqa: F401

    for name in grpokit.__all__:
        assert callable(getattr(grpokit, name)), name
    assert get_reward("countdown", format_score=0.1)(["1+2"], numbers=[[1, 2]], target=[3]) == [1.0]


def test_the_config_layer_imports_no_torch():
    code = "import sys, grpokit.config, grpokit.errors; print(any(m.startswith('torch') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_speed_option_off_trains_the_same_run(tiny_model_dir, tmp_path):
    """The former module-level ablation switches, now config options, off together: the same rewards
    (same samples), losses and updates within float noise; and the one-pass backward really is off."""
    from conftest import comparable, make_config, parity
    from grpokit.algorithms import fused_logprobs
    from grpokit.observe.tracking import read_metrics
    from grpokit.training.loop import train

    runs = {}
    for fast in (True, False):
        speed = {} if fast else {"sampler": "inverse_cdf", "preallocated_kv_cache": False, "shared_prefill": False}
        config = make_config(tiny_model_dir, tmp_path / f"run-{fast}", steps=2, rollout=speed,
                             train={} if fast else {"fused_backward": False, "shared_prompt_forward": False})
        before = fused_logprobs.PATH_COUNTS["one_pass"]
        runs[fast] = comparable(read_metrics(train(config, reward_functions=[parity])))
        one_pass = fused_logprobs.PATH_COUNTS["one_pass"] - before
        assert (one_pass > 0) is fast
    for a, b in zip(runs[True], runs[False]):
        assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
