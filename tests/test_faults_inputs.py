"""Fault injection on what the user hands the CLI: damaged model folders, bad `eval` / `sft` /
`tiny-model` flags and output paths, and reward functions that share a name.

The CLI runs in subprocesses (tests/fault_harness.py): exit 2, one `error:` line that names the file
or flag, no traceback, and nothing written (the output folder is not created, user files are
unchanged). The checks behind them run before the model loads; a few cases that need no subprocess
(loader wrapping, reward names) run in-process.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from fault_harness import assert_clean_exit, assert_user_error, run_cli, snapshot, write_train_config
from grpokit.errors import ModelLoadError
from grpokit.models.loading import check_model_folder, load_model, load_tokenizer

pytestmark = pytest.mark.faults


def model_copy(tiny_model_dir: Path, tmp_path: Path, name: str = "model") -> Path:
    dst = tmp_path / name
    shutil.copytree(tiny_model_dir, dst)
    return dst


def write_config(tmp_path: Path, model_dir: Path, run: Path, rewards: list[str] | None = None) -> Path:
    """One step on the addition task, graded by `rewards` (default: the task's own verifier)."""
    return write_train_config(tmp_path, model_dir, run, steps=1, rewards=rewards or [])


# ---- damaged model folders ------------------------------------------------------------------------------

def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _set_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))


DAMAGE = {  # how -> (damage the copy, what the error line names)
    "truncated safetensors": (_truncate, ["model.safetensors", "truncated"]),
    "random-bytes safetensors": (lambda d: (d / "model.safetensors").write_bytes(os.urandom(5000)),
                                 ["model.safetensors", "damaged"]),
    "no weights file": (lambda d: (d / "model.safetensors").unlink(), ["no weights file", "model.safetensors"]),
    "config.json not JSON": (lambda d: (d / "config.json").write_text('{"model_type": "qwen2",'),
                             ["config.json", "not valid JSON"]),
    "config.json without model_type": (lambda d: _set_config(d, model_type=None), ["config.json", "model_type"]),
    "unknown model_type": (lambda d: _set_config(d, model_type="qwen99"), ["config.json", "'qwen99'"]),
    "no tokenizer files": (lambda d: [(d / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json",
                                                                 "chat_template.jinja")],
                           ["tokenizer files"]),
}


@pytest.fixture(params=sorted(DAMAGE))
def damaged_model(request, tiny_model_dir, tmp_path) -> tuple[Path, list[str]]:
    damage, mentions = DAMAGE[request.param]
    folder = model_copy(tiny_model_dir, tmp_path)
    damage(folder)
    return folder, mentions


def test_train_on_damaged_model_folder(damaged_model, tmp_path):
    folder, mentions = damaged_model
    run, before = tmp_path / "run", snapshot(folder)
    r = run_cli("train", write_config(tmp_path, folder, run))
    assert_user_error(r, "model.path", str(folder), *mentions)
    assert not run.exists()  # failed before anything was written
    assert snapshot(folder) == before


def test_eval_on_damaged_model_folder(damaged_model):
    folder, mentions = damaged_model
    r = run_cli("eval", "--model", folder, "--task", "addition", "--num-prompts", 2, "--samples", 2)
    assert_user_error(r, "--model", str(folder), *mentions)


def test_sharded_index_with_a_missing_shard(tiny_model_dir, tmp_path):
    folder = model_copy(tiny_model_dir, tmp_path)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=r"model.safetensors.index.json lists 2 shard\(s\) but "
                                             r"'model-00002-of-00002.safetensors' is missing"):
        check_model_folder(folder)


def test_damaged_pytorch_bin_is_one_error_with_its_cause(tiny_model_dir, tmp_path):
    # Random bytes make torch's weights-only unpickler raise whatever they provoke (UnpicklingError,
    # IndexError, EOFError, ...): every payload must end in the same one error with its cause kept.
    folder = model_copy(tiny_model_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    causes = set()
    for seed in range(40):
        (folder / "pytorch_model.bin").write_bytes(random.Random(seed).randbytes(3000))
        check_model_folder(folder)  # present: only loading can tell
        with pytest.raises(ModelLoadError, match="pytorch_model.bin is not a readable PyTorch checkpoint") as info:
            load_model(folder, device="cpu")
        causes.add(type(info.value.__cause__).__name__)
    assert len(causes) >= 2, causes  # the payloads did reach more than one failure path


def test_tokenizer_config_without_vocabulary(tiny_model_dir, tmp_path):
    folder = model_copy(tiny_model_dir, tmp_path)
    (folder / "tokenizer.json").unlink()  # transformers then builds an empty tokenizer from the config alone
    with pytest.raises(ModelLoadError, match="the tokenizer has no vocabulary"):
        load_tokenizer(folder)


def test_loader_errors_are_wrapped_but_bugs_are_not(tiny_model_dir, tmp_path, monkeypatch):
    folder = model_copy(tiny_model_dir, tmp_path)
    _set_config(folder, model_type="t5")  # a known model type, but no causal LM
    with pytest.raises(ModelLoadError, match=r"model.path .*: loading the model failed \(ValueError: ") as info:
        load_model(folder, device="cpu")
    assert isinstance(info.value.__cause__, ValueError)

    import transformers

    def bug(*args, **kwargs):
        raise ZeroDivisionError("a bug, not the user's folder")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", bug)
    with pytest.raises(ZeroDivisionError):
        load_model(model_copy(tiny_model_dir, tmp_path, "good"), device="cpu")


# ---- eval flags -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, mentions", [
    (["--task", "additon"], ["--task", "unknown task 'additon'", "did you mean 'addition'", "countdown"]),
    (["--task", "addition", "--samples", "0"], ["--samples", ">= 1"]),
    (["--task", "addition", "--num-prompts", "0"], ["--num-prompts", ">= 1"]),
    (["--task", "addition", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["--task", "addition", "--max-new-tokens", "-3"], ["--max-new-tokens", "got -3"]),
    (["--task", "addition", "--temperature", "0"], ["--temperature", "> 0"]),
    (["--task", "addition", "--temperature", "-0.5"], ["--temperature", "> 0"]),
    (["--task", "addition", "--task-arg", "digits=0"], ["--task-arg", "digits"]),
], ids=["task typo", "samples 0", "num-prompts 0", "max-new-tokens 0", "max-new-tokens -3", "temperature 0",
        "temperature -0.5", "task-arg digits=0"])
def test_eval_bad_flags(args, mentions, tmp_path):
    # The model folder does not even exist: the flags are checked before it is looked at.
    r = run_cli("eval", "--model", tmp_path / "no-model", *args)
    assert_user_error(r, *mentions)


def test_eval_max_new_tokens_beyond_the_models_context_is_one_error(tiny_model_dir):
    r = run_cli("eval", "--model", tiny_model_dir, "--task", "addition", "--num-prompts", "2", "--samples", "1",
                "--max-new-tokens", "2000")
    line = assert_user_error(r, "--max-new-tokens 2000", "max_position_embeddings", "use at most --max-new-tokens")
    assert "is 512 positions" in line  # the tiny model's context


# ---- reward functions that share a name -----------------------------------------------------------------

def write_score_files(tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "a.py").write_text("def score(completions, **kw):\n    return [1.0 for _ in completions]\n")
    (tmp_path / "b.py").write_text("def score(completions, **kw):\n    return [0.25 for _ in completions]\n")
    return f"{tmp_path / 'a.py'}:score", f"{tmp_path / 'b.py'}:score"


def test_reward_names_are_made_distinct(tmp_path):
    from grpokit.rewards.registry import reward_specs, unique_reward_names

    a, b = write_score_files(tmp_path)
    specs = reward_specs([a, b, "format"], args={"b.score": {"timeout": 5}})
    assert [s.name for s in specs] == ["a.score", "b.score", "format"]
    assert [s.timeout for s in specs] == [None, 5.0, None]
    assert [s.name for s in reward_specs([a, a])] == ["score", "score_2"]  # the same function twice
    assert unique_reward_names(["score", "score"], ["r", "r"]) == ["score", "score_2"]  # two files named r.py
    assert unique_reward_names(["x", "x", "x_2"]) == ["x", "x_2", "x_2_2"]


def test_train_with_two_reward_files_defining_the_same_name(tiny_model_dir, tmp_path):
    a, b = write_score_files(tmp_path)
    run = tmp_path / "run"
    r = run_cli("train", write_config(tmp_path, tiny_model_dir, run, rewards=[a, b]))
    assert_clean_exit(r)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["rewards/a.score/mean"] == 1.0 and row["rewards/b.score/mean"] == 0.25


def test_train_api_with_two_callables_of_the_same_name(tiny_model_dir, tmp_path):
    from grpokit.config.loading import load_config
    from grpokit.training.loop import train

    def make(value):
        def score(completions, **kwargs):
            return [value for _ in completions]
        return score

    run = tmp_path / "run"
    config = load_config(write_config(tmp_path, tiny_model_dir, run))
    train(config, reward_functions=[make(1.0), make(0.5)])
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["rewards/score/mean"] == 1.0 and row["rewards/score_2/mean"] == 0.5


# ---- sft --out and flags --------------------------------------------------------------------------------

def sft(model: Path, out: Path, *more) -> list:
    return ["sft", "--model", model, "--task", "addition", "--out", out, "--steps", 1, "--batch-size", 2, *more]


def test_sft_out_is_a_file(tiny_model_dir, tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    r = run_cli(*sft(tiny_model_dir, out))
    assert_user_error(r, "--out", str(out), "is a file")
    assert "sft step" not in r.stdout and out.read_text() == "keep me"  # refused before training


def test_sft_out_holds_a_model(tiny_model_dir, tmp_path):
    out = model_copy(tiny_model_dir, tmp_path, "previous")
    before = snapshot(out)
    r = run_cli(*sft(tiny_model_dir, out))
    assert_user_error(r, "--out", str(out), "config.json", "--overwrite")
    assert snapshot(out) == before


def test_sft_out_overwrite_replaces_the_model(tiny_model_dir, tmp_path):
    out = model_copy(tiny_model_dir, tmp_path, "previous")
    (out / "my-notes.txt").write_text("mine")
    before = snapshot(out)
    r = run_cli(*sft(tiny_model_dir, out, "--overwrite"))
    assert_clean_exit(r)
    after = snapshot(out)
    assert after["model.safetensors"] != before["model.safetensors"] and after["my-notes.txt"] == before["my-notes.txt"]


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--batch-size", "0"), ("--lr", "0"), ("--lr=-1e-3", None)])
def test_sft_bad_flags(flag, value, tiny_model_dir, tmp_path):
    # (`--lr -1e-3` is refused by argparse itself, which takes "-1e-3" for an option: write `--lr=-1e-3`.)
    r = run_cli(*sft(tiny_model_dir, tmp_path / "out"), *([flag] if value is None else [flag, value]))
    assert_user_error(r, flag.split("=")[0])
    assert not (tmp_path / "out").exists()


# ---- tiny-model -----------------------------------------------------------------------------------------

def test_tiny_model_onto_a_file(tmp_path):
    out = tmp_path / "file"
    out.write_text("keep me")
    assert_user_error(run_cli("tiny-model", out), str(out), "is a file")
    assert out.read_text() == "keep me"


def test_tiny_model_onto_a_non_empty_folder(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    before = snapshot(tmp_path)
    assert_user_error(run_cli("tiny-model", tmp_path), str(tmp_path), "not empty")
    assert snapshot(tmp_path) == before


def test_tiny_model_arch_typo_lists_the_supported_ones(tmp_path):
    from grpokit.models.tiny import TINY_ARCHS

    line = assert_user_error(run_cli("tiny-model", tmp_path / "m", "--arch", "qwen"), "--arch", "'qwen'",
                             *TINY_ARCHS)
    assert "bert" not in line and not (tmp_path / "m").exists()
