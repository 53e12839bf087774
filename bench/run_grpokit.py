"""Benchmark worker: run grpokit on one configuration in this process; print one result line.

    .venv/bin/python bench/run_grpokit.py '{"model": "M", "B": 8, "G": 8, "L": 128, ...}'
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, REWARDS, emit, load_rows, peak_rss_mb, read_spec, set_threads  # noqa: E402


def per_or_0(key: str, rows: list[dict]) -> float:
    return sum(m.get(key, 0.0) for m in rows) / len(rows)


def main(spec: dict) -> None:
    set_threads(spec.get("threads", 2))
    from grpokit.config.schema import (
        AlgorithmConfig,
        Config,
        DataConfig,
        ModelConfig,
        OutputConfig,
        RolloutConfig,
        TrainConfig,
    )
    from grpokit.training.loop import train

    steps = spec["warmup"] + spec["steps"]
    dist = spec.get("lengths")  # realistic lengths (bench/lengths.py): answers end at EOS, forced
    if dist:
        from lengths import force_grpokit
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(str(MODELS / spec["model"])).eos_token_id
        force_grpokit(dist, spec["B"] * spec["G"], eos)
    with tempfile.TemporaryDirectory() as tmp:
        config = Config(
            model=ModelConfig(path=str(MODELS / spec["model"]), device="cpu", **spec.get("grpokit_model", {})),
            data=DataConfig(path="rows.jsonl"),  # replaced by rows= below
            rollout=RolloutConfig(group_size=spec["G"], max_new_tokens=spec["L"], temperature=spec["temperature"],
                                  ignore_eos=not dist, **spec.get("grpokit_rollout", {})),  # ablations: speed options
            algorithm=AlgorithmConfig(loss_type=spec["loss_type"], beta=spec["beta"], num_iterations=spec["mu"],
                                      epsilon=0.2, std="sample", scale_rewards="group",
                                      **spec.get("grpokit_algorithm", {})),
            train=TrainConfig(**{"steps": steps, "prompts_per_step": spec["B"], "learning_rate": spec["lr"],
                                 "adam_betas": (0.9, 0.999), "max_grad_norm": 1.0, "seed": spec.get("seed", 0),
                                 **spec.get("grpokit_train", {})}),  # levers and ablations override
            output=OutputConfig(dir=str(Path(tmp) / "run"), console=False, save_every=0),
        )
        t0 = time.perf_counter()
        run_dir = train(config, reward_functions=[REWARDS[spec["reward"]]],
                        rows=load_rows(spec["num_prompts"], spec["model"], spec.get("prompt_tokens")))
        wall = time.perf_counter() - t0
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = lines[spec["warmup"]:]
    mu = spec["mu"]
    per = lambda k: sum(m[k] for m in measured) / len(measured)  # noqa: E731
    # one grpokit step = one generation batch and mu optimizer steps
    emit({
        "system": "grpokit", "name": spec["name"],
        "s_per_opt_step": per("time/step") / mu,
        "s_per_generation": per("time/step"),
        "rollout_s": per("time/rollout") / mu,  # generation (sampling) only, per optimizer step
        "train_s": (per("time/step") - per("time/rollout")) / mu,  # rewards, old/ref logprobs, update
        "completion_tokens": (sum(m["completions/mean_length"] for m in measured) / len(measured)
                              * spec["B"] * spec["G"]),
        "frac_reward_zero_std": per("frac_reward_zero_std"),
        "loss": measured[-1].get("loss"),
        "mean_lengths": [m["completions/mean_length"] for m in lines],  # per step: the forced lengths' check
        "peak_rss_mb": peak_rss_mb(), "wall_s": wall, "per_step": [m["time/step"] for m in measured],
        # asynchronous rollout (rollout.mode = "async"): the trainer's wait for batches, the sampler's for orders
        # and weights, per step (bench/async_rollout.py)
        "trainer_idle_s": per_or_0("time/trainer_idle", measured),
        "sampler_idle_s": per_or_0("time/sampler_idle", measured),
        # the first (warm-up) step, from the same weights and prompts in every run: what a lever changes
        "first_step": {k: lines[0].get(k) for k in ("loss", "grad_norm", "entropy")},
    })


if __name__ == "__main__":
    main(read_spec())
