"""The gridworld task: its rules (moves, walls, states, step rewards), its exact verifier, the data's splits,
the warm-start traces, and a short run with per-turn credit (GiGPO) on it.

The hand-checked walks are on the default 4 x 4 grid: x grows to the right, y upward, both 0..3.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from conftest import make_config
from grpokit.errors import EnvironmentFault, TaskError
from grpokit.observe.tracking import read_metrics
from grpokit.rollout.engines import HFEngine
from grpokit.rollout.multiturn import sample_conversations
from grpokit.rollout.request import RolloutResult, SamplingParams
from grpokit.rollout.tools import ToolCall
from grpokit.tasks import TASKS, GridWorld, GridWorldTask, get_task, task_environment
from grpokit.tasks.gridworld import observation, parse_prompt, reaches_goal, walk
from grpokit.training.loop import train


def _env(prompt: str) -> GridWorld:
    env = GridWorld()
    env.reset(prompt=prompt, answer="done")
    return env


def test_moves_walls_states_and_step_rewards_by_hand():
    env = _env("from 0,1 to 2,3: right up")  # distance 4
    assert env.get_state() == (0, 1)
    assert env.move("right") == "1,1: right up" and env.get_state() == (1, 1)
    assert env.get_turn_reward() == 1.0  # 4 -> 3
    assert env.move("down") == "1,0: right up" and env.get_turn_reward() == -1.0  # 3 -> 4: a step away
    assert env.move("down") == "1,0: right up" and env.get_turn_reward() == 0.0  # the wall: no move, no progress
    assert env.move("left") == "0,0: right up" and env.get_turn_reward() == -1.0  # 4 -> 5
    assert env.get_reward() == 0.0
    for direction in ("up", "up", "up", "right"):  # two moves in one turn: the turn's progress is their sum
        env.move(direction)
    assert env.get_state() == (1, 3) and env.get_turn_reward() == 4.0  # 5 -> 1
    assert env.move("right") == "2,3: goal" and env.get_turn_reward() == 1.0 and env.get_reward() == 1.0
    assert env.move("up") == "2,3: goal" and env.get_reward() == 1.0  # the top wall: still on the goal
    assert env.move("left") == "1,3: right" and env.get_reward() == 0.0  # the outcome is where the walk ends
    assert _env("from 3,0 to 0,3").move("left") == "2,0: left up" and _env("from 3,3 to 3,1").move("up") == "3,3: down"


def test_an_unknown_direction_is_a_failed_call_that_stays_in_place():
    env = _env("from 3,3 to 1,2: left down")
    with pytest.raises(ValueError, match="unknown direction 'north'; use one of: right, left, up, down"):
        env.move("north")
    assert env.get_state() == (3, 3) and env.get_turn_reward() == 0.0
    assert walk((3, 3), ["north", "left"], 4) == [(3, 3), (3, 3), (2, 3)]  # the verifier replays it the same


def test_the_verifier_replays_the_moves_exactly():
    row = {"prompt": "from 0,0 to 2,1", "answer": "done"}
    assert walk((0, 0), ["right", "up", "right"], 4) == [(0, 0), (1, 0), (1, 1), (2, 1)]
    assert reaches_goal(row, ["right", "up", "right"], 4)
    assert reaches_goal(row, ["left", "up", "right", "right", "right", "left"], 4)  # a bump and a detour
    assert not reaches_goal(row, ["right", "up"], 4)  # stops short
    assert not reaches_goal(row, ["right", "right", "up", "right"], 4)  # walks past it
    assert reaches_goal({"prompt": "from 3,0 to 3,2"}, ["right", "up", "up"], 4)  # the wall at x = 3
    assert not reaches_goal({"prompt": "from 3,0 to 3,2"}, ["right", "up", "up"], 5)  # no wall there on 5 x 5
    task = GridWorldTask()
    conversation = [{"role": "assistant", "content": ""}, {"role": "tool", "name": "move", "content": "1,0: right up"},
                    {"role": "assistant", "content": ""}, {"role": "tool", "name": "move", "content": "2,1: goal"},
                    {"role": "assistant", "content": "done"}]
    assert task.is_correct(conversation, row) and not task.is_correct(conversation[:2] + conversation[-1:], row)
    assert not task.is_correct("done", row)  # no walk at all: still at the start
    assert parse_prompt("from 0,0 to 2,1: right up") == parse_prompt("from 0,0 to 2,1") == ((0, 0), (2, 1))
    with pytest.raises(ValueError, match=r"a prompt reads \"from X,Y to X,Y\", got '0,0 to 2,1'"):
        parse_prompt("0,0 to 2,1")


def test_the_data_has_disjoint_splits_within_the_distances_asked_for():
    task = get_task("gridworld", size=4, min_distance=2, max_distance=3)
    train_rows, eval_rows = task.generate(300, seed=0, split="train"), task.generate(40, seed=1, split="eval")
    assert {r["prompt"] for r in train_rows}.isdisjoint({r["prompt"] for r in eval_rows})
    for row in train_rows + eval_rows:
        start, goal = parse_prompt(row["prompt"])
        assert 2 <= abs(start[0] - goal[0]) + abs(start[1] - goal[1]) <= 3 and max(*start, *goal) <= 3
        assert row["prompt"].endswith(observation(start, goal).partition(":")[2])  # the directions that lead closer
    assert task.generate(5, seed=3, split="train") == task.generate(5, seed=3, split="train")
    assert TASKS["gridworld"] is GridWorldTask and task.reward_functions() == []  # the outcome: get_reward
    assert task_environment(task) is GridWorld and task_environment(get_task("addition")) is None
    assert task_environment(get_task("gridworld", size=6, max_distance=5))().size == 6


@pytest.mark.parametrize("kwargs, message", [
    ({"size": 1}, "gridworld: size must be an integer from 2 to 9, got 1"),
    ({"size": 3, "max_distance": 5}, "max_distance must be an integer from 1 to 4 on a grid of size 3, got 5"),
    ({"min_distance": 4, "max_distance": 3}, r"min_distance \(4\) must not exceed max_distance \(3\)"),
])
def test_bad_task_arguments_are_one_error_naming_the_argument(kwargs, message):
    with pytest.raises(TaskError, match=message):
        get_task("gridworld", **kwargs)


def test_warm_start_traces_walk_to_the_goal_with_some_wrong_moves():
    task, rng = GridWorldTask(), random.Random(0)
    rows = task.generate(200, seed=0, split="train")
    wrong = total = arrived = 0
    for row in rows:
        messages, answer = task.tool_trace(row, rng, wrong_move=0.3, max_moves=6)
        moves = [m["tool_calls"][0]["function"]["arguments"]["direction"] for m in messages[::2]]
        start, goal = parse_prompt(row["prompt"])
        cells = walk(start, moves, task.size)
        assert [m["content"] for m in messages[1::2]] == [observation(c, goal) for c in cells[1:]]
        assert answer == "done"
        assert len(moves) <= 6
        arrived += reaches_goal(row, moves, task.size)
        wrong += sum(abs(b[0] - goal[0]) + abs(b[1] - goal[1]) >= abs(a[0] - goal[0]) + abs(a[1] - goal[1])
                     for a, b in zip(cells, cells[1:]))
        total += len(moves)
    assert 0.2 < wrong / total < 0.4  # about the share asked for
    assert 0.5 < arrived / len(rows) < 1.0  # detours cost moves: some walks run out of them
    clean = [task.tool_trace(r, rng)[0] for r in rows[:20]]
    assert all(len(m) // 2 == sum(abs(a - b) for a, b in zip(*parse_prompt(r["prompt"]))) for m, r in zip(clean, rows))


def _walking_engine():
    """HFEngine whose turns end at a digit and always make one move, the direction from the turn's length:
    walks on a random model, so the group's answers meet the same cells."""
    directions = ("right", "up", "left", "down")

    class Walking(HFEngine):
        def generate(self, request):
            digits = [self.tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
            s = request.sampling
            s = SamplingParams(s.max_new_tokens, tuple(digits), s.pad_token_id, s.temperature)
            rollout, stats = sample_conversations(
                self.model, dataclasses.replace(request, sampling=s), tokenizer=self.tokenizer, max_tool_turns=3,
                parse_calls=lambda text, **_: [ToolCall("move", {"direction": directions[len(text) % 4]})])
            return RolloutResult(rollout, tool_stats=stats)

    return lambda config, model, tokenizer: Walking(model, tokenizer)


def test_a_gigpo_run_on_the_task_brings_its_environment_and_credits_turns(tool_model_dir, tmp_path):  # noqa: F811
    config = make_config(tool_model_dir, tmp_path / "run", steps=2, max_new_tokens=48,
                         algorithm={"turn_advantage": "gigpo"})
    config = type(config)(**{**config.__dict__, "data": type(config.data)(task="gridworld", num_prompts=32)})
    run = train(config, engine=_walking_engine())  # no tools, no environment, no rewards given: the task's
    metrics = read_metrics(run)
    assert len(metrics) == 2
    for m in metrics:
        assert math.isfinite(m["loss"]) and m["tools/call_frequency"] > 0 and "rewards/GridWorld/mean" in m
        assert m["turns/reward_share"] > 0 and -1.0 <= m["turns/0/reward_mean"] <= 1.0
        assert m["turns/step_group_size"] > 1  # the answers to a prompt met the same cells


def test_a_row_that_is_not_a_walk_stops_the_run_with_one_error_naming_it(tool_model_dir, tmp_path):  # noqa: F811
    config = make_config(tool_model_dir, tmp_path / "run", steps=1, max_new_tokens=48)
    config = type(config)(**{**config.__dict__, "data": type(config.data)(task="gridworld", num_prompts=8)})
    with pytest.raises(EnvironmentFault, match=r"environment GridWorld: reset raised ValueError: gridworld: a prompt "
                                               r"reads \"from X,Y to X,Y\", got 'walk to 2,3' \(row .*fix the "):
        train(config, rows=[{"prompt": "walk to 2,3", "answer": "done"}] * 8, engine=_walking_engine())
