"""`grpokit demo --quick`: the README's main command runs end to end (shortened), from the CLI."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_quick_runs_the_whole_pipeline(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "grpokit.cli", "demo", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for stage in ("before", "after"):
        assert 0.0 <= summary[stage]["accuracy"] <= 1.0 and "pass@8" in summary[stage]
    assert (out / "base" / "config.json").is_file() and (out / "sft" / "model.safetensors").is_file()
    assert len((out / "grpo" / "metrics.jsonl").read_text().splitlines()) == summary["grpo_steps"]
    assert "before GRPO" in r.stdout and "after GRPO" in r.stdout and "entropy per step" in r.stdout


def test_demo_out_that_is_a_file_or_not_a_demo_folder_is_one_error_and_touches_nothing(tmp_path, capsys):
    """`demo --out FILE` was a FileExistsError traceback; onto a model folder it wrote base/ sft/ grpo/
    summary.json among the model's files, exit 0."""
    from grpokit.cli import main
    from grpokit.demo import DEMO_FILES, prepare_demo_folder

    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cases = ((afile, "is a file"), (model, "holds files that are not an earlier demo run's (config.json)"))
    for task in ("addition", "tools"):
        for out, words in cases:
            assert main(["demo", "--quick", "--task", task, "--out", str(out)]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(f"error: --out {str(out)!r} {words}"), err
    assert afile.read_text() == "mine" and [p.name for p in model.iterdir()] == ["config.json"]
    earlier = tmp_path / "earlier"  # an earlier demo run (even one cut short) is what a rerun replaces
    for name in DEMO_FILES[:3]:
        (earlier / name).mkdir(parents=True)
    assert prepare_demo_folder(earlier) == earlier and prepare_demo_folder(tmp_path / "new" / "run").is_dir()
