"""The command line end to end, and every user error it must explain before any work starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--set", "train.steps=2", "--set", "train.prompts_per_step=2", "--set", "rollout.group_size=4",
        "--set", "output.console=false"]


def grpokit(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "grpokit.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_train_example_config_end_to_end(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    r = grpokit("train", "examples/addition.toml", "--set", f"model.path={json.dumps(str(tiny_model_dir))}",
                "--set", f"output.dir={json.dumps(str(run))}", "--set", "eval.num_prompts=4", *FAST)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2] and "reward" in rows[0]
    assert (run / "checkpoint-2" / "model.safetensors").is_file()
    assert (run / "checkpoint-2" / "tokenizer.json").is_file()
    assert "eval/accuracy" in rows[1] and "eval/greedy_accuracy" in rows[1]  # [eval]: after the last step
    assert json.loads((run / "best.json").read_text())["checkpoint"] == "checkpoint-2"


def test_train_on_user_jsonl_with_custom_reward(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    r = grpokit("train", "examples/sums_jsonl.toml", "--set", f"model.path={json.dumps(str(tiny_model_dir))}",
                "--set", f"output.dir={json.dumps(str(run))}", *FAST)
    assert r.returncode == 0, r.stderr
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert "rewards/correct_answer/mean" in row


def test_sft_then_eval_json(tiny_model_dir, tmp_path):
    out = tmp_path / "sft"
    r = grpokit("sft", "--model", tiny_model_dir, "--task", "addition", "--out", out, "--steps", "3",
                "--batch-size", "8")
    assert r.returncode == 0, r.stderr
    r = grpokit("eval", "--model", out, "--task", "addition", "--num-prompts", "4", "--samples", "2",
                "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert {"accuracy", "pass@2", "mean_reward", "greedy_accuracy"} <= set(result)
    assert result["num_prompts"] == 4 and 0.0 <= result["accuracy"] <= 1.0
    r = grpokit("eval", "--model", out, "--data", "examples/data/sums.jsonl", "--reward",
                "examples/custom_reward.py:correct_answer", "--num-prompts", "3", "--samples", "2",
                "--max-new-tokens", "4", "--json", "--no-greedy")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["num_prompts"] == 3


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _config(tmp_path, model, extra="", data='task = "addition"') -> Path:
    return _write(tmp_path / "c.toml", f'[model]\npath = {json.dumps(str(model))}\n[data]\n{data}\n'
                                       f'[output]\ndir = {json.dumps(str(tmp_path / "run"))}\nconsole = false\n'
                                       f'[train]\nsteps = 1\nprompts_per_step = 2\n[rollout]\ngroup_size = 4\n'
                                       f'max_new_tokens = 4\n{extra}')


def _fails(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr


def test_missing_model_folder(tmp_path):
    _fails(grpokit("train", _config(tmp_path, tmp_path / "nope")), "model.path", "is not a folder")
    assert not (tmp_path / "run").exists()  # nothing was created


def test_unknown_config_key_suggests_the_right_one(tiny_model_dir, tmp_path):
    _fails(grpokit("train", _config(tmp_path, tiny_model_dir), "--set", "train.learning_rat=1e-3"),
           "unknown key train.learning_rat", "did you mean 'learning_rate'")


def test_missing_prompt_column(tiny_model_dir, tmp_path):
    data = _write(tmp_path / "d.jsonl", '{"question": "1+1=", "answer": "2"}\n')
    cfg = _config(tmp_path, tiny_model_dir, data=f'path = {json.dumps(str(data))}\n'
                  '[rewards]\nfunctions = ["numeric_match"]')
    _fails(grpokit("train", cfg), "no column 'prompt'", "question")
    assert not (tmp_path / "run").exists()


def test_prompt_longer_than_the_context(tiny_model_dir, tmp_path):
    data = _write(tmp_path / "d.jsonl",
                  '{"prompt": "1+1=", "answer": "2"}\n' + json.dumps({"prompt": "9" * 600, "answer": "1"}) + "\n")
    cfg = _config(tmp_path, tiny_model_dir, data=f'path = {json.dumps(str(data))}\n'
                  '[rewards]\nfunctions = ["numeric_match"]')
    _fails(grpokit("train", cfg), "prompt row 2 has 600 tokens", "context of 512")


def test_existing_run_is_not_overwritten(tiny_model_dir, tmp_path):
    cfg = _config(tmp_path, tiny_model_dir)
    assert grpokit("train", cfg).returncode == 0
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    _fails(grpokit("train", cfg), "already holds a run", "--resume")
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("body, needles", [
    ("raise ValueError('boom')", ["reward function 'bad'", "boom"]),
    ("return [0.0]", ["bad", "1 value"]),
    ("return [float('nan')] * len(completions)", ["reward function 'bad' at sample 0", "returned nan"]),
])
def test_failing_reward_stops_with_its_name_and_keeps_checkpoints(tiny_model_dir, tmp_path, body, needles):
    """The reward file breaks between a run and its resume (the config stays the same)."""
    reward = ["--set", f"rewards.functions=[{json.dumps(str(tmp_path / 'bad.py') + ':bad')}]"]
    _write(tmp_path / "bad.py", "def bad(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    good = _config(tmp_path, tiny_model_dir, extra="")
    assert grpokit("train", good, "--set", "output.save_every=1", *reward).returncode == 0
    ckpt = tmp_path / "run" / "checkpoint-1"
    saved = (ckpt / "model.safetensors").read_bytes()
    _write(tmp_path / "bad.py", f"def bad(completions, **kwargs):\n    {body}\n")
    r = grpokit("train", good, "--resume", "--set", "train.steps=2", "--set", "output.save_every=1", *reward)
    _fails(r, *needles)
    assert (ckpt / "model.safetensors").read_bytes() == saved
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt)  # still loadable


def test_reward_reference_errors(tiny_model_dir, tmp_path):
    cfg = _config(tmp_path, tiny_model_dir)
    _fails(grpokit("train", cfg, "--set", 'rewards.functions=["nope.py:f"]'), "nope.py")
    _fails(grpokit("train", cfg, "--set", 'rewards.functions=["numeric_mach"]'), "numeric_mach")
