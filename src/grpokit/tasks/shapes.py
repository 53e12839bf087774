"""Counting shapes: a small image with coloured squares and discs, "How many red shapes?" -> "2".

A visual task for vision-language models that a CPU can learn: the image is drawn locally with
Pillow (nothing is downloaded), `image_size` pixels square, on a `grid` x `grid` board with one
shape at most per cell; 1 .. `max_count` shapes have the asked colour and up to `max_count` have
others. `asked` names the colours a question may ask about (all four by default; the others
still appear as distractors). The prompt is conversational (one user turn; the image goes before its text as TRL's
`prepare_multimodal_messages` puts it), the image is the row's `image` column, and the verifier
is an exact match of the stripped completion with the count: 1.0 or 0.0.

The train / eval split hashes the scene (the colour asked and every cell's shape), not the
prompt text, which only names the colour.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Collection

from grpokit.rewards.core import RewardSpec
from grpokit.rewards.verifiers import addition_reward
from grpokit.tasks.base import check_split, in_split

COLORS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("square", "disc")


def draw_scene(cells: dict[tuple[int, int], tuple[str, str]], *, grid: int, image_size: int):
    """A white RGB image with one shape (colour name, kind) per occupied (row, column) cell."""
    from PIL import Image, ImageDraw  # Pillow: only the vision task needs it

    image = Image.new("RGB", (image_size, image_size), (255, 255, 255))
    draw, cell = ImageDraw.Draw(image), image_size / grid
    for (r, c), (color, kind) in cells.items():
        box = (c * cell + 1, r * cell + 1, (c + 1) * cell - 2, (r + 1) * cell - 2)
        (draw.rectangle if kind == "square" else draw.ellipse)(box, fill=COLORS[color])
    return image


@dataclass(frozen=True)
class ShapeCountTask:
    max_count: int = 3
    grid: int = 3
    image_size: int = 32
    eval_fraction: float = 0.1
    asked: tuple[str, ...] = tuple(sorted(COLORS))  # the colours questions ask about; all appear in the images
    name: ClassVar[str] = "shapes"

    def __post_init__(self):
        for key, low in (("max_count", 1), ("grid", 2), ("image_size", 8)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"shapes: {key} must be an integer >= {low}, got {value!r}")
        if 2 * self.max_count > self.grid * self.grid:
            raise ValueError(f"shapes: max_count = {self.max_count} needs {2 * self.max_count} cells, the "
                             f"{self.grid}x{self.grid} grid has {self.grid * self.grid}; raise grid or lower max_count")
        check_split("eval", self.eval_fraction)
        asked = (self.asked,) if isinstance(self.asked, str) else self.asked
        if not isinstance(asked, (list, tuple)) or not asked or any(not isinstance(c, str) or c not in COLORS
                                                                     for c in asked):
            raise ValueError(f"shapes: asked must be a non-empty list of colours among {', '.join(sorted(COLORS))}, "
                             f"got {self.asked!r}")
        object.__setattr__(self, "asked", tuple(sorted(set(asked))))  # a TOML list arrives as a list

    def _scene(self, rng: random.Random) -> tuple[str, dict]:
        color = rng.choice(self.asked)
        count, others = rng.randint(1, self.max_count), rng.randint(0, self.max_count)
        cells = rng.sample([(r, c) for r in range(self.grid) for c in range(self.grid)], count + others)
        other_colors = [c for c in sorted(COLORS) if c != color]
        return color, {cell: (color if i < count else rng.choice(other_colors), rng.choice(SHAPES))
                       for i, cell in enumerate(cells)}

    def generate(self, n: int, seed: int, *, split: str | None = None, exclude: Collection[str] = ()) -> list[dict]:
        """`n` rows: prompt (messages), image (PIL), answer (the count as text), scene (the split's key)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"shapes: n must be a non-negative integer, got {n!r}")
        check_split(split, self.eval_fraction)
        rng, rows, budget, skip = random.Random(f"{self.name}:{seed}"), [], 100 * n + 1000, set(exclude)
        while len(rows) < n and budget > 0:
            budget -= 1
            color, cells = self._scene(rng)
            key = color + ":" + ";".join(f"{r}{c}{v[0][0]}{v[1][0]}" for (r, c), v in sorted(cells.items()))
            if key in skip or not in_split(key, split, self.eval_fraction):
                continue
            rows.append({"prompt": [{"role": "user", "content": f"How many {color} shapes?"}],
                         "image": draw_scene(cells, grid=self.grid, image_size=self.image_size),
                         "answer": str(sum(1 for v in cells.values() if v[0] == color)), "scene": key})
        if len(rows) < n:
            raise ValueError(f"shapes: found only {len(rows)} of {n} scenes in split {split!r}; raise grid or "
                             "max_count, or ask for fewer rows")
        return rows

    def reward_functions(self) -> list[RewardSpec]:
        return [RewardSpec(self.name, addition_reward)]  # exact match of the stripped completion with the count

    def is_correct(self, completion: str, row: dict) -> bool:
        return addition_reward([completion], [row["answer"]])[0] == 1.0

    def sft_target(self, row: dict, rng: random.Random | None = None) -> str:
        return str(row["answer"])
