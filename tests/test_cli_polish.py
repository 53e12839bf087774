"""The command line explains itself: --version, help and defaults on every option, choices listed,
flag names in errors, and `grpokit config` (the resolved config, checked without a model)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fault_harness import assert_user_error, run_cli
from grpokit.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"grpokit {version('grpokit')}"


def test_every_option_of_every_command_has_help():
    parser = build_parser()
    commands = _subparsers(parser)
    assert {"train", "config", "eval", "sft", "demo", "report", "explain", "tiny-model"} <= set(commands)
    for name, sub in [("grpokit", parser), *commands.items()]:
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help.strip(), f"{name} {'/'.join(action.option_strings) or action.dest}"


@pytest.mark.parametrize("command, flag, default", [("sft", "--steps", "500"), ("sft", "--lr", "0.001"),
                                                    ("sft", "--batch-size", "64"), ("demo", "--seed", "0"),
                                                    ("eval", "--max-new-tokens", "32"), ("eval", "--seed", "0"),
                                                    ("tiny-model", "--arch", "qwen2")])
def test_help_shows_defaults(command, flag, default):
    text = " ".join(_subparsers(build_parser())[command].format_help().split())
    start = text.index(flag + " ", text.index("options:"))
    assert f"(default: {default}" in text[start:start + 300], text[start:start + 300]


def test_data_help_lists_the_file_formats():
    for command in ("eval", "sft"):
        text = " ".join(_subparsers(build_parser())[command].format_help().split())
        for fmt in ("JSONL", "JSON", "CSV", "Parquet", "save_to_disk folder"):
            assert fmt in text, (command, fmt)


def test_tiny_model_arch_typo_lists_the_short_list(tmp_path):
    from grpokit.models.tiny import TINY_ARCHS, TINY_VLM_ARCHS

    TINY_ARCHS = TINY_ARCHS + TINY_VLM_ARCHS  # the text families, then the vision-language ones
    r = run_cli("tiny-model", tmp_path / "m", "--arch", "qwen")
    line = assert_user_error(r, "--arch", "'qwen'", *TINY_ARCHS)
    assert "bert" not in r.stderr and len(line) < 300 and not (tmp_path / "m").exists()
    assert "{" + ",".join(TINY_ARCHS) + "}" in " ".join(_subparsers(build_parser())["tiny-model"].format_help()
                                                           .split())


@pytest.mark.parametrize("missing", ["--old", "--new"])
def test_explain_names_its_own_flags(missing, tiny_model_dir, tmp_path):
    folders = {"--old": str(tiny_model_dir), "--new": str(tiny_model_dir), missing: str(tmp_path / "nope")}
    r = run_cli("explain", *[w for kv in folders.items() for w in kv], "--prompt", "1+1=", "--answer", "2",
                "--device", "cpu")
    line = assert_user_error(r, missing, str(tmp_path / "nope"))
    assert "model.path" not in line


def test_config_prints_the_resolved_config_as_toml_and_json(capsys):
    code = main(["config", "examples/addition.toml", "--set", "train.steps=7", "--set", "algorithm.preset=gspo"])
    assert code == 0
    resolved = tomllib.loads(capsys.readouterr().out)
    assert resolved["train"]["steps"] == 7 and resolved["train"]["prompts_per_step"] == 16  # --set, the file
    assert resolved["algorithm"]["importance_sampling_level"] == "sequence"  # the preset
    assert resolved["train"]["max_grad_norm"] == 1.0 and resolved["tools"]["max_calls"] == 8  # defaults
    assert main(["config", "examples/addition.toml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["path"] == "runs/tiny-sft"


def test_config_rejects_a_bad_value_with_one_error_line():
    r = run_cli("config", ROOT / "examples" / "addition.toml", "--set", "rollout.group_size=1")
    assert_user_error(r, "rollout.group_size", "must be >= 2")
    assert r.stdout == ""
    r = run_cli("config", ROOT / "examples" / "addition.toml", "--set", "algorithm.loss_type=ppo")
    assert_user_error(r, "algorithm.loss_type", "'ppo'")


def test_config_does_not_import_torch():
    code = ("import sys\nfrom grpokit.cli import main\nrc = main(['config', 'examples/addition.toml'])\n"
            "assert 'torch' not in sys.modules, 'grpokit config imported torch'\nsys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_python_api_prints_no_transformers_progress_bars(tiny_model_dir, tmp_path):
    """train() and build_tiny_model() used to print transformers' "Loading weights" and "Writing model shards"
    bars on every load and checkpoint, around grpokit's own progress; a user's own bars stay on."""
    script = f"""
import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
from conftest import make_config, parity
from transformers.utils import logging
from grpokit.models.tiny import build_tiny_model
from grpokit.training.loop import train
build_tiny_model({str(tmp_path / "tiny")!r}, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)
train(make_config({str(tmp_path / "tiny")!r}, {str(tmp_path / "run")!r}, steps=2), reward_functions=[parity])
assert logging.is_progress_bar_enabled()
print("done")
"""
    import os

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}  # (grpokit.cli.main sets it)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**env, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and "done" in r.stdout, r.stderr[-2000:]
    for bar in ("Loading weights", "Writing model shards"):
        assert bar not in r.stderr + r.stdout, r.stderr[-2000:]


def test_tiny_model_tools_makes_a_model_a_tool_run_accepts(tmp_path):
    """`grpokit tiny-model` + a tool was refused (its template ignores tools); `--tools` gives the tool demo's
    template, and `grpokit train` with a tool runs on it."""
    (tmp_path / "my_tools.py").write_text('def add(a: int, b: int) -> int:\n    """Add two numbers.\n\n    Args:\n'
                                          '        a: The first.\n        b: The second.\n    """\n    return a + b\n')
    plain, tools = tmp_path / "plain", tmp_path / "tools"
    for out, extra in ((plain, []), (tools, ["--tools"])):
        assert main(["tiny-model", str(out), "--hidden-size", "32", "--layers", "1", *extra]) == 0
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""[model]
path = {json.dumps(str(tools))}
[data]
task = "addition"
num_prompts = 8
[rewards]
functions = ["addition"]
[tools]
functions = [{json.dumps(str(tmp_path / "my_tools.py") + ":add")}]
max_calls = 1
[rollout]
group_size = 2
max_new_tokens = 8
[train]
steps = 1
prompts_per_step = 2
[output]
dir = {json.dumps(str(tmp_path / "run"))}
console = false
""")
    refused = run_cli("train", cfg, "--set", f"model.path={json.dumps(str(plain))}")
    assert_user_error(refused, "the chat template ignores the tools")
    ran = run_cli("train", cfg)
    assert ran.returncode == 0 and "Traceback" not in ran.stderr, ran.describe()
    assert "tools/call_frequency" in (tmp_path / "run" / "metrics.jsonl").read_text()
