"""The built-in visual task: images drawn locally, an exact verifier, and a tiny VLM trained on it."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from conftest import make_config
from grpokit import train
from grpokit.errors import TaskError
from grpokit.models.tiny_vision import build_tiny_vlm
from grpokit.tasks import get_task
from grpokit.tasks.shapes import COLORS, draw_scene


def test_the_image_shows_the_answer():
    """Counting the asked colour's pixels blob by blob recovers the row's answer (the picture is the truth)."""
    task = get_task("shapes", max_count=3, grid=3, image_size=48)
    for row in task.generate(30, seed=0):
        color = row["prompt"][0]["content"].split()[2]
        image, cell = row["image"], 48 // 3
        assert isinstance(image, Image.Image) and image.size == (48, 48)
        centres = [image.getpixel((c * cell + cell // 2, r * cell + cell // 2)) for r in range(3) for c in range(3)]
        assert str(sum(1 for p in centres if p == COLORS[color])) == row["answer"]
        assert 1 <= int(row["answer"]) <= 3


def test_rows_are_deterministic_and_the_splits_disjoint():
    task = get_task("shapes")
    a, b = task.generate(20, seed=3, split="train"), task.generate(20, seed=3, split="train")
    assert [r["scene"] for r in a] == [r["scene"] for r in b]
    assert a[0]["image"].tobytes() == b[0]["image"].tobytes()
    held_out = task.generate(20, seed=3, split="eval")
    assert not {r["scene"] for r in a} & {r["scene"] for r in held_out}


def test_the_verifier_is_an_exact_match():
    task = get_task("shapes")
    row = {"answer": "2"}
    assert task.is_correct(" 2 ", row) and not task.is_correct("2 shapes", row) and not task.is_correct("3", row)
    (spec,) = task.reward_functions()
    completions = [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "1"}]]
    assert spec.fn(completions, answer=["2", "2"]) == [1.0, 0.0]


def test_bad_arguments_are_named():
    with pytest.raises(TaskError, match="max_count = 5 needs 10 cells"):
        get_task("shapes", max_count=5, grid=3)
    with pytest.raises(TaskError, match="image_size must be an integer >= 8"):
        get_task("shapes", image_size=4)
    for asked in (["pink"], [], [["red"]], "", 3):
        with pytest.raises(TaskError, match="asked must be a non-empty list of colours among blue, green, red, yellow"):
            get_task("shapes", asked=asked)


def test_asked_colours_are_the_only_questions_and_the_others_stay_as_distractors():
    rows = get_task("shapes", asked=["red"], grid=4).generate(200, seed=0, split="train")
    assert {r["prompt"][0]["content"] for r in rows} == {"How many red shapes?"}
    cells = [cell for r in rows for cell in r["scene"].split(":")[1].split(";")]  # "<row><col><colour><shape>"
    assert {cell[2] for cell in cells} == {"r", "g", "b", "y"}  # every colour still drawn: the others distract
    default = get_task("shapes", grid=4).generate(50, seed=0, split="train")
    assert len({r["prompt"][0]["content"] for r in default}) == 4  # all four colours asked by default
    assert default == get_task("shapes", grid=4, asked=sorted(COLORS)).generate(50, seed=0, split="train")


def test_draw_scene_places_shapes_in_their_cells():
    image = draw_scene({(0, 1): ("red", "square")}, grid=2, image_size=20)
    assert image.getpixel((15, 5)) == COLORS["red"] and image.getpixel((5, 15)) == (255, 255, 255)


def test_a_tiny_vlm_trains_on_the_task(tmp_path):
    build_tiny_vlm(tmp_path / "vl", arch="qwen2_vl", hidden_size=32, num_layers=1)
    config = make_config(tmp_path / "vl", tmp_path / "run", steps=2, num_prompts=16, prompts_per_step=2,
                         max_new_tokens=2)
    from dataclasses import replace

    config = replace(config, data=replace(config.data, task="shapes"))
    run = train(config)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "rewards/shapes/mean" in rows[0]
