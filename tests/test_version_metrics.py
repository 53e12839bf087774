"""Golden test of the per-token version metrics (in-flight weight updates, streaming groups)."""

import torch

from grpokit.observe.metrics import version_metrics
from grpokit.rollout.batch import Rollout, concat_rollouts


def test_token_lags_and_versions_per_answer_by_hand():
    token_version = torch.tensor([[3, 3, 4, 4, -1],    # lags 2 2 1 1: two versions
                                  [4, 4, 4, -1, -1],   # lags 1 1 1: one
                                  [2, 3, 3, 4, 4]])    # lags 3 2 2 1 1: three
    m = version_metrics(token_version, (token_version >= 0).long(), trainer_version=5)
    assert m["async/token_lag_mean"] == 18 / 12
    assert m["async/token_lag_max"] == 3.0
    assert m["async/versions_per_answer_max"] == 3.0
    assert m["async/answers_spanning_versions"] == 2 / 3


def test_tool_result_tokens_are_not_counted_and_an_empty_batch_is_lag_zero():
    token_version = torch.tensor([[1, 1, 1, 2]])
    action = torch.tensor([[1, 1, 0, 0]])  # the last two are a tool's result: not sampled
    m = version_metrics(token_version, action, trainer_version=2)
    assert m["async/token_lag_mean"] == 1.0 and m["async/versions_per_answer_max"] == 1.0
    empty = version_metrics(token_version, torch.zeros_like(action), trainer_version=2)
    assert empty["async/token_lag_max"] == 0.0 and empty["async/answers_spanning_versions"] == 0.0


def test_token_versions_travel_through_concat_padded_with_minus_one():
    def rollout(T, version):
        ones = torch.ones(1, T, dtype=torch.long)
        return Rollout(ones, ones, ones, ones, torch.zeros(1, T), torch.zeros(1, dtype=torch.bool),
                       token_version=torch.full((1, T), version))
    both = concat_rollouts([rollout(2, 7), rollout(4, 8)], pad_token_id=0)
    assert both.token_version.tolist() == [[7, 7, -1, -1], [8, 8, 8, 8]]


def test_a_version_change_across_a_tool_result_or_padding_is_counted():
    """The versions of an answer's sampled tokens, whatever lies between them (a tool's result, a -1)."""
    across_tool = version_metrics(torch.tensor([[0, 0, 0, 1, 1]]), torch.tensor([[1, 1, 0, 1, 1]]), 1)
    across_gap = version_metrics(torch.tensor([[0, 0, -1, 1, 1]]), torch.ones(1, 5, dtype=torch.long), 1)
    for m in (across_tool, across_gap):
        assert m["async/versions_per_answer_max"] == 2.0 and m["async/answers_spanning_versions"] == 1.0
