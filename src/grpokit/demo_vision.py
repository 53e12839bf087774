"""`grpokit demo --task vision`: GRPO teaches a tiny vision-language model to count shapes in an image.

1. Build a tiny Qwen2-VL (a ViT over 4x4-pixel patches, multimodal RoPE, a 2-layer decoder) and its
   processor locally — nothing comes from a hub.
2. Warm-start it with `sft` on the built-in `shapes` task ("How many red shapes?" over a 32x32 image
   drawn with Pillow, shapes of three other colours as distractors): first on the true counts until the
   model has learned to look (its loss below `SFT["until_loss"]`), then with half the targets
   deliberately another count: it learns not to commit to what it sees, so the right count is often
   among its samples (pass@k high) yet a single sample is right much less often (pass@1 low).
3. Evaluate on held-out scenes, run GRPO with the task's exact-match reward (the vision tower frozen,
   as a run is by default), evaluate again with the same sampling settings, and print before / after.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

# Demo settings, chosen on a 2-core CPU (see docs/VISION.md "The demo" for the measured run and the tries).
MODEL = dict(arch="qwen2_vl", hidden_size=128, num_layers=2)


# One colour asked (the others are distractors): with questions about all four, binding the colour word to the
# image took this model 500 to over 1600 steps depending on the seed (docs/VISION.md); with one, under 700.
TASK = dict(name="shapes", max_count=3, grid=4, image_size=32, asked=["red"])


# Two stages: clean targets first (the tries in docs/VISION.md: with a share of wrong targets from the start the
# model never learned to look, its loss stayed at ln 3 / 2) until the loss (mean of 20 steps) is below
# `until_loss`, at a constant rate; then half the targets another count. Learning to look is abrupt and when it
# comes varies with the initialisation (under 300 steps on most, never in 1000 on some): a clean stage still on
# its plateau after `clean_steps` starts again from a fresh random initialisation, up to `attempts` in all.
SFT = dict(clean_steps=400, attempts=5, until_loss=0.1, noisy_steps=200, batch_size=64, learning_rate=3e-3,
           noisy_learning_rate=1e-3, wrong_fraction=0.5)


GRPO = dict(steps=120, prompts_per_step=16, group_size=8, learning_rate=3e-4, max_new_tokens=2)


EVAL = dict(num_prompts=200, samples_per_prompt=8, temperature=1.0)


QUICK = dict(sft_steps=5, grpo_steps=2, eval_prompts=8, train_rows=64)


TRAIN_ROWS = 2000


THREADS = 1  # torch CPU threads: this model's matmuls are too small to split; on a loaded 2-core machine two
# threads made an SFT step about 10x slower (1.3 s instead of 0.1)


def encoded_rows(processor, model_config, rows):
    """Each row's (prompt ids with its image tokens, one-row `RowMedia`), encoded once by the processor as a run
    encodes a step's prompts (training/vision_setup.PromptMedia)."""
    from grpokit.models.media import RowMedia
    from grpokit.models.vision import vision_family
    from grpokit.training.vision_setup import PromptMedia, VisionInputs

    family = vision_family(model_config)
    media = PromptMedia(VisionInputs(family, True, model_config, None, processor), rows)
    encoded = [media.encode(i) for i in range(len(rows))]
    return [(ids, RowMedia(family, (images,), int(model_config.image_token_id))) for ids, images in encoded]


def noisy_count_sampler(rows, encoded, *, wrong_fraction: float, max_count: int):
    """(prompt ids, target, images) triples for `sft`: `wrong_fraction` of the targets are another count."""

    def sample(rng: random.Random):
        i = rng.randrange(len(rows))
        target = int(rows[i]["answer"])
        if rng.random() < wrong_fraction:
            target = rng.choice([c for c in range(1, max_count + 1) if c != target])
        ids, media = encoded[i]
        return ids, str(target), media

    return sample


def run_vision_demo(out: str | Path = "demo_vision_run", *, quick: bool = False, seed: int = 0) -> dict:
    import torch
    from rich.console import Console

    from grpokit.demo import prepare_demo_folder

    console = Console()
    out = prepare_demo_folder(out)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return _run(console, out, quick, seed)
    finally:
        torch.set_num_threads(threads)


def _run(console, out: Path, quick: bool, seed: int) -> dict:
    """The demo's five phases (module docstring), each printed under its own rule; the summary it writes."""
    from grpokit.evaluate import evaluate
    from grpokit.models.media import RowMedia
    from grpokit.models.vision import save_processor
    from grpokit.tasks import get_task

    started = time.perf_counter()
    task_args = {k: v for k, v in TASK.items() if k != "name"}
    task = get_task(TASK["name"], **task_args)
    held_out = task.generate(QUICK["eval_prompts"] if quick else EVAL["num_prompts"], seed=seed, split="eval")
    train_rows = task.generate(QUICK["train_rows"] if quick else TRAIN_ROWS, seed=seed, split="train")
    specs = task.reward_functions()

    console.rule("[bold]1. tiny Qwen2-VL + processor, built locally")
    model, processor = _tiny_vlm(out / "base", seed)
    encoded = encoded_rows(processor, model.config, train_rows)
    console.print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; a prompt is "
                  f"{len(encoded[0][0])} tokens, {encoded[0][0].count(int(model.config.image_token_id))} of them "
                  "for the image")

    console.rule("[bold]2. supervised warm start: learn to look, then half the targets another count")
    model = _warm_start(console, model, processor.tokenizer, train_rows, encoded, quick=quick, seed=seed)
    model.save_pretrained(out / "sft")
    save_processor(processor, out / "sft")

    held = encoded_rows(processor, model.config, held_out)
    ids = [i for i, _ in held]
    media = RowMedia.concat([m for _, m in held], [1] * len(held))
    eval_kwargs = dict(samples_per_prompt=EVAL["samples_per_prompt"], temperature=EVAL["temperature"],
                       max_new_tokens=GRPO["max_new_tokens"], seed=seed, media=media)
    console.rule("[bold]3. held-out evaluation before GRPO")
    before = evaluate(model, processor.tokenizer, held_out, ids, specs, **eval_kwargs)
    console.print(before)

    console.rule("[bold]4. GRPO (the vision tower frozen)")
    config, run_dir, model, tokenizer = _grpo(out, task_args, train_rows, quick=quick, seed=seed)

    console.rule("[bold]5. held-out evaluation after GRPO (same sampling settings)")
    after = evaluate(model, tokenizer, held_out, ids, specs, **eval_kwargs)
    return _show_results(console, out, before, after, started, config, run_dir)


def _tiny_vlm(folder: Path | None, seed: int):
    """A freshly initialised tiny Qwen2-VL (`MODEL`) for `TASK`'s images, and its processor; saved to `folder`."""
    from grpokit.models.tiny_vision import build_tiny_vlm

    return build_tiny_vlm(folder, arch=MODEL["arch"], hidden_size=MODEL["hidden_size"],
                          num_layers=MODEL["num_layers"], image_size=TASK["image_size"], seed=seed)


def _warm_start(console, model, tokenizer, train_rows: list[dict], encoded, *, quick: bool, seed: int):
    """Phase 2: the clean SFT stage (from a fresh initialisation where the last never learned to look, up to
    `SFT["attempts"]`), then the noisy one; the model that went through them (maybe not `model`)."""
    from grpokit.sft import sft

    def stage(name: str, wrong: float, steps: int) -> float:
        """One SFT stage; its mean loss over the last 20 steps (the clean stage's goal: below `until_loss`)."""
        sample = noisy_count_sampler(train_rows, encoded, wrong_fraction=wrong, max_count=TASK["max_count"])
        losses = sft(model, tokenizer, sample, steps=steps, batch_size=SFT["batch_size"],
                     learning_rate=SFT["learning_rate" if name == "clean" else "noisy_learning_rate"],
                     warmup_steps=min(50, steps), seed=seed,
                     until_loss=SFT["until_loss"] if name == "clean" else None, decay=name != "clean",
                     on_step=lambda s, loss: console.print(
                         f"  sft ({name} targets) step {s}/{steps}  loss {loss:.3f}") if s % 200 == 0 else None)
        mean = sum(losses[-20:]) / len(losses[-20:])
        console.print(f"  sft ({name} targets): {len(losses)} steps, mean loss of the last 20 {mean:.3f}")
        return mean

    for attempt in range(1, SFT["attempts"] + 1):  # a fresh initialisation where the last never learned to look
        loss = stage("clean", 0.0, QUICK["sft_steps"] if quick else SFT["clean_steps"])
        if loss < SFT["until_loss"] or quick:
            break
        if attempt < SFT["attempts"]:
            console.print(f"  the loss is still {loss:.2f}, above {SFT['until_loss']} (the model does not look yet): "
                          f"a fresh random initialisation, attempt {attempt + 1} of {SFT['attempts']}")
            model = _tiny_vlm(None, seed + 1000 * attempt)[0]
    stage("noisy", SFT["wrong_fraction"], QUICK["sft_steps"] if quick else SFT["noisy_steps"])
    return model


def _grpo(out: Path, task_args: dict, train_rows: list[dict], *, quick: bool, seed: int):
    """Phase 4: GRPO from the warm-started model in `out / "sft"` (the vision tower frozen, as a run is by
    default); its config, run folder, and the last checkpoint's model and tokenizer."""
    from grpokit.config.schema import (
        AlgorithmConfig,
        Config,
        DataConfig,
        ModelConfig,
        OutputConfig,
        RolloutConfig,
        TrainConfig,
    )
    from grpokit.models.vision import load_processor
    from grpokit.training.checkpoint import list_checkpoints
    from grpokit.training.loop import train
    from grpokit.training.vision_setup import load_vision_model

    config = Config(
        model=ModelConfig(path=str(out / "sft")),
        data=DataConfig(task=TASK["name"], task_args=task_args, seed=seed),
        rollout=RolloutConfig(group_size=GRPO["group_size"], max_new_tokens=GRPO["max_new_tokens"], temperature=1.0),
        algorithm=AlgorithmConfig(loss_type="dapo", beta=0.0),
        train=TrainConfig(steps=QUICK["grpo_steps"] if quick else GRPO["steps"],
                          prompts_per_step=GRPO["prompts_per_step"],
                          learning_rate=GRPO["learning_rate"], warmup_steps=5, seed=seed, num_threads=THREADS),
        output=OutputConfig(dir=str(out / "grpo"), overwrite=True, completions_every=1 if quick else 25),
    )
    run_dir = train(config, rows=train_rows)
    final = list_checkpoints(run_dir)[-1]
    return config, run_dir, load_vision_model(str(final)), load_processor(final).tokenizer


def _show_results(console, out: Path, before: dict, after: dict, started: float, config, run_dir: Path) -> dict:
    """Phase 5's table: before / after, the reward and entropy curves; the summary written to `out`."""
    from grpokit.demo import before_after, sparkline, write_summary
    from grpokit.observe.tracking import read_metrics

    metrics = read_metrics(run_dir)
    summary = write_summary(out, before, after, started, config.train.steps, run_dir)
    k = EVAL["samples_per_prompt"]
    console.print(before_after("held-out shapes (how many red shapes?), sampled at temperature 1.0",
                               before, after, [("accuracy", "sampled accuracy (pass@1)"), (f"pass@{k}", f"pass@{k}"),
                                               ("greedy_accuracy", "greedy_accuracy")]))
    console.print(f"reward  per step: {sparkline([m['reward'] for m in metrics])}")
    console.print(f"entropy per step: {sparkline([m['entropy'] for m in metrics])}")
    console.print(f"demo finished in {summary['seconds']:.0f} s; metrics: {run_dir / 'metrics.jsonl'}; "
                  f"HTML report (with the images): grpokit report {run_dir}")
    return summary
