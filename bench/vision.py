"""grpokit against TRL's GRPOTrainer on a tiny vision-language model, in one invocation.

    .venv/bin/python bench/vision.py            # builds the demo's tiny Qwen2-VL, runs each system in its own process

Both train the vision demo's base model (`grpokit demo --task vision`: a tiny Qwen2-VL, hidden size 128, 32x32
images, 16 image tokens a prompt) on the same 64 `shapes` rows (PIL images, conversational prompts), B = 4
prompts x G = 8 answers of exactly L = 8 tokens (grpokit `rollout.ignore_eos`, TRL `min_new_tokens`), loss
`dapo`, beta = 0, mu = 1, lr 1e-5, one torch thread, on the CPU; the reward (distinct characters of the answer)
never ties, so every step updates. A third system is grpokit with `train.shared_prompt_forward = false` (every
answer's prompt and pixels run in the scoring forwards): what sharing the prompt's forward saves. Each system
runs 3 times, alternating, each run in its own process. Printed:
seconds per step after one warm-up step (mean of the rest; the median run and the range), the sampling share,
and the process's peak RSS. Compare figures only from one invocation.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

B, G, L, STEPS, WARMUP, ROUNDS = 4, 8, 8, 6, 1, 3


def distinct_characters(completions, **kwargs) -> list[float]:
    return [len(set(c[-1]["content"] if isinstance(c, list) else c)) / 8.0 for c in completions]


def rows():
    from grpokit.tasks import get_task

    return get_task("shapes", grid=4).generate(64, seed=0, split="train")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_grpokit(model: str, shared_prompt_forward: bool = True) -> dict:
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

    with tempfile.TemporaryDirectory() as tmp:
        config = Config(model=ModelConfig(path=model, device="cpu"),
                        data=DataConfig(task="shapes", task_args={"grid": 4}),
                        rollout=RolloutConfig(group_size=G, max_new_tokens=L, ignore_eos=True),
                        algorithm=AlgorithmConfig(loss_type="dapo", beta=0.0),
                        train=TrainConfig(steps=WARMUP + STEPS, prompts_per_step=B, learning_rate=1e-5, num_threads=1,
                                          shared_prompt_forward=shared_prompt_forward),
                        output=OutputConfig(dir=str(Path(tmp) / "run"), console=False, save_every=0))
        run = train(config, rows=rows(), reward_functions=[distinct_characters])
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][WARMUP:]
    step = sum(m["time/step"] for m in metrics) / len(metrics)
    return {"system": "grpokit" if shared_prompt_forward else "grpokit-unshared", "s_per_step": step,
            "rollout_s": sum(m["time/rollout"] for m in metrics) / len(metrics), "peak_rss_mb": peak_rss_mb()}


def run_trl(model: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpokit.models.vision import load_processor

    torch.set_num_threads(1)
    stamps, gen = [], []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter() - self.t0)

    data = [{k: r[k] for k in ("prompt", "image", "answer")} for r in rows()]
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=tmp, use_cpu=True, bf16=False, report_to="none", logging_steps=1,
                          save_strategy="no", max_steps=WARMUP + STEPS, learning_rate=1e-5, seed=0,
                          per_device_train_batch_size=B * G, gradient_accumulation_steps=1, num_generations=G,
                          max_completion_length=L, generation_kwargs={"min_new_tokens": L}, beta=0.0,
                          loss_type="dapo", dataloader_num_workers=0, disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=[distinct_characters], args=args,
                              processing_class=load_processor(model), train_dataset=Dataset.from_list(data),
                              callbacks=[StepTimer()])
        generate = trainer._generate_single_turn

        def timed(*a, **k):
            t = time.perf_counter()
            out = generate(*a, **k)
            gen.append(time.perf_counter() - t)
            return out

        trainer._generate_single_turn = timed
        trainer.train()
    return {"system": "trl", "s_per_step": sum(stamps[WARMUP:]) / STEPS, "rollout_s": sum(gen[WARMUP:]) / STEPS,
            "peak_rss_mb": peak_rss_mb()}


def main() -> None:
    import platform

    from grpokit.demo_vision import MODEL
    from grpokit.models.tiny_vision import build_tiny_vlm

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_vlm(tmp, arch=MODEL["arch"], hidden_size=MODEL["hidden_size"], num_layers=MODEL["num_layers"])
        runs: dict[str, list[dict]] = {"grpokit": [], "trl": [], "grpokit-unshared": []}
        for _ in range(ROUNDS):  # alternating, so a change in the others' load falls on both
            for system in runs:
                out = subprocess.run([sys.executable, __file__, system, tmp], capture_output=True, text=True)
                if out.returncode != 0:
                    sys.exit(f"{system} failed:\n{out.stderr[-3000:]}")
                runs[system].append(json.loads(out.stdout.strip().splitlines()[-1]))
    results = [{"system": name, **{k: statistics.median(r[k] for r in rs) for k in ("s_per_step", "rollout_s",
                                                                                     "peak_rss_mb")},
                "range": (min(r["s_per_step"] for r in rs), max(r["s_per_step"] for r in rs))}
               for name, rs in runs.items()]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"machine: {cpu}; B={B} G={G} L={L}, {STEPS} steps after {WARMUP} warm-up, 1 thread, {ROUNDS} runs of each "
          f"(medians); load average at the end {load}")
    for r in results:
        print(f"{r['system']:8s} {r['s_per_step']:.3f} s/step ({r['range'][0]:.3f}-{r['range'][1]:.3f}; sampling "
              f"{r['rollout_s']:.3f} s)  peak RSS {r['peak_rss_mb']:.0f} MB")
    print(f"TRL / grpokit time per step: {results[1]['s_per_step'] / results[0]['s_per_step']:.2f}x; without the "
          f"shared prompt forward (train.shared_prompt_forward = false) grpokit takes "
          f"{results[2]['s_per_step'] / results[0]['s_per_step']:.2f}x as long")


if __name__ == "__main__":
    if len(sys.argv) == 3:
        systems = {"grpokit": run_grpokit, "trl": run_trl,
                   "grpokit-unshared": lambda model: run_grpokit(model, shared_prompt_forward=False)}
        print(json.dumps(systems[sys.argv[1]](sys.argv[2])))
    else:
        main()
