"""grpokit.trl against what TRL 1.16's own tests/test_grpo_trainer.py expects of a GRPOTrainer (tests/trl_upstream
runs those tests themselves, opt-in): the entropy bonus's `policy_loss` and `entropy_coef` in the logs and
`trainer.entropy_coef`; the rewards an environment owns listed in `reward_func_names`; the last log_history row
carrying the metrics gathered since the last logging step; `trainer.ref_model` as the reference the loop uses;
TRL's refusals of an iterable dataset with `dispatch_batches=True`, of no train_dataset, of no reward source and of
reward_processing_classes of another length, in TRL's words.
"""

from __future__ import annotations

import pytest
import torch

from grpokit.algorithms.objectives import LossSpec, mean_token_entropy, policy_loss
from grpokit.errors import ConfigError
from grpokit.trl import GRPOConfig, GRPOTrainer

ROWS = [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(2)]
RUN = dict(max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
           learning_rate=1e-2, disable_tqdm=True, logging_steps=1)


def ordinal(completions, **kwargs):
    """A reward with signal in every group, so every step changes the weights."""
    return [float(i % 4) for i in range(len(completions))]


class Scored:
    """A TRL environment that owns its reward (`get_reward`)."""

    def reset(self, **row):
        return None

    def get_reward(self) -> float:
        return 1.0


class Plain:
    def reset(self, **row):
        return None


def test_the_loss_without_the_entropy_bonus_is_policy_loss():
    torch.manual_seed(0)
    logp, entropy = -torch.rand(3, 5), torch.rand(3, 5) * 2
    mask, adv = torch.ones(3, 5), torch.tensor([1.0, -0.5, 0.2])
    plain, _ = policy_loss(logp, None, adv, mask, LossSpec(loss_type="bnpo"))
    for aggregation in ("token_mean", "loss"):
        spec = LossSpec(loss_type="bnpo", entropy_coef=0.5, entropy_aggregation=aggregation)
        loss, stats = policy_loss(logp, None, adv, mask, spec, entropy=entropy)
        assert float(stats["policy_loss"]) == pytest.approx(float(plain))
        assert float(stats["policy_loss"] - loss) == pytest.approx(0.5 * float(mean_token_entropy(entropy, mask)))
    assert "policy_loss" not in policy_loss(logp, None, adv, mask, LossSpec(loss_type="bnpo"))[1]


def test_the_entropy_bonus_is_logged_as_trl_logs_it(tiny_model_dir, tmp_path):
    """TRL's test_entropy_bonus_scale: (policy_loss - loss) / entropy is entropy_coef, and entropy_coef is logged."""
    args = GRPOConfig(output_dir=str(tmp_path / "o"), entropy_coef=0.5, **RUN)
    trainer = GRPOTrainer(str(tiny_model_dir), ordinal, args=args, train_dataset=ROWS)
    assert trainer.entropy_coef == 0.5
    trainer.train()
    steps = [row for row in trainer.state.log_history if "loss" in row]
    assert len(steps) == 2
    for row in steps:
        assert row["entropy_coef"] == 0.5
        assert (row["policy_loss"] - row["loss"]) / row["entropy"] == pytest.approx(0.5, rel=1e-4)


def test_the_adaptive_coefficient_is_the_trainers_after_train(tiny_model_dir, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path / "o"), entropy_coef=0.01, use_adaptive_entropy=True,
                      entropy_target=15.0, entropy_coef_delta=0.005, **RUN)
    trainer = GRPOTrainer(str(tiny_model_dir), ordinal, args=args, train_dataset=ROWS)
    trainer.train()
    assert trainer.entropy_coef == pytest.approx(0.02)  # up by delta at each of the 2 optimizer steps
    assert trainer.state.log_history[-2]["policy_loss"] is not None


def test_the_last_row_carries_what_was_gathered_since_the_last_logging_step(tiny_model_dir, tmp_path):
    """TRL's final log merges the metrics of the steps after the last logging step (here step 3 of 3, logging every
    2), so log_history[-1] has `reward`, `rewards/<fn>/mean`, ... next to `train_loss`; none when the run ends on a
    logging step."""
    args = GRPOConfig(output_dir=str(tmp_path / "o"), **{**RUN, "max_steps": 3, "logging_steps": 2})
    trainer = GRPOTrainer(str(tiny_model_dir), ordinal, args=args, train_dataset=ROWS)
    trainer.train()
    last, step3 = trainer.state.log_history[-1], trainer.state.log_history[-2]
    assert last["train_loss"] is not None and step3["step"] == 3
    for key in ("reward", "reward_std", "rewards/ordinal/mean", "completions/mean_length", "num_tokens", "entropy"):
        assert last[key] == pytest.approx(step3[key])
    assert "loss" not in last and "grad_norm" not in last and last["step"] == 3

    args = GRPOConfig(output_dir=str(tmp_path / "p"), **RUN)  # logging_steps=1: everything was logged already
    trainer = GRPOTrainer(str(tiny_model_dir), ordinal, args=args, train_dataset=ROWS)
    trainer.train()
    assert "reward" not in trainer.state.log_history[-1]


def test_ref_model_is_the_reference_the_loop_moves(tiny_model_dir, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path / "o"), beta=0.1, sync_ref_model=True, ref_model_sync_steps=1, **RUN)
    trainer = GRPOTrainer(str(tiny_model_dir), ordinal, args=args, train_dataset=ROWS)
    assert isinstance(trainer.ref_model, torch.nn.Module) and trainer.ref_model is not trainer.model
    before = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(before[n], p) for n, p in trainer.ref_model.named_parameters())
    no_kl = GRPOTrainer(str(tiny_model_dir), ordinal, train_dataset=ROWS,
                        args=GRPOConfig(output_dir=str(tmp_path / "p"), **RUN))
    assert no_kl.ref_model is None  # beta = 0: no reference, as in TRL


def test_environment_rewards_are_named_beside_the_reward_functions(tool_model_dir, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path / "o"), **RUN)
    owned = GRPOTrainer(str(tool_model_dir), args=args, environment_factory=Scored)
    assert owned.reward_func_names == ["Scored"] and owned.reward_processing_classes == [None]
    both = GRPOTrainer(str(tool_model_dir), ordinal, args=args, train_dataset=ROWS,
                       environment_factory=lambda: Scored())
    assert both.reward_func_names == ["ordinal", "Scored"]
    routed = [{**row, "environment": "s" if i % 2 else "p"} for i, row in enumerate(ROWS)]
    mixed = GRPOTrainer(str(tool_model_dir), ordinal, args=args, train_dataset=routed,
                        environment_factory={"s": Scored, "s2": Scored, "p": Plain})
    assert mixed.reward_func_names == ["ordinal", "Scored"]
    with pytest.raises(ConfigError, match="No reward source provided"):
        GRPOTrainer(str(tool_model_dir), args=args, environment_factory=Plain)


def test_trls_refusals_in_trls_words(tiny_model_dir, tmp_path):
    from datasets import Dataset

    stream = Dataset.from_list(ROWS).to_iterable_dataset()
    given = GRPOConfig(output_dir=str(tmp_path / "o"), accelerator_config={"dispatch_batches": True})
    with pytest.raises(ConfigError, match="Iterable datasets require `dispatch_batches=False`"):
        GRPOTrainer(str(tiny_model_dir), ordinal, args=given, train_dataset=stream)
    args = GRPOConfig(output_dir=str(tmp_path / "o"), **RUN)
    with pytest.raises(ConfigError, match="`train_dataset` is required"):
        GRPOTrainer(str(tiny_model_dir), ordinal, args=args)
    with pytest.raises(ConfigError, match="requires a `train_dataset`"):
        GRPOTrainer(str(tiny_model_dir), ordinal, args=args, environment_factory={"a": Scored, "b": Plain})
    with pytest.raises(ConfigError, match="No reward source provided"):
        GRPOTrainer(str(tiny_model_dir), args=args, train_dataset=ROWS)


def test_reward_processing_classes_of_another_length_must_match(tiny_model_dir, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path / "o"), **RUN)
    with pytest.raises(ConfigError, match="must match"):  # TRL's test_mismatched_reward_processing_classes_length
        GRPOTrainer(str(tiny_model_dir), [ordinal, ordinal], args=args, train_dataset=ROWS,
                    reward_processing_classes=[None])
