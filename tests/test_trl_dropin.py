"""grpokit.trl: TRL 1.16's GRPOConfig / GRPOTrainer arguments, run by grpokit.

(a) TRL's quick-start script, its `from trl import` line swapped, trains a tiny local model; (b) each
supported TRL field and the grpokit field it produces; (c) refused fields and values, one error listing
them; (d) TRL's own GRPOConfig takes the same arguments, and every field name and default is TRL's.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math

import pytest

from conftest import parity
from grpokit.config.schema import AlgorithmConfig
from grpokit.errors import ConfigError
from grpokit.trl import GRPOConfig, GRPOTrainer
from grpokit.trl.config import REFUSED, SUPPORTED
from grpokit.trl.mapping import KEEP_ALL, grpokit_config, lora_options

# TRL's quick-start (docs: "GRPO Trainer" / quick start), on a local model and in-memory prompts. MODEL and
# OUT are given by the test; the text is a valid TRL script as it stands.
QUICKSTART = '''
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})


def reward_len(completions, **kwargs):
    return [-abs(4 - len(completion)) for completion in completions]


training_args = GRPOConfig(output_dir=OUT, max_steps=2, per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=8, learning_rate=1e-3, logging_steps=1, disable_tqdm=True)
trainer = GRPOTrainer(model=MODEL, reward_funcs=reward_len, args=training_args, train_dataset=dataset)
trainer.train()
'''
QUICKSTART_ARGS = dict(max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                       learning_rate=1e-3, logging_steps=1, disable_tqdm=True)


def test_quickstart_script_trains(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from grpokit.observe.tracking import read_metrics

    assert QUICKSTART.count("from trl import GRPOConfig, GRPOTrainer") == 1
    call = next(node for node in ast.walk(ast.parse(QUICKSTART))
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "GRPOConfig")
    assert {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "output_dir"} == QUICKSTART_ARGS
    scope = {"MODEL": str(tiny_model_dir), "OUT": str(tmp_path / "out")}
    exec(compile(QUICKSTART.replace("from trl import", "from grpokit.trl import"), "quickstart.py", "exec"), scope)
    trainer = scope["trainer"]
    c = trainer.config
    assert (c.rollout.group_size, c.train.prompts_per_step, c.train.steps) == (4, 1, 2)
    rows = read_metrics(trainer.run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["reward"]) for r in rows)
    assert "rewards/reward_len/mean" in rows[0]
    assert trainer.state.global_step == 2 and len(trainer.state.log_history) == 3  # 2 steps, then the summary
    assert {"train_loss", "train_runtime"} <= set(trainer.state.log_history[-1])
    trainer.save_model(str(tmp_path / "final"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    assert model.config.model_type == "qwen2" and (tmp_path / "final" / "tokenizer.json").is_file()
    assert not (tmp_path / "final" / "trainer_state.pt").exists()


def mapped(num_rows: int = 64, dtype: str = "float32", num_eval_rows: int = 5, **trl_args) -> dict:
    """The grpokit config (flat "section.field" dict) that these TRL arguments give."""
    config = grpokit_config(GRPOConfig(**trl_args), model_path="model", dtype=dtype, num_rows=num_rows,
                            num_eval_rows=num_eval_rows)
    return {f"{s}.{k}": v for s, fields in config.to_dict().items() for k, v in fields.items()}


# TRL arguments -> the grpokit fields they set (every supported field that maps onto one appears)
MAPPING = [
    ({}, {"rollout.group_size": 8, "rollout.max_new_tokens": 512, "train.prompts_per_step": 1,
          "train.minibatch_size": 0, "train.micro_batch_size": 0, "train.steps": 3 * 64, "train.learning_rate": 1e-6,
          "train.adam_betas": (0.9, 0.999), "train.lr_schedule": "constant", "train.warmup_steps": 0,
          "train.max_grad_norm": 1.0, "train.seed": 42, "data.seed": 42, "algorithm.loss_type": "dapo",
          "algorithm.std": "sample", "algorithm.kl_bias_correction": True, "algorithm.beta": 0.0,
          "algorithm.epsilon": 0.2, "algorithm.epsilon_high": 0.0, "algorithm.scale_rewards": "group",
          "algorithm.is_correction": "none", "algorithm.delta": 0.0, "algorithm.off_policy_mask_threshold": 0.0,
          "algorithm.ref_sync_every": 0, "algorithm.adaptive_entropy": False, "algorithm.entropy_aggregation": "loss",
          "rewards.aggregation": "sum_then_normalize", "output.dir": "trainer_output", "output.save_every": 500,
          "output.keep_last": KEEP_ALL, "output.overwrite": True, "output.console": True,
          "output.completions_every": 0, "model.dtype": "float32", "model.device": "auto", "rollout.engine": "hf",
          "tools.max_calls": 512}),
    # batch: per_device_train_batch_size counts answers
    (dict(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2, max_steps=6),
     {"train.prompts_per_step": 2, "train.minibatch_size": 0, "train.micro_batch_size": 4, "train.steps": 6}),
    (dict(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2, steps_per_generation=4,
          max_steps=10),
     {"train.prompts_per_step": 4, "train.minibatch_size": 8, "train.micro_batch_size": 4, "train.steps": 5}),
    (dict(per_device_train_batch_size=4, num_generations=2, generation_batch_size=16, max_steps=8),
     {"train.prompts_per_step": 8, "train.minibatch_size": 4, "train.micro_batch_size": 0, "train.steps": 2}),
    (dict(num_iterations=2, max_steps=10), {"algorithm.num_iterations": 2, "train.steps": 5}),
    (dict(num_train_epochs=2, per_device_train_batch_size=16, num_generations=8),  # 64 rows / 2 prompts a step
     {"train.steps": 64, "train.prompts_per_step": 2}),
    (dict(num_train_epochs=0.5), {"train.steps": 32}),
    # sampling and the objective
    (dict(max_completion_length=32, temperature=0.7, top_p=0.9, top_k=20),
     {"rollout.max_new_tokens": 32, "rollout.temperature": 0.7, "rollout.top_p": 0.9, "rollout.top_k": 20,
      "tools.max_calls": 32}),
    (dict(beta=0.04, epsilon=0.1, epsilon_high=0.28, use_bias_correction_kl=False),
     {"algorithm.beta": 0.04, "algorithm.epsilon": 0.1, "algorithm.epsilon_high": 0.28,
      "algorithm.kl_bias_correction": False}),
    (dict(loss_type="grpo", scale_rewards=False, importance_sampling_level="sequence"),
     {"algorithm.loss_type": "grpo", "algorithm.scale_rewards": "none", "algorithm.importance_sampling_level":
      "sequence"}),
    (dict(loss_type="dr_grpo", scale_rewards="batch"), {"algorithm.loss_type": "dr_grpo",
                                                        "algorithm.scale_rewards": "batch"}),
    (dict(scale_rewards=True), {"algorithm.scale_rewards": "group"}),
    (dict(loss_type="cispo", epsilon_high=5.0), {"algorithm.loss_type": "cispo", "algorithm.epsilon_high": 5.0}),
    (dict(loss_type="sapo", sapo_temperature_pos=0.9, sapo_temperature_neg=1.2),
     {"algorithm.loss_type": "sapo", "algorithm.sapo_temperature_pos": 0.9, "algorithm.sapo_temperature_neg": 1.2}),
    (dict(loss_type="luspo", importance_sampling_level="sequence"), {"algorithm.loss_type": "luspo"}),
    (dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.5),
     {"algorithm.loss_type": "vespo", "algorithm.vespo_k_pos": 1.5, "algorithm.vespo_lambda_pos": 2.5,
      "algorithm.vespo_k_neg": 2.0, "algorithm.vespo_lambda_neg": 1.5}),
    (dict(delta=4.0, off_policy_mask_threshold=0.5), {"algorithm.delta": 4.0,
                                                     "algorithm.off_policy_mask_threshold": 0.5}),
    (dict(multi_objective_aggregation="normalize_then_sum"), {"rewards.aggregation": "normalize_then_sum"}),
    (dict(beta=0.04, sync_ref_model=True, ref_model_sync_steps=20, ref_model_mixup_alpha=0.9, num_iterations=2,
          max_steps=100), {"algorithm.ref_sync_every": 10, "algorithm.ref_mixup_alpha": 0.9}),
    (dict(loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=0.5, entropy_coef_min=0.001,
          entropy_coef_max=0.1, entropy_coef_delta=0.002),
     {"algorithm.adaptive_entropy": True, "algorithm.entropy_coef": 0.01, "algorithm.entropy_target": 0.5,
      "algorithm.entropy_coef_min": 0.001, "algorithm.entropy_coef_max": 0.1, "algorithm.entropy_coef_delta": 0.002,
      "algorithm.entropy_aggregation": "token_mean"}),
    # the entropy bonus with every loss type, any accumulation, processes and top-entropy mask: TRL's token mean
    (dict(loss_type="grpo", entropy_coef=0.01, gradient_accumulation_steps=2, top_entropy_quantile=0.5),
     {"algorithm.loss_type": "grpo", "algorithm.entropy_coef": 0.01, "algorithm.entropy_aggregation": "token_mean",
      "algorithm.top_entropy_quantile": 0.5}),
    *[(dict(loss_type=lt, entropy_coef=0.02, **({"epsilon_high": 5.0} if lt == "cispo" else {})),
       {"algorithm.loss_type": lt, "algorithm.entropy_coef": 0.02, "algorithm.entropy_aggregation": "token_mean"})
      for lt in ("dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")],
    (dict(loss_type="sapo", use_adaptive_entropy=True), {"algorithm.adaptive_entropy": True,
                                                         "algorithm.entropy_aggregation": "token_mean"}),
    (dict(shuffle_dataset=False), {"data.shuffle": False}),
    (dict(loss_type="bnpo", entropy_coef=0.01, mask_truncated_completions=True),
     {"algorithm.loss_type": "bnpo", "algorithm.entropy_coef": 0.01, "algorithm.mask_truncated_completions": True}),
    (dict(top_entropy_quantile=0.2), {"algorithm.top_entropy_quantile": 0.2}),
    (dict(max_tool_calling_iterations=3), {"tools.max_calls": 3}),
    # optimizer and schedule
    (dict(learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95, max_grad_norm=0.5, seed=7, optim="adamw_torch"),
     {"train.learning_rate": 3e-4, "train.adam_betas": (0.8, 0.95), "train.max_grad_norm": 0.5, "train.seed": 7,
      "data.seed": 7}),
    (dict(lr_scheduler_type="constant_with_warmup", warmup_steps=5, max_steps=20),
     {"train.lr_schedule": "constant", "train.warmup_steps": 5}),
    (dict(warmup_steps=5, max_steps=20), {"train.warmup_steps": 0}),  # transformers' "constant" has no warmup
    (dict(lr_scheduler_type="cosine", warmup_steps=0.1, max_steps=100),
     {"train.lr_schedule": "cosine", "train.warmup_steps": 10}),
    # saving, logging, precision, device
    (dict(output_dir="runs/x", save_steps=10, save_total_limit=3, max_steps=100),
     {"output.dir": "runs/x", "output.save_every": 10, "output.keep_last": 3}),
    (dict(num_iterations=2, save_steps=10, max_steps=100), {"output.save_every": 5, "train.steps": 50}),
    (dict(save_strategy="no"), {"output.save_every": 0}),
    (dict(save_steps=0.25, max_steps=100), {"output.save_every": 25}),
    (dict(log_completions=True, logging_steps=5), {"output.completions_every": 5}),
    (dict(disable_tqdm=True, report_to=["tensorboard"]), {"output.console": False, "output.tensorboard": True}),
    (dict(report_to="none"), {"output.tensorboard": False, "output.wandb": False}),
    (dict(use_cpu=True), {"model.device": "cpu"}),
    (dict(bf16=True, dtype="bfloat16"), {"model.dtype": "bfloat16"}),
    # evaluation: eval_steps counts optimizer steps (converted like save_steps); eval_dataset has 5 rows here
    (dict(eval_strategy="steps", eval_steps=4, num_iterations=2, max_steps=8),
     {"eval.every": 2, "eval.num_prompts": 5, "eval.samples_per_prompt": 8, "eval.temperature": 1.0,
      "eval.seed": 42, "eval.greedy": False, "output.keep_best": ""}),
    (dict(eval_strategy="steps", logging_steps=3, max_steps=9, num_generations_eval=4, per_device_eval_batch_size=4,
          temperature=0.7), {"eval.every": 3, "eval.samples_per_prompt": 4, "eval.temperature": 0.7}),
    (dict(eval_strategy="steps", eval_steps=0.25, save_steps=0.5, max_steps=100, load_best_model_at_end=True,
          metric_for_best_model="reward"), {"eval.every": 25, "output.save_every": 50,
                                            "output.keep_best": "eval/mean_reward"}),
    (dict(eval_strategy="steps", eval_steps=10, save_steps=20, max_steps=100, load_best_model_at_end=True,
          metric_for_best_model="eval_reward", greater_is_better=True),
     {"eval.every": 10, "output.keep_best": "eval/mean_reward"}),
    (dict(metric_for_best_model="reward"), {"eval.every": 0, "output.keep_best": ""}),  # no evaluation: no effect
    (dict(load_best_model_at_end=True, metric_for_best_model="reward", save_strategy="no"),
     {"eval.every": 0, "output.keep_best": "", "output.save_every": 0}),
    (dict(gradient_checkpointing=False), {"train.gradient_checkpointing": False}),
    (dict(max_steps=10), {"train.gradient_checkpointing": True}),  # TRL's default: on
    # accepted, and change nothing in grpokit (docs/TRL.md says why)
    (dict(disable_dropout=True, pad_to_multiple_of=64, do_train=True), {"train.steps": 3 * 64}),
]


@pytest.mark.parametrize("trl_args, expected", MAPPING, ids=lambda v: ",".join(v) if isinstance(v, dict) else None)
def test_mapping_table(trl_args, expected):
    got = mapped(**trl_args)
    assert {k: got[k] for k in expected} == expected


def test_every_supported_field_is_in_the_mapping_table():
    used = {k for args, _ in MAPPING for k in args if k != "dtype"}
    # fields read only with vLLM (needs the package) or by the trainer (rows, model loading, weights)
    elsewhere = {"use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode",
                 "vllm_max_model_length", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                 "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
                 "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "remove_unused_columns",
                 "vllm_importance_sampling_cap", "model_init_kwargs", "reward_weights", "fp16", "adam_epsilon",
                 "weight_decay", "do_eval", "do_predict", "local_rank",
                 # accepted, changing nothing or only the stop strings (test_trl_dropin_object.py)
                 "use_liger_kernel", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
                 "dataloader_prefetch_factor", "accelerator_config", "generation_kwargs"}
    assert set(SUPPORTED) - used - elsewhere == set()


def test_vllm_options_map_when_vllm_is_installed():
    pytest.importorskip("vllm")
    got = mapped(use_vllm=True, vllm_gpu_memory_utilization=0.5, vllm_max_model_length=2048,
                 vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0)
    assert got["rollout.engine"] == "vllm" and got["algorithm.is_correction"] == "token_truncate"
    assert got["algorithm.is_cap_max"] == 2.0
    assert got["rollout.vllm"] == {"gpu_memory_utilization": 0.5, "enable_sleep_mode": False, "max_model_len": 2048}


@pytest.mark.parametrize(("trl_args", "expected"), [
    ({}, {"is_correction": "none"}),  # TRL corrects the sampler only with use_vllm
    ({"use_vllm": True}, {"is_correction": "sequence_mask", "is_cap_max": 3.0, "is_cap_min": 0.0}),  # TRL's default
    ({"use_vllm": True, "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_max": None,
      "vllm_importance_sampling_clip_min": 0.5}, {"is_correction": "token_mask", "is_cap_max": 0.0, "is_cap_min": 0.5}),
    ({"use_vllm": True, "vllm_importance_sampling_correction": False}, {"is_correction": "none"}),
    ({"use_vllm": True, "vllm_importance_sampling_cap": 2.0}, {"is_correction": "sequence_mask", "is_cap_max": 2.0,
                                                               "is_cap_min": 0.0}),  # TRL's deprecated spelling
])
def test_vllm_mismatch_correction_maps_every_trl_mode(trl_args, expected):
    from grpokit.trl.mapping import _mismatch

    args = GRPOConfig(**trl_args)
    assert _mismatch(args) == expected
    AlgorithmConfig(**expected)  # a valid grpokit setting


def test_refused_fields_and_values_are_listed_in_one_error():
    with pytest.raises(ConfigError) as e:
        GRPOConfig(push_to_hub=True, eval_strategy="epoch", torch_compile=True, delta=1.1,
                   lr_scheduler_type="linear", weight_decay=0.1, use_vllm=True, vllm_mode="remote")
    message = str(e.value)
    for part in ("push_to_hub=True", "eval_strategy='epoch'", "torch_compile=True", "delta=1.1",
                 "lr_scheduler_type='linear'", "weight_decay=0.1", "vllm_mode='remote' (use 'colocate' or 'server')"):
        assert part in message, part
    assert "max_steps" not in message  # only what was given away from the defaults


@pytest.mark.parametrize("trl_args, match", [
    (dict(per_device_train_batch_size=6, num_generations=4), r"generation_batch_size \(6\) must be divisible by "
                                                             r"num_generations \(4\)"),
    (dict(generation_batch_size=12, per_device_train_batch_size=8), "must be divisible by the global batch size"),
    (dict(generation_batch_size=16, steps_per_generation=2), "can not be both configured"),
    (dict(num_generations=1, per_device_train_batch_size=1), "at least 2 generations"),
    (dict(loss_type="cispo"), "set epsilon_high >= 1"),
    (dict(off_policy_mask_threshold=0.0), "grpokit's 0 means off"),
    (dict(sync_ref_model=True), r"sync_ref_model=True \(there is no reference model to sync with beta=0"),
    (dict(entropy_coef=-0.1), r"entropy_coef=-0.1 \(grpokit's entropy bonus needs a coefficient >= 0; a negative "
                              r"one, an entropy penalty, is not supported\)"),
    (dict(loss_type="sapo", delta=4.0), "TRL ignores delta for loss_type='sapo'"),
    (dict(bf16=True, fp16=True), "fp16=True"),
    (dict(eval_strategy="epoch"), "eval_strategy='epoch' \\(grpokit counts steps, not epochs"),
    (dict(eval_strategy="steps", load_best_model_at_end=True), "metric_for_best_model='loss' \\(transformers' "
                                                                "default"),
    (dict(eval_strategy="steps", load_best_model_at_end=True, metric_for_best_model="rewards/f/mean"),
     "use 'reward', TRL's eval_reward = grpokit's eval/mean_reward"),
    (dict(eval_strategy="steps", load_best_model_at_end=True, metric_for_best_model="reward",
          greater_is_better=False), "greater_is_better=False"),
    (dict(load_best_model_at_end=True, metric_for_best_model="reward"), "save and eval strategy to match"),
    (dict(eval_strategy="steps", eval_steps=3, save_steps=10, load_best_model_at_end=True,
          metric_for_best_model="reward"), "save_steps to be a multiple of eval_steps"),
    (dict(eval_strategy="steps", per_device_eval_batch_size=6), r"global eval batch size \(6 \* 1\) must be "
                                                                 r"divisible by the number of generations used for "
                                                                 r"evaluation \(8\)"),
    (dict(eval_on_start=True), r"eval_on_start=True \(grpokit evaluates after training steps only; call "
                               r"trainer.evaluate\(\) before trainer.train\(\)\)"),
    (dict(eval_strategy="steps", eval_steps=2.5), "eval_steps must be an integer if bigger than 1"),
    (dict(epsilon_high="5"), r"epsilon_high='5' \(must be a number\)$"),
    (dict(delta="4"), r"delta='4' \(must be a number\)$"),
    (dict(use_vllm="yes"), r"use_vllm='yes' \(must be True or False\)$"),
    (dict(num_generations=4.0), r"num_generations=4\.0 \(must be a whole number: 4\)$"),
    (dict(use_vllm=True, vllm_mode="server", vllm_server_host=None), r"vllm_server_host=None \(must be a string\)$"),
    (dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=""),
     r"vllm_server_base_url='' \(give the server's address, or None for host and port\)$"),
    (dict(max_steps=3.5), r"max_steps=3\.5 \(must be a whole number\)$"),
])
def test_refused_configs(trl_args, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**trl_args)


@pytest.mark.parametrize("trl_args, match", [
    (dict(num_iterations=2, max_steps=3), r"max_steps=3 optimizer steps is not a whole number of generation "
                                          r"batches \(2 optimizer steps each"),
    (dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=1, num_generations=4),
     "steps_per_generation \\(1\\) must be a multiple of gradient_accumulation_steps"),
    (dict(bf16=True), "bf16=True: grpokit has no mixed precision"),
    (dict(save_steps=3, num_iterations=2, max_steps=10), "save_steps=3"),
    (dict(eval_strategy="steps", eval_steps=3, num_iterations=2, max_steps=10),
     r"eval_steps=3 optimizer steps is not a whole number of generation batches \(2 optimizer steps each"),
    (dict(eval_strategy="steps", num_eval_rows=0), "eval_strategy='steps': evaluation needs held-out prompts"),
])
def test_refused_mappings(trl_args, match):
    with pytest.raises(ConfigError, match=match):
        mapped(**trl_args)


def test_too_few_prompts_for_one_epoch_batch():
    with pytest.raises(ConfigError, match="train_dataset has 3 prompts, fewer than one generation batch of 4"):
        mapped(num_rows=3, per_device_train_batch_size=16, num_generations=4)


def test_unknown_argument_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_prompt_length'"):
        GRPOConfig(max_prompt_length=128)  # removed from TRL's GRPOConfig too (1.16 has no such field)


def test_trainer_refusals_before_anything_loads(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path / "o"), max_steps=1)
    rows = [{"prompt": "1+1="}] * 8
    cases = [(dict(callbacks=[object()]), "does not support callbacks"),
             (dict(optimizers=(object(), None)), "does not support optimizers"),
             (dict(reward_funcs="./no-such-reward-model"), "is neither a local folder .* nor a Hugging Face Hub id"),
             (dict(reward_funcs=[len, 3]), "entry of type int is not a reward function"),
             (dict(reward_funcs=None), "reward_funcs is required"),
             (dict(reward_processing_classes=[None, None]), "reward_processing_classes: 2 given for 1 reward "
                                                            "functions"),
             (dict(train_dataset=None), "`train_dataset` is required"),
             (dict(eval_dataset={"a": rows, "b": rows}, args=GRPOConfig(output_dir=str(tmp_path / "o"), max_steps=1,
                                                                        eval_strategy="steps")),
              "grpokit's evaluation during training scores one dataset"),
             (dict(train_dataset={"train": rows}), "train_dataset: a dict holds several splits; pick one"),
             (dict(args=GRPOConfig(output_dir=str(tmp_path / "o"), max_steps=1, eval_strategy="steps")),
              "eval_strategy='steps' needs an eval_dataset")]
    for kwargs, match in cases:
        given = {"model": "no-such-folder", "reward_funcs": len, "args": args, "train_dataset": rows, **kwargs}
        with pytest.raises(ConfigError, match=match):
            GRPOTrainer(**given)
    with pytest.raises(TypeError, match="must be a grpokit.trl.GRPOConfig"):
        GRPOTrainer("no-such-folder", len, args={"max_steps": 1}, train_dataset=rows)


def test_a_dataset_without_a_prompt_column_is_told_how_to_rename_it(tiny_model_dir, tmp_path):
    """Issue 43 point 13: the advice was "pass prompt_column=<one of them>", and GRPOConfig(prompt_column=...) is a
    TypeError."""
    from datasets import Dataset

    dataset = Dataset.from_list([{"question": "1+1=", "answer": "2"}] * 8)
    args = GRPOConfig(output_dir=str(tmp_path / "o"), max_steps=1)
    for given in ({"train_dataset": dataset}, {"train_dataset": [{"prompt": "1+1="}] * 8, "eval_dataset": dataset}):
        words = r"_dataset: no 'prompt' column \(its columns: \['answer', 'question'\]\); .*rename_column\(\"question\""
        with pytest.raises(ConfigError, match=words) as err:
            GRPOTrainer(str(tiny_model_dir), len, args=args, **given).train()
        assert "prompt_column" not in str(err.value)


def test_trainer_takes_a_model_object_a_tokenizer_and_a_lora_config(tmp_path):
    from peft import LoraConfig

    from grpokit.models.tiny import build_tiny_model

    model, tokenizer = build_tiny_model(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)
    args = GRPOConfig(output_dir=str(tmp_path / "o"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      reward_weights=[2.0, 0.5], remove_unused_columns=True)
    rows = [{"prompt": "1+1=", "answer": "2"}] * 8
    trainer = GRPOTrainer(model, [len, abs], args=args, train_dataset=rows, processing_class=tokenizer,
                          peft_config=LoraConfig(r=4, lora_alpha=8))
    c = trainer.config
    assert c.model.path == str((tmp_path / "o" / "trl-model").resolve()) and c.model.dtype == "float32"
    assert (tmp_path / "o" / "trl-model" / "model.safetensors").is_file()
    assert c.model.lora == {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}  # peft's qwen2 default
    assert c.rewards.weights == (2.0, 0.5) and trainer.rows[0] == {"prompt": "1+1="}
    linked = GRPOTrainer(str(tmp_path / "tiny"), [len, abs], args=args, train_dataset=rows,
                         processing_class=tokenizer)
    assert (tmp_path / "o" / "trl-model" / "config.json").is_symlink()
    assert linked.config.model.lora == {}


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_model_object_with_lora_trains_and_saves_the_adapter(tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from grpokit.models.tiny import build_tiny_model

    model, _ = build_tiny_model(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "tiny"))  # an object naming its folder
    args = GRPOConfig(output_dir=str(tmp_path / "o"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, learning_rate=1e-3, disable_tqdm=True, reward_weights=[1.0, 0.5])
    trainer = GRPOTrainer(model, [length, parity], args=args,
                          train_dataset=[{"prompt": f"{i}+1="} for i in range(8)],
                          peft_config=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    output = trainer.train()
    assert output.global_step == 1 and math.isfinite(output.training_loss)
    row = trainer.state.log_history[0]
    assert math.isclose(row["reward"], row["rewards/length/mean"] + 0.5 * row["rewards/parity/mean"], rel_tol=1e-5)
    trainer.save_model(str(tmp_path / "final"))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "final").iterdir()}


def test_lora_options_refuse_what_grpokit_lora_lacks():
    from peft import LoraConfig

    assert lora_options(LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj"]), "qwen2") == {
        "r": 16, "alpha": 32.0, "target_modules": ["k_proj", "q_proj"]}
    with pytest.raises(ConfigError, match="lora_dropout=0.05"):
        lora_options(LoraConfig(lora_dropout=0.05, use_dora=True), "qwen2")


# ---- (d) TRL's own GRPOConfig ----------------------------------------------------------------------


def test_field_names_and_defaults_are_trls():
    trl = pytest.importorskip("trl")

    def defaults(cls):
        return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(cls) if f.init}

    ours, theirs = defaults(GRPOConfig), defaults(trl.GRPOConfig)
    assert set(ours) == set(theirs) and set(ours) == set(SUPPORTED) | set(REFUSED)
    differing = {k: (theirs[k], ours[k]) for k in ours if ours[k] != theirs[k]}
    assert differing == {"lr_scheduler_type": ("linear", "constant")}  # grpokit has no linear decay
    assert list(inspect.signature(GRPOTrainer).parameters) == list(inspect.signature(trl.GRPOTrainer).parameters)


@pytest.mark.parametrize("trl_args", [QUICKSTART_ARGS] + [args for args, _ in MAPPING])
def test_trl_accepts_the_same_arguments(trl_args, tmp_path):
    trl = pytest.importorskip("trl")
    trl_args = {k: v for k, v in trl_args.items() if k != "dtype"}
    ours = GRPOConfig(output_dir=str(tmp_path), **{k: v for k, v in trl_args.items() if k != "output_dir"})
    theirs = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True,
                            **{k: v for k, v in trl_args.items() if k not in ("output_dir", "use_cpu")})
    for name in ("steps_per_generation", "generation_batch_size", "scale_rewards", "num_generations", "eval_steps",
                 "metric_for_best_model", "greater_is_better", "do_eval"):
        assert getattr(ours, name) == getattr(theirs, name), name


def _documented_names(text: str) -> tuple[set, list]:
    """The argument names docs/TRL.md spells in backticks: plain, `a_pos/neg`, `a(_b, _c)`, `prefix_*`, `_suffix`."""
    import re

    names, patterns = set(), []
    for token in re.findall(r"`([a-z_][a-z0-9_/*(), ]*)`", text):
        token = token.replace(" ", "")
        if token.endswith("*"):
            patterns.append(lambda n, p=token[:-1]: n.startswith(p))
        elif token.startswith("_"):
            patterns.append(lambda n, p=token: n.endswith(p))
        elif "(" in token:
            base, rest = token.rstrip(")").split("(", 1)
            names |= {base} | {base + part for part in rest.split(",")}
        elif "/" in token:
            first, *others = token.split("/")
            stem = first.rsplit("_", 1)[0]
            names |= {first} | {f"{stem}_{o}" for o in others}
        else:
            names.add(token)
    return names, patterns


def test_docs_list_every_trl_argument_and_count_them():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "TRL.md").read_text(encoding="utf-8")
    names, patterns = _documented_names(text)
    missing = [n for n in (*SUPPORTED, *REFUSED) if n not in names and not any(p(n) for p in patterns)]
    assert not missing, f"docs/TRL.md does not list (with its decision): {missing}"
    with_a_note = {"use_liger_kernel", "dataloader_num_workers", "dataloader_pin_memory",
                   "dataloader_persistent_workers", "dataloader_prefetch_factor", "accelerator_config",
                   "generation_kwargs"}
    assert with_a_note <= set(SUPPORTED)
    assert f"{len(SUPPORTED) - len(with_a_note)} arguments below map" in text.replace("\n", " ")
    assert f"{len(SUPPORTED) + len(REFUSED)} argument names" in text
