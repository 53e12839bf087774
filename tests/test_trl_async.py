"""grpokit.trl.AsyncGRPOConfig / AsyncGRPOTrainer: TRL 1.16's asynchronous GRPO arguments, run by grpokit's
asynchronous rollout (worker processes sample while the trainer updates).

(a) TRL's async script, its import line changed, trains a tiny local model with rollout workers; (b) each of
TRL's own async fields and the grpokit field it sets (the mapping table), the shared fields through
GRPOConfig's decisions; (c) refusals, one error naming the field; (d) TRL's own AsyncGRPOConfig has exactly
these names and defaults and accepts the same arguments, and AsyncGRPOTrainer's parameters are TRL's; (e)
docs/TRL.md's section names every field with its decision.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import re
import warnings
from pathlib import Path

import pytest

from conftest import parity
from grpokit.errors import ConfigError
from grpokit.trl import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig
from grpokit.trl.async_config import GRPO_ONLY, OWN, SHARED, async_config, async_notes
from grpokit.trl.mapping import grpokit_config

TINY = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, learning_rate=1e-3,
            disable_tqdm=True)


def reward_len(completions, **kwargs):
    """Module level, so the rollout worker process can import it (TRL's async trainer pickles it too)."""
    return [-abs(4 - len(completion)) for completion in completions]


def trl_async():
    warnings.filterwarnings("ignore", message=".*trl.experimental.*")
    return pytest.importorskip("trl.experimental.async_grpo")


# ---- (a) a real run -----------------------------------------------------------------------------------


SCRIPT = '''
from datasets import Dataset
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from test_trl_async import reward_len

dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)], "answer": list(range(16))})
args = AsyncGRPOConfig(output_dir=OUT, max_steps=3, per_device_train_batch_size=4, num_generations=4,
                       max_completion_length=8, learning_rate=1e-3, max_staleness=1, disable_tqdm=True)
trainer = AsyncGRPOTrainer(model=MODEL, reward_funcs=[reward_len, parity], args=args, train_dataset=dataset)
trainer.train()
'''


def test_trl_async_script_trains_with_rollout_workers(tiny_model_dir, tmp_path):
    from grpokit.observe.tracking import read_metrics

    scope = {"MODEL": str(tiny_model_dir), "OUT": str(tmp_path / "out"), "parity": parity}
    exec(compile(SCRIPT.replace("from trl.", "from grpokit.trl."), "async_script.py", "exec"), scope)
    trainer = scope["trainer"]
    assert trainer.args is scope["args"] and isinstance(trainer.args, AsyncGRPOConfig)
    c = trainer.config
    assert (c.rollout.mode, c.rollout.max_staleness, c.rollout.weight_sync_every) == ("async", 1, 1)
    assert (c.train.steps, c.train.prompts_per_step, c.rollout.group_size) == (3, 1, 4)
    assert (c.algorithm.is_correction, c.algorithm.old_logprobs, c.algorithm.std, c.algorithm.loss_type) == (
        "none", "sampler", "population", "dapo")  # TRL's loss: clipped around the sampler's log-probs
    assert c.needs_old_logprobs
    rows = read_metrics(trainer.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # sampled by the worker process, with weights at most max_staleness = 1 step old (how far it ran ahead
    # depends on timing)
    assert all(math.isfinite(r["reward"]) and 0 <= r["async/staleness_max"] <= 1 for r in rows)
    assert {"rewards/reward_len/mean", "rewards/parity/mean"} <= set(rows[0])
    # the prompts in the dataset's order, as TRL's async worker reads them (grpokit's stream, unshuffled)
    assert c.data.shuffle is False
    assert trainer.state.global_step == 3 and len(trainer.state.log_history) == 4
    assert {"train_loss", "train_runtime"} <= set(trainer.state.log_history[-1])
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "model.safetensors").is_file() and (tmp_path / "final" / "tokenizer.json").is_file()


def test_a_lambda_reward_is_refused_at_start_up(tiny_model_dir, tmp_path, capsys):
    """The reward functions travel to the worker processes by pickle, as in TRL: a lambda cannot. (The trainer
    says once what the accepted no-op arguments do.)"""
    from grpokit.errors import SetupError

    args = AsyncGRPOConfig(output_dir=str(tmp_path / "o"), max_steps=1, queue_maxsize=8, **TINY)
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs=lambda completions, **kw: [0.0] * len(
        completions), args=args, train_dataset=[{"prompt": "1+1="}] * 4)
    assert "queue_maxsize=8: no effect: at most max_staleness + 1 steps' batches" in capsys.readouterr().out
    with pytest.raises(SetupError, match="cannot be sent to the rollout worker processes"):
        trainer.train()


# ---- (b) the mapping ----------------------------------------------------------------------------------


def mapped(num_rows: int = 64, **trl_args) -> dict:
    """The grpokit config (flat "section.field" dict) these AsyncGRPOConfig arguments give."""
    from grpokit.trl.async_config import epoch_steps

    args = AsyncGRPOConfig(**trl_args)
    grpo = args.as_grpo(max_steps=epoch_steps(args, [None] * num_rows))
    config = async_config(args, grpokit_config(grpo, model_path="model", dtype="float32", num_rows=num_rows))
    return {f"{s}.{k}": v for s, fields in config.to_dict().items() for k, v in fields.items()}


MAPPING = [
    ({}, {"rollout.mode": "async", "rollout.max_staleness": 4, "rollout.weight_sync_every": 1,
          "rollout.worker_timeout_s": 300.0, "rollout.workers": 1, "rollout.engine": "hf", "rollout.group_size": 8,
          "rollout.max_new_tokens": 2048, "train.prompts_per_step": 1, "train.minibatch_size": 0,
          "train.micro_batch_size": 0, "train.steps": 3 * 64, "train.learning_rate": 1e-6,
          "train.lr_schedule": "constant", "train.gradient_checkpointing": True, "algorithm.loss_type": "dapo",
          "algorithm.beta": 0.0, "algorithm.num_iterations": 1, "algorithm.std": "population",
          "algorithm.scale_rewards": "group", "algorithm.is_correction": "none", "algorithm.old_logprobs": "sampler",
          "algorithm.epsilon": 0.2, "algorithm.epsilon_high": 0.0, "data.shuffle": False, "model.dtype": "float32",
          "output.completions_every": 0, "tools.max_calls": 2048}),
    # TRL counts weight versions, one per weight_sync_steps = k steps, and drops a sample whose version lags the
    # trainer's by more than K = max_staleness: for optimizer step s (after s - 1 updates) the trainer holds version
    # 1 + (s - 1) // k, a sample of weights after u updates has version 1 + u // k, so the lag in updates s - 1 - u
    # reaches at most (K + 1) k - 1 (u = 0, s - 1 = 8 for K = 2, k = 3): grpokit's bound in steps
    (dict(max_staleness=2, weight_sync_steps=3), {"rollout.max_staleness": 8, "rollout.weight_sync_every": 3}),
    (dict(max_staleness=0), {"rollout.max_staleness": 0}),
    (dict(heartbeat_stale_after_s=60.0), {"rollout.worker_timeout_s": 60.0}),
    (dict(epsilon=0.1, epsilon_high=0.28, temperature=0.7, top_p=0.9, top_k=20, max_completion_length=32),
     {"algorithm.epsilon": 0.1, "algorithm.epsilon_high": 0.28, "rollout.temperature": 0.7, "rollout.top_p": 0.9,
      "rollout.top_k": 20, "rollout.max_new_tokens": 32}),
    # a step of several micro-batches: TRL's per-micro-batch token mean is grpokit's bnpo
    (dict(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2, max_steps=5),
     {"train.prompts_per_step": 2, "train.micro_batch_size": 4, "train.minibatch_size": 0, "train.steps": 5,
      "algorithm.loss_type": "bnpo"}),
    # TRL's epoch rule: ceil(epochs x rows) prompts' groups, here 2 prompts a step
    (dict(num_train_epochs=1.5, per_device_train_batch_size=16, num_generations=8), {"train.steps": 48}),
    (dict(max_tool_calling_iterations=3), {"tools.max_calls": 3}),
    (dict(log_completions=True, logging_steps=2, max_steps=10), {"output.completions_every": 2}),
    (dict(token_budget=0), {"train.micro_batch_size": 0}),  # TRL's fixed-count packing, which grpokit does
    (dict(model_init_kwargs={"dtype": "bfloat16"}, dtype="float16"), {}),  # checked below: the kwargs win
]


@pytest.mark.parametrize("trl_args, expected", MAPPING, ids=lambda v: ",".join(v) if isinstance(v, dict) else None)
def test_mapping_table(trl_args, expected):
    got = mapped(**trl_args)
    assert {k: got[k] for k in expected} == expected


def test_every_own_field_is_in_the_mapping_table_or_has_a_note():
    used = {k for args, _ in MAPPING for k in args}
    noted = {"fork_threshold_tokens", "request_timeout", "weight_sync_timeout", "max_inflight_tasks", "queue_maxsize"}
    assert set(OWN) - used == noted
    args = AsyncGRPOConfig(fork_threshold_tokens=64, request_timeout=5, weight_sync_timeout=10, max_inflight_tasks=3,
                           queue_maxsize=8, vllm_server_timeout=1.0, ignore_data_skip=False)
    notes = async_notes(args)
    assert [n.split("=")[0] for n in notes] == ["fork_threshold_tokens", "request_timeout", "vllm_server_timeout",
                                                "weight_sync_timeout", "max_inflight_tasks", "queue_maxsize",
                                                "ignore_data_skip"]
    assert all(": no effect: " in n for n in notes) and async_notes(AsyncGRPOConfig()) == []
    assert "heartbeat_stale_after_s = 300 s" in notes[1]


def test_the_dtype_and_model_init_kwargs_as_trl_reads_them():
    assert AsyncGRPOConfig().as_grpo().model_init_kwargs == {"dtype": "float32"}  # TRL's default dtype
    assert AsyncGRPOConfig(dtype="auto").as_grpo().model_init_kwargs == {"dtype": "auto"}
    given = AsyncGRPOConfig(model_init_kwargs={"dtype": "bfloat16"}, dtype="float16")
    assert given.as_grpo().model_init_kwargs == {"dtype": "bfloat16"}  # model_init_kwargs' dtype first


def test_shared_fields_keep_grpoconfigs_decisions():
    """A shared field runs through GRPOConfig's checks; the error names AsyncGRPOConfig."""
    with pytest.raises(ConfigError, match=r"^grpokit.trl.AsyncGRPOConfig: .*push_to_hub=True; weight_decay=0.1 "):
        AsyncGRPOConfig(weight_decay=0.1, push_to_hub=True)
    with pytest.raises(ConfigError, match="lr_scheduler_type='linear'"):
        AsyncGRPOConfig(lr_scheduler_type="linear")
    # TRL forces split_batches / dispatch_batches True: they change nothing here, the rest as GRPOConfig reads it
    args = AsyncGRPOConfig(accelerator_config={"even_batches": False})
    assert args.accelerator_config == {"even_batches": False, "split_batches": True, "dispatch_batches": True}
    assert args.as_grpo().accelerator_config == {"even_batches": False}
    with pytest.raises(ConfigError, match="gradient_accumulation_kwargs"):
        AsyncGRPOConfig(accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 2}})
    assert AsyncGRPOConfig(remove_unused_columns=False).as_grpo().remove_unused_columns is False
    assert AsyncGRPOConfig().as_grpo().remove_unused_columns is False  # every column reaches the rewards, as TRL's


# ---- (c) refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("trl_args, match", [
    (dict(vllm_server_base_url="gpu-box:8000"), r"vllm_server_base_url='gpu-box:8000' \(the vLLM server's address"),
    (dict(token_budget=16384), r"token_budget=16384 \(grpokit's micro-batches hold a fixed count"),
    (dict(dtype="fp8"), r"dtype='fp8' \(one of auto, bfloat16, float16, float32\)"),
    (dict(max_staleness=-1), r"max_staleness=-1 \(must be >= 0"),
    (dict(weight_sync_steps=0), r"weight_sync_steps=0 \(must be >= 1"),
    (dict(heartbeat_stale_after_s=0), r"heartbeat_stale_after_s=0 \(must be > 0 seconds\)"),
    (dict(max_staleness=1.5), r"max_staleness=1.5 \(must be an integer\)"),
    (dict(token_budget="4k"), r"token_budget='4k' \(must be an integer or None\)"),
    (dict(eval_strategy="steps"), r"eval_strategy='steps' \(AsyncGRPOTrainer takes no eval_dataset"),
    (dict(per_device_train_batch_size=6, num_generations=4), r"6 answers per optimizer step, not whole groups of "
                                                            r"num_generations=4"),
    (dict(num_generations=1, per_device_train_batch_size=1), "at least 2 generations"),
    (dict(per_device_train_batch_size="4"), r"per_device_train_batch_size='4' \(must be a number\)"),
])
def test_refused_configs(trl_args, match):
    with pytest.raises(ConfigError, match=match):
        AsyncGRPOConfig(**trl_args)


@pytest.mark.parametrize("config, given, match", [
    (config, dict(per_device_train_batch_size="4"), r"per_device_train_batch_size='4' \(must be a number\)")
    for config in (GRPOConfig, AsyncGRPOConfig)] + [
    (config, dict(gradient_accumulation_steps="2"), r"gradient_accumulation_steps='2' \(must be a number\)")
    for config in (GRPOConfig, AsyncGRPOConfig)] + [
    (GRPOConfig, dict(eval_strategy="steps", eval_steps="3"), r"eval_steps='3' \(must be a number\)")])
def test_a_wrong_type_in_a_resolved_field_is_one_error_line(config, given, match):
    """The batch and evaluation fields are resolved with arithmetic (TRL's rules): their types are checked first."""
    with pytest.raises(ConfigError, match=match):
        config(**given)


def test_grpo_only_arguments_are_type_errors_as_in_trl():
    for name in ("beta", "loss_type", "num_iterations", "use_vllm"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            AsyncGRPOConfig(**{name: 1})


def test_trainer_refusals_before_anything_loads(tiny_model_dir, tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "o"), max_steps=1, **TINY)
    rows = [{"prompt": "1+1="}] * 4
    cases = [(dict(rollout_worker=object()), "rollout_worker: grpokit's rollout workers"),
             (dict(rollout_worker=object(), weight_transfer=object()), "rollout_worker and weight_transfer"),
             (dict(model=object()), "model must be a local folder or a Hub id"),
             (dict(callbacks=[object()]), "^AsyncGRPOTrainer: grpokit does not support callbacks"),
             (dict(train_dataset=None), "`train_dataset` is required")]
    for kwargs, match in cases:
        given = {"model": "no-such-folder", "reward_funcs": reward_len, "args": args, "train_dataset": rows, **kwargs}
        with pytest.raises(ConfigError, match=match):
            AsyncGRPOTrainer(**given)
    with pytest.raises(TypeError, match="args must be a grpokit.trl.AsyncGRPOConfig"):
        AsyncGRPOTrainer(str(tiny_model_dir), reward_len, args=GRPOConfig(), train_dataset=rows)
    assert not (tmp_path / "o").exists()


# ---- (d) TRL's own AsyncGRPOConfig and AsyncGRPOTrainer ------------------------------------------------


def _defaults(cls):
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls) if f.init}


def test_field_names_and_defaults_are_trls():
    trl = trl_async()
    ours, theirs = _defaults(AsyncGRPOConfig), _defaults(trl.AsyncGRPOConfig)
    assert ours == theirs and len(ours) == 142
    assert set(ours) == set(SHARED) | set(OWN) and not set(ours) & set(GRPO_ONLY)
    assert set(_defaults(GRPOConfig)) - set(ours) == set(GRPO_ONLY)
    assert [f.name for f in dataclasses.fields(AsyncGRPOConfig)][0] == "output_dir"  # TRL passes it by position


def test_trainer_signature_is_trls():
    trl = trl_async()
    ours, theirs = inspect.signature(AsyncGRPOTrainer).parameters, inspect.signature(trl.AsyncGRPOTrainer).parameters
    assert list(ours) == list(theirs)
    assert {k: p.default for k, p in ours.items()} == {k: p.default for k, p in theirs.items()}
    from grpokit.trl.experimental.async_grpo import AsyncGRPOConfig as by_trls_path
    from grpokit.trl.experimental.async_grpo import AsyncGRPOTrainer as trainer

    assert by_trls_path is AsyncGRPOConfig and trainer is AsyncGRPOTrainer


@pytest.mark.parametrize("trl_args", [args for args, _ in MAPPING])
def test_trl_accepts_the_same_arguments(trl_args, tmp_path):
    trl = trl_async()
    ours = AsyncGRPOConfig(output_dir=str(tmp_path), **trl_args)
    theirs = trl.AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **trl_args)
    for name in ("max_staleness", "weight_sync_steps", "num_generations", "dtype", "logging_steps", "max_steps"):
        assert getattr(ours, name) == getattr(theirs, name), name
    forced = ("split_batches", "dispatch_batches")  # both configs force them True
    assert {k: theirs.accelerator_config.to_dict()[k] for k in forced} == {k: ours.accelerator_config[k] for k in
                                                                           forced} == dict.fromkeys(forced, True)


def test_advantages_are_trls_async_workers(monkeypatch):
    """TRL's async worker scores a group with numpy's std (no Bessel correction); the mapped config's advantages
    (algorithm.std = "population", group scale) are its, up to the std guard (TRL 1e-8, grpokit 1e-4)."""
    import asyncio
    from types import SimpleNamespace

    import torch

    from grpokit.algorithms.advantages import group_advantages

    worker = pytest.importorskip("trl.experimental.async_grpo.async_rollout_worker")
    monkeypatch.setattr(worker, "logger", logging.getLogger("trl-async"))  # accelerate's needs its global state
    completions = ["1", "22", "333", "4444", "55555", "", "7", "1212"]  # two groups of 4
    me = SimpleNamespace(reward_funcs=[reward_len, parity], _env_reward_types=[], _provides_rollout_reward=False,
                         reward_func_names=["reward_len", "parity"])
    theirs = []
    for g in range(2):
        part = completions[4 * g:4 * g + 4]
        rows = [[worker.TrainingSequence([1, 2], [0, 1], [0.0, -0.5], f"r{i}")] for i in range(4)]
        group = worker.RolloutGroup(prompts=["p"] * 4, reward_kwargs={}, completions=part, completions_ids=[[1]] * 4,
                                    completions_sequences=rows, tool_call_counts=[0] * 4, tool_failure_counts=[0] * 4,
                                    model_version=0, group_id=g, env_rewards=[None] * 4, rollout_rewards=[None] * 4)
        theirs += [s.advantage for s in asyncio.run(_score_group(worker)(me, group))]
    c = mapped()
    rewards = torch.tensor([a + b for a, b in zip(reward_len(completions), parity(completions))], dtype=torch.float64)
    ours = group_advantages(rewards, 4, scale_rewards=c["algorithm.scale_rewards"], std=c["algorithm.std"], eps=1e-8)
    assert ours.tolist() == pytest.approx(theirs, rel=1e-9, abs=1e-9)
    used = group_advantages(rewards, 4, scale_rewards="group", std=c["algorithm.std"])  # the trainer's guard
    assert used.tolist() == pytest.approx(theirs, rel=1e-3)
    bessel = group_advantages(rewards, 4, scale_rewards="group", std="sample", eps=1e-8)  # what would differ
    assert bessel.tolist() != pytest.approx(theirs, rel=1e-2)


def _score_group(worker):
    """The method of TRL's worker-side scorer that forms a group's rewards and advantages."""
    owner = next(v for v in vars(worker).values() if isinstance(v, type) and "_score_group" in vars(v))
    return vars(owner)["_score_group"]


# ---- (e) docs/TRL.md ----------------------------------------------------------------------------------


def _async_section() -> str:
    text = (Path(__file__).parents[1] / "docs" / "TRL.md").read_text(encoding="utf-8")
    start = text.index("## AsyncGRPOConfig and AsyncGRPOTrainer")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_docs_name_every_async_field_with_its_decision():
    from test_trl_dropin import _documented_names

    section = _async_section()
    names, patterns = _documented_names(section)
    missing = [n for n in _defaults(AsyncGRPOConfig) if n not in names and not any(p(n) for p in patterns)]
    assert not missing, f"docs/TRL.md's async section does not list (with its decision): {missing}"
    assert re.search(r"all\s+142\s+of\s+TRL", section) and re.search(r"132\s+it\s+shares", section)
    params = inspect.signature(AsyncGRPOTrainer).parameters
    assert all(f"`{p}`" in section for p in params if p != "self")
