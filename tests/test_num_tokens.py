"""`num_tokens`, TRL's running count of the input tokens the model was fed (its `num_input_tokens_seen`).

TRL adds, per generation batch, every answer's prompt tokens and the tokens the model generated (a tool's
result is not counted); grpokit's rows carry the running total under TRL's name, kept in metrics.jsonl
itself so that a resume continues it. The drop-in's rows against TRL's own: tests/test_trl_dropin_object.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from grpokit.observe.metrics import input_tokens, num_tokens


def _rollout():
    # 2 answers: prompts of 3 and 2 real tokens (left padding), 4 and 1 generated tokens; the first answer's
    # two middle completion tokens are a tool's result (context, not the model's)
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]])
    tool_mask = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    return SimpleNamespace(prompt_mask=prompt_mask, action_mask=completion_mask * (1 - tool_mask))


def test_one_batch_counts_prompts_per_answer_and_the_models_own_tokens():
    assert input_tokens(_rollout()) == (3 + 2) + (6 - 2 + 1)  # 10


def test_the_running_total_continues_the_last_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert num_tokens(path, _rollout()) == 10.0  # no rows yet (a new run)
    path.write_text(json.dumps({"step": 1, "num_tokens": 10.0}) + "\n" + json.dumps({"step": 2, "num_tokens": 25.0})
                    + "\n")
    assert num_tokens(path, _rollout()) == 35.0  # the previous step's total + this one's
    path.write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")  # a run folder written before the count existed
    assert num_tokens(path, _rollout()) == 10.0
    path.write_text("[1, 2]\n")  # not a row: nothing to continue
    assert num_tokens(path, _rollout()) == 10.0
