"""Benchmark worker: run TRL's GRPOTrainer on one configuration in this process; print one result line.

    .venv/bin/python bench/run_trl.py '{"model": "M", "B": 8, "G": 8, "L": 128, "gc": false, ...}'

One TRL optimizer step consumes one generation batch of B*G answers (per-device
batch 8 x gradient accumulation B*G/8); with num_iterations = mu, TRL generates
once every mu optimizer steps, so time is measured over whole generation cycles
(mu steps) after a first warm-up cycle. Completions have a fixed length:
``min_new_tokens = max_new_tokens`` masks EOS until the limit.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, REWARDS, emit, load_rows, peak_rss_mb, read_spec, set_threads  # noqa: E402


def main(spec: dict) -> None:
    set_threads(spec.get("threads", 2))
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    mu, N, per_device = spec["mu"], spec["B"] * spec["G"], spec.get("trl_per_device", 8)
    cycles = spec["warmup"] + spec["steps"]
    tok = AutoTokenizer.from_pretrained(str(MODELS / spec["model"]))
    stamps: list[tuple[float, float]] = []
    gen_time: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            stamps.append((self.t0, time.perf_counter()))

    dist = spec.get("lengths")  # realistic lengths (bench/lengths.py): answers end at EOS, forced
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, fp16=False, report_to="none", logging_steps=1,
            save_strategy="no", max_steps=cycles * mu, learning_rate=spec["lr"], seed=spec.get("seed", 0),
            per_device_train_batch_size=per_device, gradient_accumulation_steps=N // per_device,
            num_generations=spec["G"], max_completion_length=spec["L"], temperature=spec["temperature"],
            beta=spec["beta"], num_iterations=mu, loss_type=spec["loss_type"], epsilon=0.2, scale_rewards="group",
            gradient_checkpointing=spec["gc"],
            generation_kwargs={} if dist else {"min_new_tokens": spec["L"]},
            dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=1.0,
        )
        trainer = GRPOTrainer(model=str(MODELS / spec["model"]), reward_funcs=[REWARDS[spec["reward"]]], args=args,
                              processing_class=tok, callbacks=[StepTimer()],
                              train_dataset=Dataset.from_list(load_rows(spec["num_prompts"], spec["model"],
                                                                         spec.get("prompt_tokens"))))
        if dist:
            from lengths import force_trl

            force_trl(trainer.model, dist, N, tok.eos_token_id)
        generate = trainer._generate_single_turn

        def timed_generate(*a, **k):  # sampling only, as grpokit's time/rollout
            t = time.perf_counter()
            out = generate(*a, **k)
            gen_time.append(time.perf_counter() - t)
            return out

        trainer._generate_single_turn = timed_generate
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    measured = stamps[spec["warmup"] * mu:]  # whole cycles after the warm-up cycle
    step_s = sum(b - a for a, b in measured) / len(measured)
    gen_s = sum(gen_time[spec["warmup"]:]) / len(measured)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    emit({
        "system": "trl", "name": spec["name"], "gc": spec["gc"],
        "s_per_opt_step": step_s, "s_per_generation": step_s * mu,
        "rollout_s": gen_s, "train_s": step_s - gen_s,
        "completion_tokens": N * spec["L"],  # fixed lengths; the driver counts forced ones (bench/lengths.py)
        "loss": losses[-1] if losses else None,
        "mean_lengths": lengths,  # per logged step: the forced lengths' check
        "peak_rss_mb": peak_rss_mb(), "wall_s": wall,
        "per_step": [b - a for a, b in measured],
    })


if __name__ == "__main__":
    main(read_spec())
