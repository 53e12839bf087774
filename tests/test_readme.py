"""The README runs as written: its "Train on your own data" commands, in order, then its Python
example, in a fresh folder holding only the repository's examples/. Step counts are cut so the test
stays short (the substitutions are listed below and each must apply); everything else is the
README's text."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# README text -> the test's, so that a CI run takes a minute, not ten
QUICK = [
    ("--steps 1500", "--steps 60"),                    # the SFT warm start
    ("train.steps=200", "train.steps=4"),              # the resumed run: 2 -> 4 steps
    ("checkpoint-200", "checkpoint-4"),
    ("steps=20,", "steps=2,"),                          # the Python example
]


def readme_blocks(kind: str, after: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(after):]
    return re.findall(rf"```{kind}\n(.*?)```", section, re.DOTALL)


def quick(text: str, used: set) -> str:
    for old, new in QUICK:
        if old in text:
            used.add(old)
            text = text.replace(old, new)
    return text


def test_the_readme_train_on_your_own_data_section_runs_in_order(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    used: set = set()
    bash = readme_blocks("bash", "## Train on your own data")[0]
    commands = [line.split("  #")[0].strip() for line in bash.splitlines() if line.strip()]
    assert all(c.startswith(".venv/bin/grpokit ") for c in commands), commands
    for command in commands:
        args = shlex.split(quick(command, used))[1:]
        if args[0] == "train" and not any(a.startswith("train.steps=") for a in args):
            args += ["--set", "train.steps=2"]
        r = subprocess.run([sys.executable, "-m", "grpokit.cli", *args], cwd=tmp_path, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    assert 0.0 <= json.loads(r.stdout)["accuracy"] <= 1.0  # the last command: eval --json
    assert (tmp_path / "runs" / "sums" / "metrics.jsonl").is_file()
    assert (tmp_path / "runs" / "addition-kl" / "metrics.jsonl").is_file()

    python = readme_blocks("python", "## Train on your own data")[0]
    r = subprocess.run([sys.executable, "-c", quick(python, used)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "python" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and "rewards/correct/mean" in rows[0]
    assert used == {old for old, _ in QUICK}, f"README text the test expected is gone: {set(dict(QUICK)) - used}"
