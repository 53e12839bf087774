"""The visual demo's parts: `sft` on image rows (the pixels reach the forward), evaluation with images, and
`grpokit demo --task vision --quick` end to end from the CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import torch
from PIL import Image

from grpokit.demo_vision import encoded_rows, noisy_count_sampler
from grpokit.models.tiny_vision import build_tiny_vlm
from grpokit.sft import sft

COLORS = {"1": (220, 20, 20), "2": (20, 200, 20), "3": (20, 20, 220)}


def _rows():
    return [{"prompt": [{"role": "user", "content": "which?"}], "image": Image.new("RGB", (32, 32), color),
             "answer": answer} for answer, color in COLORS.items()]


def test_sft_on_image_rows_learns_what_only_the_pixels_tell():
    """The three prompts are the same text; only the image says the answer. After a short SFT each image's own
    answer is far likelier than the others: the pixels reached the forward (the ids alone cannot tell them)."""
    torch.manual_seed(0)
    model, processor = build_tiny_vlm(None, arch="qwen2_vl", hidden_size=32, num_layers=1, seed=0)
    rows = _rows()
    encoded = encoded_rows(processor, model.config, rows)
    assert encoded[0][0] == encoded[1][0] == encoded[2][0]  # identical prompt ids
    losses = sft(model, processor.tokenizer, noisy_count_sampler(rows, encoded, wrong_fraction=0.0, max_count=3),
                 steps=60, batch_size=12, learning_rate=1e-2, warmup_steps=5)
    assert losses[-1] < 0.2 * losses[0]
    digits = [processor.tokenizer.convert_tokens_to_ids(d) for d in COLORS]
    for (ids, media), row in zip(encoded, rows):
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                           **media.model_inputs(input_ids)).logits[0, -1]
        probs = logits[digits].softmax(-1)
        assert probs[int(row["answer"]) - 1] > 0.8, (row["answer"], probs)


def test_noisy_count_sampler_gives_another_count_as_often_as_asked():
    rows = [{"answer": "2"}] * 4
    sample = noisy_count_sampler(rows, [([1, 2], None)] * 4, wrong_fraction=0.3, max_count=3)
    rng = random.Random(0)
    targets = [sample(rng)[1] for _ in range(4000)]
    assert set(targets) == {"1", "2", "3"} and abs(targets.count("2") / 4000 - 0.7) < 0.03
    assert abs(targets.count("1") - targets.count("3")) / 4000 < 0.04  # the wrong counts evenly


def test_demo_vision_quick_runs_the_whole_pipeline(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "grpokit.cli", "demo", "--task", "vision", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for stage in ("before", "after"):
        assert 0.0 <= summary[stage]["accuracy"] <= 1.0 and "pass@8" in summary[stage]
        assert summary[stage]["num_prompts"] == 8
    assert (out / "sft" / "processor_config.json").is_file() and (out / "sft" / "model.safetensors").is_file()
    run = out / "grpo"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == summary["grpo_steps"]
    completions = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert completions and all(len(row["images"]) == 1 for row in completions)
    assert {p.stem for p in (run / "images").iterdir()} == {row["images"][0]["sha256"] for row in completions}
    assert "before GRPO" in r.stdout and "after GRPO" in r.stdout and "entropy per step" in r.stdout


def test_sft_until_loss_stops_early_and_is_checked():
    """`until_loss`: the steps are a cap once the mean loss of the last 20 steps is below it; a bad value is
    named before any step runs."""
    import pytest

    torch.manual_seed(0)
    model, processor = build_tiny_vlm(None, arch="qwen2_vl", hidden_size=32, num_layers=1, seed=0)
    rows = _rows()
    sample = noisy_count_sampler(rows, encoded_rows(processor, model.config, rows), wrong_fraction=0.0, max_count=3)
    losses = sft(model, processor.tokenizer, sample, steps=400, batch_size=12, learning_rate=1e-2, warmup_steps=5,
                 until_loss=0.3, decay=False)
    assert 20 <= len(losses) < 400 and sum(losses[-20:]) / 20 < 0.3
    for bad in (0, -1.0, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="until_loss must be a finite number > 0"):
            sft(model, processor.tokenizer, sample, steps=1, until_loss=bad)

