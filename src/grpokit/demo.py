"""`grpokit demo`: the real GRPO loop on a laptop CPU in minutes.

1. Build a tiny Qwen2-architecture model and a character tokenizer locally —
   nothing comes from a hub.
2. Warm-start it with `sft` on 2-digit addition, written so a small model
   learns it quickly: operands zero-padded, the sum least-significant digit
   first ("07+45=" -> "250", i.e. 052). First clean targets (the model finds
   the digit sums), then targets of which a share is deliberately off by a
   little. The model learns where the answer lives but not to commit to it:
   the right answer is often among its samples (pass@8 high) yet any single
   sample is right much less often (pass@1 low). That is the regime GRPO is
   for: it turns pass@k into pass@1.
3. Evaluate on held-out prompts, run GRPO with the task's exact-match reward,
   evaluate again with the same sampling settings, and print before / after
   with the reward and entropy curves.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

# Demo settings, chosen on a 2-core CPU (see README "The demo" for the measured run).
MODEL = dict(hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=2)


TASK = dict(name="addition", digits=2, zero_pad=True, reverse_answer=True)


# two schedules: correct targets (the model finds the digit sums), then targets of which wrong_fraction are off
SFT = dict(batch_size=64, phases=(dict(targets="clean", steps=2000, learning_rate=3e-3, wrong_fraction=0.0),
                                  dict(targets="noisy", steps=400, learning_rate=3e-3, wrong_fraction=0.7)))


GRPO = dict(steps=400, prompts_per_step=16, group_size=8, learning_rate=5e-4, max_new_tokens=6)


EVAL = dict(num_prompts=200, samples_per_prompt=8, temperature=1.0)


QUICK = dict(sft_steps=60, grpo_steps=4, eval_prompts=16)


def noisy_pair_sampler(task, rows, wrong_fraction: float):
    """(prompt, target) pairs where `wrong_fraction` of the targets are off by a small amount."""

    def sample(rng: random.Random) -> tuple[str, str]:
        row = rng.choice(rows)
        if rng.random() < wrong_fraction:
            return row["prompt"], task.render_sum(max(0, task.total(row) + rng.choice([-2, -1, 1, 2, 10, -10])))
        return row["prompt"], task.sft_target(row, rng)

    return sample


def sparkline(values: list[float]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    values = [v for v in values if v is not None]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    step = max(1, -(-len(values) // 40))  # at most 40 bars: fits an 80-column terminal
    picked = [sum(values[i:i + step]) / len(values[i:i + step]) for i in range(0, len(values), step)]
    line = "".join(bars[int((v - lo) / (hi - lo + 1e-12) * (len(bars) - 1))] for v in picked)
    return line + f"  ({lo:.3f} → {hi:.3f})"


def before_after(title: str, before: dict, after: dict, rows: list[tuple[str, str]]):
    """A demo's before / after table: one row per (result key, label)."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("before GRPO", justify="right")
    table.add_column("after GRPO", justify="right")
    for key, label in rows:
        table.add_row(label, f"{before[key]:.3f}", f"{after[key]:.3f}")
    return table


def write_summary(out: Path, before: dict, after: dict, started: float, grpo_steps: int, run_dir: Path) -> dict:
    """summary.json: both evaluations, the wall time and where the run is."""
    summary = {"before": before, "after": after, "seconds": time.perf_counter() - started,
               "grpo_steps": grpo_steps, "run_dir": str(run_dir)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


DEMO_FILES = ("base", "sft", "grpo", "summary.json")  # what a demo writes into --out (a rerun replaces them)


def prepare_demo_folder(out: str | Path, flag: str = "--out") -> Path:
    """`out`, created: new, empty, or an earlier demo run's (what a rerun replaces); anything else (a file, a
    model folder, a project) is refused before the demo writes a byte."""
    from grpokit.errors import ConfigError

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {str(out)!r} is a file; the demo writes a folder ({', '.join(DEMO_FILES)}): give "
                          "a new folder path")
    others = sorted(p.name for p in out.iterdir() if p.name not in DEMO_FILES) if out.is_dir() else []
    if others:
        listed = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise ConfigError(f"{flag} {str(out)!r} holds files that are not an earlier demo run's ({listed}); the demo "
                          f"writes {', '.join(DEMO_FILES)} there: give a new or empty folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {str(out)!r} cannot be created ({e.strerror}); choose another folder") from None
    return out


def run_demo(out: str | Path = "demo_run", *, quick: bool = False, seed: int = 0,
             rollout: dict | None = None) -> dict:
    from rich.console import Console

    from grpokit.config.schema import (
        AlgorithmConfig,
        Config,
        DataConfig,
        ModelConfig,
        OutputConfig,
        RolloutConfig,
        TrainConfig,
    )
    from grpokit.evaluate import EvalSettings, SamplingParams, evaluate
    from grpokit.models.loading import load_model_and_tokenizer
    from grpokit.models.tiny import build_tiny_model
    from grpokit.observe.tracking import read_metrics
    from grpokit.sft import sft
    from grpokit.tasks import get_task
    from grpokit.training.checkpoint import list_checkpoints
    from grpokit.training.loop import train

    console = Console()
    out = prepare_demo_folder(out)
    started = time.perf_counter()
    task_args = {k: v for k, v in TASK.items() if k != "name"}
    task = get_task(TASK["name"], **task_args)
    held_out = task.generate(QUICK["eval_prompts"] if quick else EVAL["num_prompts"], seed=seed, split="eval")
    train_rows = task.generate(5000, seed=seed, split="train")  # disjoint from the held-out prompts
    specs = task.reward_functions()

    console.rule("[bold]1. tiny Qwen2 model + character tokenizer, built locally")
    build_tiny_model(out / "base", **MODEL, seed=seed)
    model, tokenizer = load_model_and_tokenizer(out / "base")
    console.print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}")

    console.rule("[bold]2. supervised warm start (some targets deliberately off by a little)")
    for i, phase in enumerate(SFT["phases"]):  # a schedule each: the second restarts the learning rate
        steps = QUICK["sft_steps"] if quick else phase["steps"]
        sft(model, tokenizer, noisy_pair_sampler(task, train_rows, phase["wrong_fraction"]), steps=steps,
            batch_size=SFT["batch_size"], learning_rate=phase["learning_rate"], seed=seed + i,
            warmup_steps=50 if i == 0 else 10,
            on_step=lambda s, loss, name=phase["targets"], steps=steps: console.print(
                f"  sft ({name} targets) step {s}/{steps}  loss {loss:.3f}") if s % max(1, steps // 4) == 0 else None)
    model.save_pretrained(out / "sft")
    tokenizer.save_pretrained(out / "sft")

    ids = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in held_out]
    settings = EvalSettings(SamplingParams(GRPO["max_new_tokens"], pad_token_id=tokenizer.pad_token_id,
                                           temperature=EVAL["temperature"]),
                            samples_per_prompt=EVAL["samples_per_prompt"], seed=seed)
    console.rule("[bold]3. held-out evaluation before GRPO")
    before = evaluate(model, tokenizer, held_out, ids, specs, settings)
    console.print(before)

    console.rule("[bold]4. GRPO")
    config = Config(
        model=ModelConfig(path=str(out / "sft")),
        data=DataConfig(task=TASK["name"], task_args=task_args, seed=seed),
        rollout=RolloutConfig(group_size=GRPO["group_size"], max_new_tokens=GRPO["max_new_tokens"], temperature=1.0,
                              **(rollout or {})),  # e.g. {"mode": "async"} (bench/async_rollout.py)
        algorithm=AlgorithmConfig(loss_type="dapo", beta=0.0),
        train=TrainConfig(steps=QUICK["grpo_steps"] if quick else GRPO["steps"],
                          prompts_per_step=GRPO["prompts_per_step"],
                          learning_rate=GRPO["learning_rate"], warmup_steps=10, seed=seed),
        output=OutputConfig(dir=str(out / "grpo"), overwrite=True, completions_every=50),
    )
    run_dir = train(config, rows=train_rows)
    final = list_checkpoints(run_dir)[-1]
    model, tokenizer = load_model_and_tokenizer(final)

    console.rule("[bold]5. held-out evaluation after GRPO (same sampling settings)")
    after = evaluate(model, tokenizer, held_out, ids, specs, settings)
    metrics = read_metrics(run_dir)
    summary = write_summary(out, before, after, started, config.train.steps, run_dir)
    k = EVAL["samples_per_prompt"]
    console.print(before_after("held-out addition, answers sampled at temperature 1.0", before, after,
                               [("accuracy", "sampled accuracy (pass@1)"), (f"pass@{k}", f"pass@{k}"),
                                ("greedy_accuracy", "greedy_accuracy"), ("mean_reward", "mean_reward")]))
    console.print(f"reward  per step: {sparkline([m['reward'] for m in metrics])}")
    console.print(f"entropy per step: {sparkline([m['entropy'] for m in metrics])}")
    console.print(f"demo finished in {summary['seconds']:.0f} s; metrics: {run_dir / 'metrics.jsonl'}; "
                  f"HTML report: grpokit report {run_dir}")
    return summary
