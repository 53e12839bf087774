"""Streaming groups (`rollout.partial_rollouts`, rollout/streaming.py): rows kept full, exact answers, versions
across steps, the staleness bound, refusals, exact resume, and a CLI run."""

from __future__ import annotations

import copy
import json
import sys
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import make_config
from grpokit.config import schema
from grpokit.errors import ConfigError, SetupError
from grpokit.models.tiny import build_tiny_model
from grpokit.rollout.decode import sample_groups
from grpokit.rollout.request import RolloutRequest, SamplingParams
from grpokit.rollout.streaming import GroupPool, groups_rollout, mean_rows_waiting

TEXTS = ["1+2=", "What is 17 + 25? Answer:", "hello", "ab", "12345678+1=", "xxxxxxxxx", "q", "zz+yy=", "7*8=",
         "a longer prompt than the others, to pad"]
STOPS = tuple("0123456789")  # a random character model writes one of these about every ten tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_streaming")
    build_tiny_model(path, max_positions=128)
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def pool_of(tiny, prompts, sampling, *, group_size=2, rows=4, seed=0, max_staleness=None):
    model, tok = tiny
    source = iter(enumerate(prompts))
    return GroupPool(model, sampling, group_size, lambda: next(source, None), rows=rows, tokenizer=tok,
                     generator=torch.Generator().manual_seed(seed), max_staleness=max_staleness)


def varied_eos(tiny, prompts) -> tuple[int, ...]:
    """End tokens that greedy answers meet at different steps: where an answer first changes token (a random
    model repeats one token, then another), and the first token of one answer (it ends at once)."""
    model, tok = tiny
    free = sample_groups(model, RolloutRequest(prompts, 1, SamplingParams(12, (), tok.pad_token_id, 0.0)))
    changes = {int(row[row != row[0]][0]) for row in free.completion_ids if bool((row != row[0]).any())}
    return tuple(sorted(changes | {int(free.completion_ids[2, 0])}))


@pytest.mark.parametrize("speed", [{}, {"layer_loop": False}, {"preallocate_kv_cache": False}])
def test_greedy_answers_equal_each_prompt_sampled_alone(tiny, speed):
    """The golden test: rows joined into a running batch (left-padded cache, per-row positions, cut columns)
    give, with greedy decoding, exactly what decode.py's sample_groups gives for the prompt alone."""
    from grpokit.rollout.decode import DecodeSpeed

    model, tok = tiny
    prompts = [tok.encode(t) for t in TEXTS]
    s = SamplingParams(12, varied_eos(tiny, prompts), tok.pad_token_id, 0.0)
    pool = pool_of(tiny, prompts, s, rows=4)
    pool.speed = DecodeSpeed(**speed)
    groups = pool.take(len(prompts), version=0)
    assert sorted(g.item for g in groups) == list(range(len(prompts)))  # each prompt once, all complete
    lengths = set()
    for g in groups:
        assert g.prompt == prompts[g.item] and len(g.answers) == 2  # the group's own prompt, G answers
        alone = sample_groups(model, RolloutRequest([g.prompt], 2, s), speed=DecodeSpeed(**speed))
        for a, (tokens, logps, versions, ended) in enumerate(g.answers):
            n = int(alone.completion_mask[a].sum())
            assert tokens.tolist() == alone.completion_ids[a, :n].tolist()
            torch.testing.assert_close(logps, alone.logprobs[a, :n], atol=1e-5, rtol=0)
            assert ended == (not bool(alone.truncated[a])) and versions.tolist() == [0] * n
            lengths.add(n)
    assert len(lengths) >= 3  # the answers did end at different steps: rows were refilled mid-batch
    assert pool.layers is None and not pool.groups  # nothing left decoding


def test_rows_stay_fuller_than_a_batch_that_waits(tiny):
    model, tok = tiny
    prompts = [tok.encode(t) for t in TEXTS] * 2
    s = SamplingParams(24, (), tok.pad_token_id, 1.0, stop_strings=STOPS)
    plain = sample_groups(model, RolloutRequest(prompts[:4], 4, s, torch.Generator().manual_seed(0)), tokenizer=tok)
    waiting = mean_rows_waiting(plain.completion_mask.sum(-1))
    pool = pool_of(tiny, prompts, s, group_size=4, rows=16)
    groups = pool.take(4, version=0)
    streaming = sum(pool.decode_rows) / len(pool.decode_rows)
    assert streaming > waiting, (streaming, waiting)
    assert max(pool.decode_rows) <= 16 and len(groups) == 4
    r = groups_rollout(groups, 4, tok.pad_token_id)
    assert r.num_sequences == 16 and torch.equal(r.prompt_ids[0::4], r.prompt_ids[1::4])  # G rows per prompt
    for g in groups:  # every answer ends at a stop string or the budget
        for tokens, _, _, ended in g.answers:
            assert ended == any(c in tok.decode(tokens.tolist()) for c in STOPS) or len(tokens) == 24


def recomputed(model, prompt: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax of the model's logits for `tokens` after `prompt`, one plain forward [t]."""
    ids = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]


def test_answer_continues_into_the_next_step_under_new_weights(tiny):
    from grpokit.observe.metrics import version_metrics

    model, tok = tiny
    model = copy.deepcopy(model)
    old = copy.deepcopy(model)
    prompts = [tok.encode(t) for t in TEXTS] * 3
    s = SamplingParams(24, (), tok.pad_token_id, 1.0, stop_strings=STOPS)
    source = iter(enumerate(prompts))
    pool = GroupPool(model, s, 2, lambda: next(source, None), rows=8, tokenizer=tok,
                     generator=torch.Generator().manual_seed(1), max_staleness=1)
    first = pool.take(2, version=0)
    assert all(v == 0 for g in first for a in g.answers for v in a[2].tolist())
    with torch.no_grad():  # "the update": the weights change in place
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    second = pool.take(4, version=1)
    r = groups_rollout(second, 2, tok.pad_token_id)
    spanning = [(g, a) for g in second for a in g.answers if a[2].min() == 0 and a[2].max() == 1]
    assert spanning, "no answer continued across the update"
    for g, (tokens, logps, versions, _) in spanning:
        early = versions == 0
        assert versions.tolist() == sorted(versions.tolist())  # the version only grows along an answer
        # the early tokens keep the log-probs the old weights gave them
        torch.testing.assert_close(logps[early], recomputed(old, g.prompt, tokens)[early], atol=1e-5, rtol=0)
        assert not torch.allclose(logps[~early], recomputed(old, g.prompt, tokens)[~early], atol=1e-3)
    metrics = version_metrics(r.token_version, r.action_mask, trainer_version=1)
    assert metrics["async/versions_per_answer_max"] == 2.0 and metrics["async/token_lag_max"] == 1.0
    assert metrics["async/answers_spanning_versions"] > 0
    assert r.policy_version.tolist() == r.token_version.masked_fill(r.token_version < 0, 9).amin(-1).tolist()


def test_groups_past_max_staleness_are_restarted(tiny):
    model, tok = tiny
    prompts = [tok.encode(t) for t in TEXTS] * 3
    s = SamplingParams(24, (), tok.pad_token_id, 1.0, stop_strings=STOPS)
    pool = pool_of(tiny, prompts, s, rows=8, max_staleness=1)
    pool.take(2, version=0)
    held = pool.in_flight()
    started_at_0 = [g.item for g in [*pool.groups, *pool.ready] if g.version == 0]
    assert started_at_0, "nothing was left in flight"
    groups = pool.take(2, version=2)  # two updates later: version-0 tokens would lag 2 > max_staleness = 1
    assert pool.restarted == len(started_at_0)
    assert all(int(a[2].min()) >= 1 for g in groups for a in g.answers)  # nothing older than the bound
    assert set(started_at_0) <= set(pool.in_flight()) | {g.item for g in groups}  # their prompts run again
    assert held == sorted(held)  # in flight: in the order taken


def test_partial_rollouts_refusals(tiny_model_dir, tmp_path):
    def config(rollout=None, algorithm=None, tools=None):
        base = make_config(tiny_model_dir, tmp_path, rollout={"partial_rollouts": True, **(rollout or {})},
                           algorithm=algorithm)
        return base if tools is None else schema.Config(**{**{f: getattr(base, f) for f in schema.SECTIONS},
                                                             "tools": schema.ToolsConfig(**tools)})

    with pytest.raises(ConfigError) as e:
        config({"max_staleness": 0})
    assert str(e.value).startswith("rollout.max_staleness:") and "partial_rollouts" in str(e.value)
    assert "\n" not in str(e.value) and "max_staleness >= 1" in str(e.value)
    for bad, field in (({"rollout": {"mode": "async"}}, "rollout.mode"),
                       ({"algorithm": {"dynamic_sampling": True}}, "algorithm.dynamic_sampling"),
                       ({"tools": {"functions": ("t.py:f",)}}, "tools.functions")):
        with pytest.raises(ConfigError) as e:
            config(**bad)
        message = str(e.value)
        assert message.startswith("rollout.partial_rollouts:") and field in message and "\n" not in message
    assert config().algorithm.is_correction == "token_truncate"  # "auto" corrects the lag, as in async mode
    assert make_config(tiny_model_dir, tmp_path).algorithm.is_correction == "none"


def test_task_tools_refused_at_start_up(tool_model_dir, tmp_path):
    from grpokit.training.loop import train

    config = make_config(tool_model_dir, tmp_path / "run", rollout={"partial_rollouts": True})
    config = schema.Config(**{**{f: getattr(config, f) for f in schema.SECTIONS},
                              "data": schema.DataConfig(task="multiplication", num_prompts=16)})
    with pytest.raises(SetupError, match=r"^rollout.partial_rollouts: tools or environments"):
        train(config)


def trained_prompts(run) -> list[str]:
    """The prompt of each answer a run trained on, in order (completions.jsonl)."""
    return [json.loads(line)["prompt"] for line in (run / "completions.jsonl").read_text().splitlines()]


def trained_and_in_flight(run, last: int) -> Counter:
    """The prompts a run trained on (one per group of 4 answers) plus those in flight at its last checkpoint."""
    from grpokit.tasks import get_task

    rows = get_task("addition").generate(64, seed=0, split="train")
    replay = load_replay(run / f"checkpoint-{last}")
    return Counter(trained_prompts(run)[::4] + [rows[i]["prompt"] for i in replay])


def stream_prefix(count: int) -> Counter:
    from grpokit.data.prompts import PromptStream
    from grpokit.tasks import get_task

    rows = get_task("addition").generate(64, seed=0, split="train")
    stream = PromptStream(list(range(64)), 1, seed=0)
    return Counter(rows[stream.next_row()]["prompt"] for _ in range(count))


def load_replay(checkpoint) -> list:
    from grpokit.training.checkpoint import load_trainer_state

    return load_trainer_state(checkpoint)["stream"].get("replay", [])


def test_resume_replays_the_prompts_in_flight(tiny_model_dir, tmp_path):
    """Every prompt taken from the stream is trained once or still in flight: none lost, none twice, across a
    stop and --resume (the checkpoint's in-flight prompts are sampled again first)."""
    from grpokit.training.loop import train

    def config(out, steps):
        return make_config(tiny_model_dir, out, steps=steps, max_new_tokens=16,
                           rollout={"partial_rollouts": True, "stop_strings": STOPS},
                           output={"save_every": 1, "keep_last": 10, "completions_every": 1})

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(config(whole, 4))
    train(config(parts, 2))
    replayed = load_replay(parts / "checkpoint-2")
    assert replayed, "nothing in flight at the stop: the test would not test the replay"
    train(config(parts, 4), resume=True)
    for run in (whole, parts):
        accounted = trained_and_in_flight(run, 4)
        assert accounted == stream_prefix(sum(accounted.values()))
    assert trained_prompts(whole)[:32] == trained_prompts(parts)[:32]  # steps 1-2: the same run


def test_cli_trains_with_partial_rollouts(tiny_model_dir, tmp_path):
    import subprocess

    run, toml = tmp_path / "run", tmp_path / "run.toml"
    toml.write_text(f"[model]\npath = {json.dumps(str(tiny_model_dir))}\n"
                    "[data]\ntask = \"addition\"\nnum_prompts = 32\n[rewards]\nfunctions = [\"addition\"]\n"
                    "[train]\nsteps = 3\nprompts_per_step = 2\n"
                    f"[rollout]\ngroup_size = 4\nmax_new_tokens = 12\nstop_strings = {json.dumps(list(STOPS))}\n"
                    f"[output]\ndir = {json.dumps(str(run))}\nconsole = false\n")

    def cli(*sets):
        args = [a for s in ("rollout.partial_rollouts=true", *sets) for a in ("--set", s)]
        return subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(toml), *args],
                              capture_output=True, text=True, timeout=600)

    r = cli()
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for key in ("rollout/decode_rows_mean", "async/token_lag_mean", "async/versions_per_answer_max",
                "async/answers_spanning_versions", "rollout/groups_restarted", "sampling/is_ratio_mean"):
        assert key in rows[-1], key
    assert all(0 < row["rollout/decode_rows_mean"] <= 8 for row in rows)
    assert any(row["async/answers_spanning_versions"] > 0 for row in rows)  # answers went on across an update
    assert all(row["async/token_lag_max"] <= 1 for row in rows)  # rollout.max_staleness = 1
    r = cli("rollout.max_staleness=0", "output.overwrite=true")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rollout.max_staleness" in errors[0] and "partial_rollouts" in errors[0]


def test_a_checkpoint_replays_the_groups_of_a_step_that_did_not_finish(tiny, tmp_path):
    """The groups handed on for a step stay in the checkpoint's replay until the step's update is published
    (a failure inside the step saves the step before: its prompts must run again)."""
    from types import SimpleNamespace

    from grpokit.data.prompts import PromptStream
    from grpokit.rollout.engines import HFEngine
    from grpokit.training.rollout_source import SyncRollouts
    from grpokit.training.streaming_rollouts import StreamingRollouts

    model, tok = tiny
    config = make_config(tmp_path, tmp_path / "run", max_new_tokens=16, prompts_per_step=2,
                         rollout={"partial_rollouts": True, "stop_strings": STOPS})
    ids = [tok.encode(t) for t in TEXTS]
    side = SimpleNamespace(specs=[], group_size=4, tokenizer=tok, prompt_column="prompt", engine=HFEngine(model, tok),
                           sampling=SamplingParams(16, (), tok.pad_token_id, 1.0, stop_strings=STOPS),
                           prompts=SimpleNamespace(ids=ids, rows=[{"prompt": t} for t in TEXTS], media=None))
    run = SimpleNamespace(inputs=SimpleNamespace(local=config, tools=None, environments=None, prompts=side.prompts),
                          side=side, stream=PromptStream(list(range(len(TEXTS))), 2, seed=0),
                          policy=SimpleNamespace(model=model), sampling_generator=torch.Generator().manual_seed(0),
                          weights=SimpleNamespace(publish=lambda model, step: None))
    rollouts = StreamingRollouts(config, run, SyncRollouts(config, run))
    assert run.stream is rollouts  # the checkpoint reads the position through it
    handed = rollouts.next_batch()
    in_pool = rollouts.pool.in_flight()
    assert len(handed) == 2 and in_pool and not set(handed) & set(in_pool)
    replay = rollouts.state_dict()["replay"]
    assert sorted(replay) == sorted(handed + in_pool)  # before the update: the step's groups too
    rollouts.publish(model, 1)
    assert rollouts.state_dict()["replay"] == in_pool  # after it: only what is still in flight
    fresh = PromptStream(list(range(len(TEXTS))), 2, seed=0)
    fresh.load_state_dict(rollouts.state_dict())
    assert [fresh.next_row() for _ in in_pool] == in_pool  # a resumed run takes them first
