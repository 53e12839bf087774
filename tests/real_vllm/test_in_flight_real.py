"""In-flight weight updates against the real vLLM server (its CPU build; tests/real_vllm/conftest.py): with
`rollout.in_flight_updates` the push does not wait for the worker's batch; vLLM's `/pause?mode=keep` freezes the
batch's requests, `reload_weights` loads the new weights and `/resume` continues them with their KV cache."""

from __future__ import annotations

from conftest import parity
from grpokit.observe.tracking import read_metrics
from grpokit.training.loop import train
from real_vllm.conftest import vllm_call
from real_vllm.test_vllm_engine import server_config
from test_in_flight_updates import VERSION_KEYS


def test_async_in_flight_through_the_server_pushes_inside_batches_and_every_answer_completes(
        vllm_model_dir, fresh_server, tmp_path):
    """Long answers (ignore_eos), a fast trainer: pushes land while the worker's requests run. None is cut short
    (a request aborted by the pause would end early), the lag bound holds, and the metrics say what is known."""
    tokens, steps = 160, 5
    run = train(server_config(vllm_model_dir, tmp_path / "run", fresh_server, steps=steps, max_new_tokens=tokens,
                              rollout={"mode": "async", "max_staleness": 1, "ignore_eos": True,
                                       "in_flight_updates": True}), reward_functions=[parity])
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["completions/min_length"] == tokens, r  # every frozen request was continued to its end
        assert r["async/staleness_max"] <= 1 and all(k in r for k in VERSION_KEYS), r
        assert r["async/versions_per_answer_max"] == 1  # the server's tokens carry no version: the oldest possible
        assert r["async/server_versions_during_batch"] >= 0
    assert max(r["async/server_versions_during_batch"] for r in rows) >= 1, \
        [r["async/server_versions_during_batch"] for r in rows]
    assert rows[0]["async/staleness_max"] == 0
    assert vllm_call(fresh_server, "GET", "/is_paused")["is_paused"] is False  # every push resumed it

