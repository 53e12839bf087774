"""The training loop through the Python API: the update, its bookkeeping, and its fast paths."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

import grpokit.training.setup as setup_mod
import grpokit.training.update as update_mod
from conftest import comparable, make_config, parity
from grpokit.algorithms.objectives import LossSpec
from grpokit.config.schema import Config, DataConfig, ModelConfig, OutputConfig, RolloutConfig, TrainConfig
from grpokit.observe.tracking import read_metrics
from grpokit.training.loop import train
from grpokit.training.optimizer import lr_lambda

DESIGN_METRICS = [
    "reward", "reward_std", "frac_reward_zero_std", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
    "clip_ratio/region_mean", "completions/mean_length", "completions/min_length", "completions/max_length",
    "completions/clipped_ratio", "completions/mean_terminated_length", "grad_norm", "learning_rate",
    "time/rollout", "time/reward", "time/train", "time/step", "tokens_per_sec", "rewards/addition/mean",
    "rewards/addition/std",
]


def final_weights(run_dir):
    ckpt = sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    return load_file(str(ckpt / "model.safetensors"))


def test_writes_every_design_metric_and_a_loadable_checkpoint(tiny_model_dir, tmp_path):
    run = train(make_config(tiny_model_dir, tmp_path / "run"))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    for name in DESIGN_METRICS:
        assert name in rows[0], name
    assert "kl" not in rows[0]  # beta = 0: no KL is computed, none is reported
    assert (run / "config.toml").is_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "checkpoint-2")
    tok = AutoTokenizer.from_pretrained(run / "checkpoint-2")
    out = model.generate(torch.tensor([tok("1+1=")["input_ids"]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_gradient_accumulation_gives_the_same_update(tiny_model_dir, tmp_path, loss_type):
    """One step with the batch in 1 micro-batch or in 4 reaches the same weights: the loss
    normalisation spans the optimizer step's batch, not the micro-batch (bnpo excepted, as in TRL:
    it averages per micro-batch, so the test gives it equal token counts via ignore_eos)."""
    common = dict(algorithm={"loss_type": loss_type}, rollout={"ignore_eos": True}, train={"steps": 1})
    a = train(make_config(tiny_model_dir, tmp_path / "a", **common), reward_functions=[parity])
    common["train"] = {"steps": 1, "micro_batch_size": 4}
    b = train(make_config(tiny_model_dir, tmp_path / "b", **common), reward_functions=[parity])
    wa, wb = final_weights(a), final_weights(b)
    assert read_metrics(a)[0]["reward_std"] > 0  # there was a gradient to compare
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=2e-6, rtol=1e-5)


def test_no_reference_model_when_beta_is_zero_and_no_old_pass_when_mu_is_one(tiny_model_dir, tmp_path, monkeypatch):
    loads, scores = [], []
    real_load, real_score = setup_mod.load_model, update_mod._score
    monkeypatch.setattr(setup_mod, "load_model", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    monkeypatch.setattr(update_mod, "_score", lambda *a, **k: scores.append(1) or real_score(*a, **k))
    train(make_config(tiny_model_dir, tmp_path / "a", train={"steps": 1}))
    assert (len(loads), len(scores)) == (1, 0)
    loads.clear()
    run = train(make_config(tiny_model_dir, tmp_path / "b", algorithm={"beta": 0.04, "num_iterations": 2},
                            train={"steps": 1}))
    assert len(loads) == 2 and len(scores) == 2  # the reference model, then old + ref log-probs
    row = read_metrics(run)[0]
    assert row["kl"] >= 0 and row["kl"] == row["kl"]


def test_mu_two_moves_the_ratio_and_clips(tiny_model_dir, tmp_path):
    run = train(make_config(tiny_model_dir, tmp_path / "r", algorithm={"num_iterations": 4, "epsilon": 0.05},
                            train={"steps": 1, "learning_rate": 3e-3}), reward_functions=[parity])
    assert read_metrics(run)[0]["clip_ratio/region_mean"] > 0


def test_mask_truncated_completions_removes_their_gradient(tiny_model_dir, tmp_path):
    # max_new_tokens=1 and EOS ignored: every answer is truncated, so nothing may change.
    cfg = make_config(tiny_model_dir, tmp_path / "t", algorithm={"mask_truncated_completions": True},
                      rollout={"max_new_tokens": 1, "ignore_eos": True}, train={"steps": 1})
    run = train(cfg, reward_functions=[parity])
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = final_weights(run)
    assert read_metrics(run)[0]["completions/clipped_ratio"] == 1.0
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_dynamic_sampling_keeps_only_groups_with_signal(tiny_model_dir, tmp_path):
    def first_group_flat(prompts, completions, **kwargs):  # half the prompts get all-equal rewards
        return [0.0 if p.startswith(("1", "2", "3", "4")) else float(len(c) % 2) for p, c in zip(prompts, completions)]

    cfg = make_config(tiny_model_dir, tmp_path / "d", algorithm={"dynamic_sampling": True, "max_resample_rounds": 6},
                      train={"steps": 2}, output={"completions_every": 1})
    run = train(cfg, reward_functions=[first_group_flat])
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    groups = [rows[i:i + 4] for i in range(0, len(rows), 4)]
    assert all(len({r["reward"] for r in g}) > 1 for g in groups)  # every kept group carries signal
    assert all(m["dynamic_sampling/groups_kept"] == 4 for m in read_metrics(run))


def test_resume_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path):
    straight = train(make_config(tiny_model_dir, tmp_path / "s", train={"steps": 4}), reward_functions=[parity])
    cfg = make_config(tiny_model_dir, tmp_path / "r", train={"steps": 2}, output={"save_every": 1})
    train(cfg, reward_functions=[parity])
    resumed = train(make_config(tiny_model_dir, tmp_path / "r", train={"steps": 4}, output={"save_every": 1}),
                    reward_functions=[parity], resume=True)
    assert comparable(read_metrics(straight)) == comparable(read_metrics(resumed))
    wa, wb = final_weights(straight), final_weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_loss_spec_carries_every_loss_option_of_the_config(tmp_path):
    """Each field of `LossSpec` is read from the config (none left at its default by mistake): the options
    below all differ from LossSpec's defaults."""
    algorithm = dict(loss_type="bnpo", beta=0.04, epsilon=0.1, epsilon_high=0.3, importance_sampling_level="sequence",
                     kl_bias_correction=True, entropy_coef=0.01, entropy_aggregation="token_mean",
                     top_entropy_quantile=0.5, delta=4.0, sapo_temperature_pos=0.9, sapo_temperature_neg=1.2,
                     vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5,
                     off_policy_mask_threshold=0.3)
    spec = update_mod.loss_spec(make_config("m", tmp_path, max_new_tokens=7, algorithm=algorithm))
    assert spec == LossSpec(**algorithm, max_completion_length=7)
    assert all(getattr(spec, f.name) != f.default for f in dataclasses.fields(LossSpec))
    # cispo's cap is epsilon_high itself; 0 (off) for delta and the off-policy mask is None
    cispo = update_mod.loss_spec(make_config("m", tmp_path, algorithm=dict(loss_type="cispo", epsilon_high=5.0)))
    assert (cispo.epsilon_high, cispo.delta, cispo.off_policy_mask_threshold) == (5.0, None, None)


def test_learning_rate_schedule():
    cfg = make_config("m", "o", train={"steps": 10, "warmup_steps": 4, "lr_schedule": "cosine"})
    f = lr_lambda(cfg)
    assert [round(f(s), 4) for s in (0, 3, 4, 7, 10)] == [0.2, 0.8, 1.0, 0.5, 0.0]
    # μ = 2 passes of 2 minibatches: 4 optimizer steps a training step, the decay ends at the 40th
    cfg = make_config("m", "o", prompts_per_step=4, algorithm={"num_iterations": 2},
                      train={"steps": 10, "warmup_steps": 4, "lr_schedule": "cosine", "minibatch_size": 8})
    f = lr_lambda(cfg)
    assert [round(f(s), 4) for s in (0, 3, 4, 22, 40)] == [0.2, 0.8, 1.0, 0.5, 0.0]


def test_bfloat16_with_stop_strings_and_filtered_sampling(tiny_model_dir, tmp_path):
    """bf16 weights, nucleus/top-k sampling and a stop string all go through the loop: answers stop at
    the stop string (kept in the answer), and the bf16 update stays finite."""
    cfg = Config(model=ModelConfig(path=str(tiny_model_dir), dtype="bfloat16"),
                 data=DataConfig(task="addition", num_prompts=32),
                 rollout=RolloutConfig(group_size=4, max_new_tokens=8, top_p=0.9, top_k=20, stop_strings=("1",)),
                 train=TrainConfig(steps=1, prompts_per_step=4, learning_rate=1e-3),
                 output=OutputConfig(dir=str(tmp_path / "bf16"), console=False, completions_every=1))
    run = train(cfg, reward_functions=[parity])
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert all("1" not in r["completion"][:-1] for r in rows)  # nothing generated past a stop string
    assert any(r["completion"].endswith("1") for r in rows)
    weights = final_weights(run)
    assert all(w.dtype == torch.bfloat16 and torch.isfinite(w.float()).all() for w in weights.values())


def test_data_shuffle_false_draws_the_prompts_in_the_datas_own_order(tiny_model_dir, tmp_path):
    """data.shuffle = false (TRL's shuffle_dataset=False): batch after batch from the first row, and the
    next epoch starts at the first row again; the default draws a seeded shuffled order."""
    from dataclasses import replace

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    base = make_config(tiny_model_dir, tmp_path / "ordered", steps=4, prompts_per_step=4,
                       output={"completions_every": 1})
    ordered = replace(base, data=replace(base.data, shuffle=False))

    def prompts(run) -> list[str]:
        return [json.loads(line)["prompt"] for line in (run / "completions.jsonl").read_text().splitlines()][::4]

    got = prompts(train(ordered, rows=rows, reward_functions=[parity]))
    assert got == [r["prompt"] for r in rows * 3][:16]  # 4 steps x 4 prompts, 4 answers each
    shuffled = prompts(train(replace(base, output=replace(base.output, dir=str(tmp_path / "shuffled"))), rows=rows,
                             reward_functions=[parity]))
    assert sorted(shuffled[:6]) == sorted(r["prompt"] for r in rows) and shuffled[:6] != got[:6]
