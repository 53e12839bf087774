"""A text gridworld: walk from a start cell to a goal cell with a `move(direction)` tool.

    "from 0,1 to 2,3: right up" -> move("right") -> "1,1: right up", move("up") -> "1,2: right up", ...,
                                   move("right") -> "2,3: goal", then a final answer ("done")

A multi-step task where credit per turn matters. Every answer to a prompt starts in the same cell and
the grid is small, so the G answers of a group meet the same cells again and again (GiGPO's step groups
are large), and each move has a step reward that says whether it helped: progress toward the goal,
`distance before - distance after` in Manhattan distance (+1 a good move, -1 a step away, 0 a bump into
the wall or a direction that is not one). The outcome is 1.0 when the walk ends on the goal, else 0.0:
a walk with detours that still arrives scores as much as a direct one, and one that wastes its moves
(`tools.max_calls`) does not arrive, which is what outcome-only GRPO cannot tell apart turn by turn.

Coordinates are "x,y": `right` is x + 1, `left` x - 1, `up` y + 1, `down` y - 1, both from 0 to size - 1.
The prompt and every move's result name the cell and the directions that lead closer ("goal" on it): a
tiny character model learns to read them in a short warm start, where computing them from two cells
would take far longer; what is left to learn is to follow them instead of its noisy habits.

The task brings its environment (`GridWorld`, TRL's `environment_factory` form): a run with `data.task =
"gridworld"` and no tools or environment of its own gets it. The outcome reward is the environment's
`get_reward()`, so the task adds no reward function of its own (it would count the outcome twice);
`walk` and `reaches_goal` are the exact verifier it calls, pure functions of the row and the moves.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import ClassVar, Collection

from grpokit.rewards.core import RewardSpec
from grpokit.tasks.base import check_split, sample_rows

STEPS = {"right": (1, 0), "left": (-1, 0), "up": (0, 1), "down": (0, -1)}
_PROMPT = re.compile(r"from (\d+),(\d+) to (\d+),(\d+)(?:: [a-z ]+)?")


def parse_prompt(prompt: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(start, goal) of a gridworld prompt, "from 0,1 to 2,3: right up"; ValueError for anything else."""
    found = _PROMPT.fullmatch(str(prompt).strip())
    if found is None:
        raise ValueError(f"gridworld: a prompt reads \"from X,Y to X,Y\", got {prompt!r}")
    x0, y0, x1, y1 = (int(v) for v in found.groups())
    return (x0, y0), (x1, y1)


def step(position: tuple[int, int], direction: str, size: int) -> tuple[int, int]:
    """The cell one move from `position`; the same cell at the wall. ValueError for an unknown direction."""
    if direction not in STEPS:
        raise ValueError(f"unknown direction {direction!r}; use one of: {', '.join(STEPS)}")
    dx, dy = STEPS[direction]
    x, y = position[0] + dx, position[1] + dy
    return (x, y) if 0 <= x < size and 0 <= y < size else position


def distance(a: tuple[int, int], b: tuple[int, int]) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def walk(start: tuple[int, int], moves: list[str], size: int) -> list[tuple[int, int]]:
    """Every cell the walk visits, `start` first; unknown directions stay in place (as the tool's error does)."""
    cells = [start]
    for direction in moves:
        cells.append(step(cells[-1], direction, size) if direction in STEPS else cells[-1])
    return cells


def reaches_goal(row: dict, moves: list[str], size: int) -> bool:
    """The exact verifier: the walk of `moves` from the row's start ends on its goal."""
    start, goal = parse_prompt(row["prompt"])
    return walk(start, moves, size)[-1] == goal


def cell_text(position: tuple[int, int]) -> str:
    return f"{position[0]},{position[1]}"


def observation(position: tuple[int, int], goal: tuple[int, int]) -> str:
    """What the agent sees of a cell: "1,1: right up" (the directions that lead closer), "2,3: goal"."""
    closer = [d for d, (dx, dy) in STEPS.items() if distance((position[0] + dx, position[1] + dy), goal)
              < distance(position, goal)]
    return f"{cell_text(position)}: {' '.join(closer) or 'goal'}"


class GridWorld:
    """One walk (TRL's `environment_factory` form): `reset` with the row, the `move` tool, the outcome
    `get_reward`, and grpokit's `get_state` (the cell) and `get_turn_reward` (the turn's progress)."""

    size = 4  # the task's default grid; GridWorldTask.environment() gives a class with its own size

    def reset(self, **row) -> None:
        self.start, self.goal = parse_prompt(row["prompt"])
        self.position, self.moves = self.start, []
        self._distance_at_turn_start = distance(self.start, self.goal)

    def move(self, direction: str) -> str:
        """Move one cell on the grid.

        Args:
            direction: right (x + 1), left (x - 1), up (y + 1) or down (y - 1).
        """
        self.moves.append(direction)
        self.position = step(self.position, direction, self.size)  # raises for an unknown direction
        return observation(self.position, self.goal)

    def get_turn_reward(self) -> float:
        """Progress toward the goal over the turn's moves (the Manhattan distance it removed)."""
        now = distance(self.position, self.goal)
        progress, self._distance_at_turn_start = self._distance_at_turn_start - now, now
        return float(progress)

    def get_state(self) -> tuple[int, int]:
        return self.position

    def get_reward(self) -> float:
        return float(reaches_goal({"prompt": f"from {cell_text(self.start)} to {cell_text(self.goal)}"},
                                  self.moves, self.size))


@dataclass(frozen=True)
class GridWorldTask:
    size: int = 4
    min_distance: int = 2  # start and goal this many moves apart at least (1 would be a one-step task)
    max_distance: int = 4
    eval_fraction: float = 0.2  # share of the (small) prompt space reserved for split="eval"
    name: ClassVar[str] = "gridworld"

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 2 <= self.size <= 9:
            raise ValueError(f"gridworld: size must be an integer from 2 to 9, got {self.size!r}")
        longest = 2 * (self.size - 1)
        for field, value in (("min_distance", self.min_distance), ("max_distance", self.max_distance)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= longest:
                raise ValueError(f"gridworld: {field} must be an integer from 1 to {longest} on a grid of size "
                                 f"{self.size}, got {value!r}")
        if self.min_distance > self.max_distance:
            raise ValueError(f"gridworld: min_distance ({self.min_distance}) must not exceed max_distance "
                             f"({self.max_distance})")
        check_split("eval", self.eval_fraction)

    def _row(self, rng: random.Random) -> dict:
        while True:
            start, goal = [(rng.randrange(self.size), rng.randrange(self.size)) for _ in range(2)]
            if self.min_distance <= distance(start, goal) <= self.max_distance:
                hint = observation(start, goal).partition(": ")[2]
                return {"prompt": f"from {cell_text(start)} to {cell_text(goal)}: {hint}", "answer": "done"}

    def generate(self, n: int, seed: int, *, split: str | None = None,
                 exclude: Collection[str] = ()) -> list[dict]:
        return sample_rows(self._row, n, seed, split=split, eval_fraction=self.eval_fraction,
                           exclude=exclude, task=self.name)

    def reward_functions(self) -> list[RewardSpec]:
        return []  # the outcome is the environment's get_reward (reaches_goal on its moves)

    def environment(self) -> type:
        """`GridWorld` on this task's grid: the environment class a run with this task gets."""
        return GridWorld if self.size == GridWorld.size else type("GridWorld", (GridWorld,), {"size": self.size})

    def is_correct(self, completion, row: dict) -> bool:
        """Whether a conversation (the rollout's messages) ends on the goal: its last `move` result is the goal
        cell ("2,3: goal"), or the start is the goal and it never moved."""
        start, goal = parse_prompt(row["prompt"])
        cells = [m.get("content") for m in (completion if isinstance(completion, list) else [])
                 if isinstance(m, dict) and m.get("role") == "tool" and m.get("name") == "move"]
        return str(cells[-1]).partition(":")[0] == cell_text(goal) if cells else start == goal

    def sft_target(self, row: dict, rng: random.Random | None = None) -> str:
        return "done"  # the final answer; the moves are tool calls (`tool_trace`)

    def tool_trace(self, row: dict, rng: random.Random, *, wrong_move: float = 0.0,
                   max_moves: int | None = None) -> tuple[list[dict], str]:
        """A warm-start walk for `row`: (assistant/tool messages, final answer "done").

        Each move heads toward the goal (along x or y at random) except, with probability `wrong_move`,
        a random other direction; the walk stops at the goal or after `max_moves` moves (then it has not
        arrived: the answer is still "done", and wrong)."""
        start, goal = parse_prompt(row["prompt"])
        position, messages = start, []
        limit = max_moves if max_moves is not None else 4 * self.size
        while position != goal and len(messages) // 2 < limit:
            useful = [d for d in STEPS if distance(step(position, d, self.size), goal) < distance(position, goal)]
            direction = rng.choice(useful)
            if rng.random() < wrong_move:
                direction = rng.choice([d for d in STEPS if d not in useful])
            position = step(position, direction, self.size)
            call = {"type": "function", "function": {"name": "move", "arguments": {"direction": direction}}}
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "name": "move", "content": observation(position, goal)}]
        return messages, "done"
