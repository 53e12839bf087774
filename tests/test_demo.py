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
