"""The second round of variants through `grpokit.train`: every new loss type trains, the fused head's
one-pass backward is used only where the loss is per token, the mismatch correction acts on a real
sampler-trainer gap (the built-in engine sampling at another temperature), the adaptive entropy
coefficient moves and resumes exactly, and bad settings are one ConfigError naming the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import comparable, make_config, parity
from grpokit.config.loading import config_from_dict
from grpokit.config.schema import AlgorithmConfig
from grpokit.errors import ConfigError
from grpokit.observe.diagnostics import check_config
from grpokit.observe.tracking import read_metrics
from grpokit.rollout.engines import HFEngine
from grpokit.training.loop import train


def small(tiny_model_dir, out, **sections):
    sections.setdefault("train", {})
    return make_config(tiny_model_dir, out, num_prompts=16, prompts_per_step=2, model={"device": "cpu"}, **sections)


def weights_of(run, step):
    from safetensors.torch import load_file

    return load_file(str(run / f"checkpoint-{step}" / "model.safetensors"))


@pytest.mark.parametrize("algorithm", [
    {"preset": "sapo"}, {"preset": "luspo"}, {"preset": "vespo"},
    {"loss_type": "dapo", "delta": 4.0}, {"loss_type": "grpo", "off_policy_mask_threshold": 0.01},
])
def test_each_new_variant_trains_off_policy(tiny_model_dir, tmp_path, algorithm):
    # mu = 2: the second pass is off-policy, so ratios, gates and masks all act
    raw = {"model": {"path": str(tiny_model_dir), "device": "cpu"}, "data": {"task": "addition", "num_prompts": 16},
           "rollout": {"group_size": 4, "max_new_tokens": 5},
           "algorithm": {**algorithm, "num_iterations": 2},
           "train": {"steps": 2, "prompts_per_step": 2, "learning_rate": 1e-2},
           "output": {"dir": str(tmp_path / "run"), "console": False}}
    run = train(config_from_dict(raw), reward_functions=[parity])
    rows = read_metrics(run)
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[0]["grad_norm"] > 0
    if algorithm.get("preset") == "vespo":
        assert 0 < rows[0]["vespo/phi_seq_mean"] <= 1.0 + 1e-6  # phi peaks at w = 1
    if "off_policy_mask_threshold" in algorithm:
        assert "off_policy/masked_share" in rows[0]


@pytest.mark.parametrize("algorithm", [
    {"loss_type": "vespo"},  # a sequence weight of all the answer's log-probs
    {"loss_type": "dapo", "off_policy_mask_threshold": 0.001},  # a sequence mask reading the log-probs
    {"loss_type": "sapo"}, {"loss_type": "luspo", "importance_sampling_level": "sequence"},
])
def test_the_one_pass_backward_gives_the_same_update_as_autograd(tiny_model_dir, tmp_path, algorithm):
    # train.fused_backward computes dLoss/dlogp chunk by chunk; a loss with a sequence term must not use it
    # (or must give the same result). Two minibatches: the second is off-policy.
    runs = []
    for fused in (True, False):
        cfg = small(tiny_model_dir, tmp_path / str(fused), algorithm=algorithm, learning_rate=1e-2,
                    train={"steps": 1, "minibatch_size": 4, "fused_backward": fused, "logprob_chunk_size": 3})
        runs.append(train(cfg, reward_functions=[parity]))
    fused, plain = (read_metrics(r)[0] for r in runs)
    assert fused["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)
    assert fused["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)  # the gradients agree
    a, b = weights_of(runs[0], 1), weights_of(runs[1], 1)
    for k in a:  # (Adam amplifies float noise on near-zero gradients: a looser bound on the weights)
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-4)


class HotSampler(HFEngine):
    """The built-in engine sampling at temperature 3 while the trainer scores at the config's 1: the
    sampler's log-probs are really not the trainer's, as with vLLM, on a CPU."""

    def generate(self, request):
        hot = dataclasses.replace(request.sampling, temperature=3.0)
        return super().generate(dataclasses.replace(request, sampling=hot))


def hot_engine(config, model, tokenizer):
    return HotSampler(model, tokenizer)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_mismatch_correction_acts_on_a_real_sampler_trainer_gap(tiny_model_dir, tmp_path, mode):
    # the tiny random model's logits are flat, so even temperature 3 moves a token's log-prob by ~0.1: tight bounds
    cfg = small(tiny_model_dir, tmp_path / "c", algorithm={"is_correction": mode, "is_cap_max": 1.08,
                                                           "is_cap_min": 0.92}, train={"steps": 1})
    row = read_metrics(train(cfg, reward_functions=[parity], engine=hot_engine))[0]
    assert row["sampling/logprob_gap_mean"] > 0.05  # temperature 3 vs 1: a real gap
    share = row["sampling/is_masked_share" if mode.endswith("mask") else "sampling/is_truncated_share"]
    assert 0 < share <= 1
    assert row["sampling/is_ratio_min"] <= row["sampling/is_ratio_mean"] <= row["sampling/is_ratio_max"]
    assert row["sampling/is_ratio_max"] <= 1.08 + 1e-6
    plain = small(tiny_model_dir, tmp_path / "p", train={"steps": 1})
    uncorrected = read_metrics(train(plain, reward_functions=[parity], engine=hot_engine))[0]
    assert row["loss"] != pytest.approx(uncorrected["loss"], abs=1e-9)  # the weights reached the loss
    # the built-in engine sampling at the trainer's own temperature: ratios are 1 up to float noise
    same = read_metrics(train(small(tiny_model_dir, tmp_path / "s", algorithm={"is_correction": mode},
                                    train={"steps": 1}), reward_functions=[parity]))[0]
    assert same["sampling/logprob_gap_max"] < 1e-4 and same["sampling/is_ratio_mean"] == pytest.approx(1, abs=1e-3)


def test_tis_cap_is_the_old_spelling_of_token_truncate():
    algo = AlgorithmConfig(tis_cap=2.0)
    assert (algo.is_correction, algo.is_cap_max, algo.tis_cap) == ("token_truncate", 2.0, 0.0)
    for other in ({"is_correction": "sequence_mask"}, {"is_cap_max": 5.0}):
        with pytest.raises(ConfigError, match="algorithm.tis_cap: is the old spelling"):
            AlgorithmConfig(tis_cap=2.0, **other)


def test_sampler_old_logprobs_do_not_count_the_mismatch_twice(tiny_model_dir, tmp_path):
    # old_logprobs = "sampler" reuses the rollout's log-probs as the old ones; with a sampler that is not the
    # trainer, the correction's trainer log-probs must be the old ones instead, so both modes train alike
    rows = []
    for mode in ("sampler", "recompute"):
        cfg = small(tiny_model_dir, tmp_path / mode, algorithm={"is_correction": "token_truncate", "is_cap_max": 2.0,
                                                                "old_logprobs": mode, "num_iterations": 2},
                    train={"steps": 1})
        rows.append(comparable(read_metrics(train(cfg, reward_functions=[parity], engine=hot_engine))))
    assert rows[0] == rows[1]


def test_adaptive_entropy_moves_the_coefficient_and_resumes_exactly(tiny_model_dir, tmp_path):
    algorithm = {"adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 5.0, "entropy_coef_delta": 0.02,
                 "entropy_coef_max": 0.05}
    straight = train(small(tiny_model_dir, tmp_path / "s", algorithm=algorithm, train={"steps": 3}),
                     reward_functions=[parity])
    rows = read_metrics(straight)
    # the tiny model's token entropy (~3 nats) is below the target 5: the coefficient climbs by 0.02 a step
    assert [round(r["entropy_coef"], 6) for r in rows] == [0.03, 0.05, 0.05]
    part = tmp_path / "r"
    train(small(tiny_model_dir, part, algorithm=algorithm, train={"steps": 2}), reward_functions=[parity])
    resumed = train(small(tiny_model_dir, part, algorithm=algorithm, train={"steps": 3}), reward_functions=[parity],
                    resume=True)
    assert comparable(read_metrics(resumed)) == comparable(rows)
    a, b = weights_of(straight, 3), weights_of(resumed, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_adaptive_entropy_applies_no_bonus_while_entropy_is_above_the_target(tiny_model_dir, tmp_path):
    # target 0: the entropy is always above it, so the bonus never acts and the coefficient only falls
    algorithm = {"adaptive_entropy": True, "entropy_coef": 0.04, "entropy_target": 0.0, "entropy_coef_delta": 0.015}
    run = train(small(tiny_model_dir, tmp_path / "a", algorithm=algorithm, train={"steps": 2}),
                reward_functions=[parity])
    rows = read_metrics(run)
    assert [round(r["entropy_coef"], 6) for r in rows] == [0.025, 0.01]
    # same update as no bonus at all (the entropy pass is the only difference)
    plain = train(small(tiny_model_dir, tmp_path / "p", algorithm={"top_entropy_quantile": 1.0},
                        train={"steps": 2, "skip_zero_advantage": False}), reward_functions=[parity])
    a, b = weights_of(run, 2), weights_of(plain, 2)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("fields", "message"), [
    ({"loss_type": "sapo", "sapo_temperature_neg": 0.0}, "algorithm.sapo_temperature_neg: must be > 0"),
    ({"loss_type": "vespo", "vespo_k_pos": -1.0}, "algorithm.vespo_k_pos: must be >= 0"),
    ({"delta": 1.1}, r"algorithm.delta: must exceed 1 \+ epsilon_high \(1.2\)"),
    ({"loss_type": "cispo", "delta": 4.0}, "algorithm.delta: two-sided clipping applies to the clipped losses"),
    ({"loss_type": "cispo", "epsilon_high": 5.0, "delta": 4.0}, "algorithm.delta: two-sided clipping applies"),
    ({"off_policy_mask_threshold": -0.1}, "algorithm.off_policy_mask_threshold: must be >= 0"),
    ({"is_correction": "token"}, "algorithm.is_correction: got 'token'; choose one of"),
    ({"is_correction": "token_mask", "is_cap_max": 0.0}, "algorithm.is_cap_max: is_correction = 'token_mask' "
                                                         "needs a bound"),
    ({"is_correction": "token_mask", "is_cap_min": 3.0}, r"algorithm.is_cap_min: must be in \[0, 1\]"),
    ({"is_correction": "token_mask", "is_cap_max": 0.9}, "algorithm.is_cap_max: must be >= 1 .* masks or scales down"),
    ({"is_correction": "token_mask", "is_cap_max": 1.0, "is_cap_min": 1.0},
     r"algorithm.is_cap_min: must be below is_cap_max \(1\)"),
    ({"loss_type": "vespo", "is_correction": "sequence_mask"}, "algorithm.is_correction: loss_type = 'vespo' folds"),
    ({"ref_sync_every": 10}, "algorithm.ref_sync_every: syncs the reference model, which exists only with beta"),
    ({"beta": 0.04, "ref_sync_every": 10, "ref_mixup_alpha": 0.0}, r"algorithm.ref_mixup_alpha: must be in \(0, 1\]"),
    ({"adaptive_entropy": True, "entropy_coef": 2.0}, "algorithm.entropy_coef: the adaptive coefficient starts"),
    ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, r"algorithm.entropy_coef_min: must be in \[0, "),
])
def test_bad_variant_settings_are_one_config_error(fields, message):
    with pytest.raises(ConfigError, match=message):
        AlgorithmConfig(**fields)


def test_settings_that_run_but_were_probably_not_meant_are_said_at_start(tiny_model_dir, tmp_path, capsys):
    warned = {k for k, _ in AlgorithmConfig(loss_type="cispo", epsilon_high=0.28).warnings}
    assert warned == {"cispo_cap"}
    assert AlgorithmConfig(loss_type="cispo", epsilon_high=0.28).cispo_cap == pytest.approx(1.28)
    assert AlgorithmConfig(loss_type="cispo", epsilon_high=5.0).warnings == []
    assert {k for k, _ in AlgorithmConfig(loss_type="dapo", importance_sampling_level="sequence").warnings} == {
        "sequence_ratio"}
    assert {k for k, _ in AlgorithmConfig(loss_type="luspo").warnings} == {"luspo_level"}
    assert {k for k, _ in AlgorithmConfig(loss_type="vespo", importance_sampling_level="sequence").warnings} == {
        "vespo_level"}
    assert {k for k, _ in AlgorithmConfig(entropy_target=0.5).warnings} == {"adaptive_entropy"}
    assert {k for k, _ in AlgorithmConfig(loss_type="luspo", importance_sampling_level="sequence",
                                          entropy_coef=0.01).warnings} == {"luspo_entropy"}
    # options only one setting reads, set where that setting is off
    # (is_correction "auto" may turn the correction on, in async mode: bounds set beside it are not inert)
    for fields, key in (({"is_correction": "none", "is_cap_max": 5.0}, "is_bounds"),
                        ({"is_correction": "none", "is_cap_min": 0.5}, "is_bounds"),
                        ({"ref_mixup_alpha": 0.5}, "ref_mixup"), ({"sapo_temperature_pos": 5.0}, "sapo_temperature"),
                        ({"vespo_k_neg": 1.0}, "vespo_gate")):
        assert {k for k, _ in AlgorithmConfig(**fields).warnings} == {key}, fields
    assert AlgorithmConfig(is_correction="token_mask", is_cap_max=5.0).warnings == []
    assert AlgorithmConfig(beta=0.04, ref_sync_every=10, ref_mixup_alpha=0.5).warnings == []
    assert AlgorithmConfig(loss_type="sapo", sapo_temperature_pos=5.0).warnings == []
    assert [m for _, m in AlgorithmConfig(vespo_k_pos=1.0, vespo_k_neg=1.0).warnings] == [
        "algorithm.vespo_k_pos / vespo_k_neg are set but loss_type is not 'vespo': they change nothing."]
    cfg = small(tiny_model_dir, tmp_path / "w", algorithm={"loss_type": "cispo"}, train={"steps": 1},
                output={"console": True})
    assert [k for k, _ in check_config(cfg)] == ["cispo_cap"]
    train(cfg, reward_functions=[parity])
    out = capsys.readouterr()
    said = " ".join((out.out + out.err).split())  # the console wraps long lines
    assert said.count("read the old way, as a cap of 1.2") == 1 and "write epsilon_high = 1.2" in said


def test_the_adaptive_controller_measures_the_tokens_the_bonus_acts_on(tiny_model_dir, tmp_path, monkeypatch):
    # with top_entropy_quantile < 1 the bonus acts on the high-entropy tokens only, and TRL's controller measures
    # the entropy there: above the mean over every token
    import grpokit.training.update as update

    measured = []
    real = update.adapt_entropy_coef
    monkeypatch.setattr(update, "adapt_entropy_coef", lambda coef, entropy, **kw: measured.append(entropy) or
                        real(coef, entropy, **kw))
    cfg = small(tiny_model_dir, tmp_path / "q", algorithm={"adaptive_entropy": True, "top_entropy_quantile": 0.3},
                train={"steps": 1})
    row = read_metrics(train(cfg, reward_functions=[parity]))[0]
    assert len(measured) == 1 and measured[0] > row["entropy"] + 1e-3
