"""Evaluation during training ([eval]) and output.keep_best.

The logged eval metrics are checked against `evaluate` run afterwards on the saved checkpoint (the same
prompts, seed and settings give the same numbers), the best checkpoint against the logged values, and
the bad inputs against their one-line errors before any model loads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import comparable, make_config, parity
from grpokit.config.schema import Config, DataConfig, EvalConfig, ModelConfig, OutputConfig
from grpokit.errors import ConfigError, DataError, SetupError
from grpokit.training.loop import train

EVAL = dict(every=2, num_prompts=6, samples_per_prompt=3, greedy=True, correct_threshold=0.5, seed=5)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_eval_metrics_are_logged_when_due_and_equal_evaluate_on_the_checkpoint(tiny_model_dir, tmp_path):
    from grpokit.models.loading import load_model, load_tokenizer, max_positions_of
    from grpokit.models.parallel import DistributedContext
    from grpokit.observe.report import build_report
    from grpokit.rollout.request import SamplingParams
    from grpokit.tasks import get_task
    from grpokit.training.evaluation import EvalSettings, evaluate
    from grpokit.training.setup import PreparedData, prepare_held_out

    config = make_config(tiny_model_dir, tmp_path / "run", steps=3, eval=EVAL)
    run = train(config, reward_functions=[parity])
    rows = _rows(run)
    logged = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in rows}
    assert [s for s, m in logged.items() if m] == [2, 3]  # every 2 steps, and after the last one
    assert set(logged[3]) == {"eval/accuracy", "eval/pass@3", "eval/mean_reward", "eval/greedy_accuracy"}
    assert 0 < logged[3]["eval/mean_reward"] < 1  # parity on a random model: neither all nor nothing

    tokenizer = load_tokenizer(str(run / "checkpoint-3"))
    table = prepare_held_out(config, PreparedData([], get_task("addition")), tokenizer,
                             max_positions_of(str(tiny_model_dir)), None, DistributedContext())
    assert len(table.rows) == 6
    model = load_model(str(run / "checkpoint-3"))
    sampling = SamplingParams(5, tuple(table.eos_token_ids), tokenizer.pad_token_id, temperature=1.0)
    again = evaluate(model, tokenizer, table.rows, table.ids, [s for s in _specs()], EvalSettings(
        sampling, samples_per_prompt=3, correct_threshold=0.5, greedy=True, seed=5))
    for key in ("accuracy", "pass@3", "mean_reward", "greedy_accuracy"):
        assert logged[3][f"eval/{key}"] == pytest.approx(again[key], abs=1e-6), key

    # the evaluation has its own sampler: the training run is the one it would be without it
    plain = train(make_config(tiny_model_dir, tmp_path / "plain", steps=3), reward_functions=[parity])
    without_eval = [{k: v for k, v in r.items() if not k.startswith(("eval/", "time/eval"))} for r in rows]
    assert comparable(without_eval) == comparable(_rows(plain))

    html = build_report(run).read_text()
    assert "Held-out evaluation" in html and "not logged: no evaluation during training" not in html


def _specs():
    from grpokit.rewards.core import RewardSpec

    return [RewardSpec("parity", parity)]


def test_keep_best_keeps_the_best_checkpoint_past_keep_last_and_across_a_resume(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    every_step = {**EVAL, "every": 1}
    config = make_config(tiny_model_dir, out, steps=3, learning_rate=5e-2, eval=every_step,
                         output={"keep_last": 1, "keep_best": "eval/mean_reward"})
    train(config, reward_functions=[parity])
    # a resume may change the evaluation (it does not change the training) and the isolation of the rewards
    config = replace(config, train=replace(config.train, steps=5), eval=replace(config.eval, num_prompts=5),
                     rewards=replace(config.rewards, isolation="process"))
    train(config, reward_functions=[parity], resume=True)
    values = {r["step"]: r["eval/mean_reward"] for r in _rows(out)}
    assert sorted(values) == [1, 2, 3, 4, 5]
    best = json.loads((out / "best.json").read_text())
    top = max(values.values())
    assert best["metric"] == "eval/mean_reward" and best["value"] == pytest.approx(top)
    assert best["step"] == min(s for s, v in values.items() if v == top)  # the first time it was reached
    kept = sorted(p.name for p in out.glob("checkpoint-*"))
    assert kept == sorted({f"checkpoint-{best['step']}", "checkpoint-5"})  # keep_last = 1, plus the best
    assert len(set(values.values())) > 1  # the metric moved: the choice of a best was not trivial


def test_changing_or_clearing_keep_best_on_resume_keeps_the_kept_best_checkpoint(tiny_model_dir, tmp_path, capsys):
    """A resume may change output.keep_best; the checkpoint kept as the old metric's best stays (it used to
    be pruned by keep_last at the next save, with best.json still naming it)."""
    out = tmp_path / "run"
    config = make_config(tiny_model_dir, out, steps=3, learning_rate=5e-2, eval={**EVAL, "every": 1},
                         output={"keep_last": 1, "keep_best": "eval/mean_reward"})
    train(config, reward_functions=[parity])
    first = json.loads((out / "best.json").read_text())
    kept = out / first["checkpoint"]
    snapshot = {p.name: p.read_bytes() for p in kept.iterdir() if p.is_file()}
    changed = replace(config, train=replace(config.train, steps=5),
                      output=replace(config.output, keep_best="eval/accuracy"))
    capsys.readouterr()
    train(changed, reward_functions=[parity], resume=True)
    note = capsys.readouterr().out
    assert f"{first['checkpoint']}, the best eval/mean_reward so far, stays" in note, note
    assert {p.name: p.read_bytes() for p in kept.iterdir() if p.is_file()} == snapshot  # nothing lost
    best = json.loads((out / "best.json").read_text())
    assert best["metric"] == "eval/accuracy" and (out / best["checkpoint"]).is_dir()
    assert [r["checkpoint"] for r in best["earlier"]] == [first["checkpoint"]]
    cleared = replace(changed, train=replace(changed.train, steps=7), output=replace(changed.output, keep_best=""))
    train(cleared, reward_functions=[parity], resume=True)
    names = {p.name for p in out.glob("checkpoint-*")}
    assert {first["checkpoint"], best["checkpoint"], "checkpoint-7"} <= names, names
    assert len(names) == len({first["checkpoint"], best["checkpoint"], "checkpoint-7"})  # keep_last = 1 otherwise
    assert {r["checkpoint"] for r in json.loads((out / "best.json").read_text())["earlier"]} == \
        {first["checkpoint"], best["checkpoint"]}


def test_bad_eval_inputs_fail_before_the_model_loads(tiny_model_dir, tmp_path):
    model = ModelConfig(path=str(tiny_model_dir))
    own = tmp_path / "own.jsonl"
    own.write_text('{"prompt": "1+1="}\n')
    config = Config(model=model, data=DataConfig(path=str(own)), eval=EvalConfig(every=5),
                    output=OutputConfig(dir=str(tmp_path / "run")))
    with pytest.raises(SetupError, match="eval.path: is needed"):
        train(config, reward_functions=[parity])
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="output.keep_best: got 'eval/pass@8'.*eval/pass@4"):
        Config(model=model, data=DataConfig(task="addition"), eval=EvalConfig(every=5),
               output=OutputConfig(keep_best="eval/pass@8"))
    with pytest.raises(ConfigError, match="output.keep_best.*set eval.every > 0"):
        Config(model=model, data=DataConfig(task="addition"), output=OutputConfig(keep_best="eval/accuracy"))
    with pytest.raises(ConfigError, match="eval.temperature"):
        EvalConfig(every=1, temperature=0)

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text('{"question": "1+1=", "answer": "2"}\n')
    config = make_config(tiny_model_dir, tmp_path / "run", eval={"every": 1, "path": str(held_out)})
    with pytest.raises(DataError, match="held_out.jsonl.*prompt"):
        train(config, reward_functions=[parity])
    assert not (tmp_path / "run").exists()  # nothing written before the error

    with pytest.raises(DataError, match="eval_rows.*prompt"):
        train(config, reward_functions=[parity], eval_rows=[{"question": "1+1="}])
    assert not (tmp_path / "run").exists()

    held_out.write_text(json.dumps({"prompt": "1+" * 400 + "1=", "answer": 401}) + "\n")
    with pytest.raises(DataError, match="eval.path .*held_out.jsonl.*prompt row 1 has.*rollout.max_new_tokens = 5"):
        train(config, reward_functions=[parity])
    assert not (tmp_path / "run").exists()
    # the eval's own answer length is the one named when it is set
    held_out.write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n")
    config = make_config(tiny_model_dir, tmp_path / "run", eval={"every": 1, "path": str(held_out),
                                                                 "max_new_tokens": 600})
    with pytest.raises(DataError, match="with eval.max_new_tokens = 600 it exceeds .* lower eval.max_new_tokens"):
        train(config, reward_functions=[parity])
    assert not (tmp_path / "run").exists()


def test_held_out_rows_from_python(tiny_model_dir, tmp_path):
    config = make_config(tiny_model_dir, tmp_path / "run", steps=1, eval={"every": 1, "samples_per_prompt": 2})
    run = train(config, reward_functions=[parity], eval_rows=[{"prompt": f"{i}+1=", "answer": i + 1} for i in range(3)])
    row = _rows(run)[0]
    assert 0 <= row["eval/accuracy"] <= 1 and "eval/pass@2" in row


@pytest.mark.parametrize("damage", ["[]", "null", "{", '{"metric": "eval/mean_reward", "value": NaN, "step": 1, '
                                     '"checkpoint": "checkpoint-1"}'])
def test_a_damaged_best_json_is_forgotten_and_rewritten(tiny_model_dir, tmp_path, damage):
    out = tmp_path / "run"
    config = make_config(tiny_model_dir, out, steps=1, eval={**EVAL, "every": 1},
                         output={"keep_best": "eval/mean_reward"})
    train(config, reward_functions=[parity])
    (out / "best.json").write_text(damage)
    train(replace(config, train=replace(config.train, steps=2)), reward_functions=[parity], resume=True)
    best = json.loads((out / "best.json").read_text())
    assert best["value"] == best["value"] and best["step"] == 2  # rewritten at the next evaluation


def test_overwrite_removes_best_json_and_eval_rows_must_have_the_training_columns(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    config = make_config(tiny_model_dir, out, steps=1, eval={**EVAL, "every": 1},
                         output={"keep_best": "eval/mean_reward"})
    train(config, reward_functions=[parity])
    train(make_config(tiny_model_dir, out, steps=1, output={"overwrite": True}), reward_functions=[parity])
    assert not (out / "best.json").exists()

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text('{"prompt": "1+1="}\n')  # the addition task's rows also have "answer"
    config = make_config(tiny_model_dir, tmp_path / "other", eval={"every": 1, "path": str(held_out)})
    with pytest.raises(DataError, match=r"eval.path .*held_out.jsonl: the held-out rows lack .*\['answer'\]"):
        train(config, reward_functions=[parity])


def test_a_failing_evaluation_keeps_the_step_that_finished(tiny_model_dir, tmp_path, capsys):
    from grpokit.errors import RewardError

    def fails_on_held_out(completions, prompts, **kwargs):  # the training prompts are 2-digit sums
        if any(p.startswith("held out") for p in prompts):
            raise ValueError("no grade for this prompt")
        return parity(completions)

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text('{"prompt": "held out 1+1=", "answer": "2"}\n')
    out = tmp_path / "run"
    config = make_config(tiny_model_dir, out, steps=3, eval={"every": 2, "path": str(held_out)},
                         output={"save_every": 2})
    with pytest.raises(RewardError, match="evaluation during training"):
        train(config, reward_functions=[fails_on_held_out])
    assert [r["step"] for r in _rows(out)] == [1, 2]  # step 2 finished before its evaluation failed
    assert (out / "checkpoint-2").is_dir()
    assert "step 2 finished and is saved" in capsys.readouterr().out
    # with the reward fixed, the run continues from there
    train(config, reward_functions=[parity], resume=True)
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]
