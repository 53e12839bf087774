"""The benchmark drivers' command lines: help works, and a wrong value is one usage error before any model is
built (bench/ is run by hand, after a performance change; a traceback there costs a ten-minute invocation)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", ["quick.py", "run.py"])
def test_help_is_printed(script):
    out = _bench(script, "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage:"), out.stderr


@pytest.mark.parametrize("args, said", [
    (["30", "SX"], "only: unknown configuration SX; choose from S,S6,SV,D"),
    (["-1"], "wait_s: must be 0 or more seconds, got -1"),
    (["soon"], "invalid float value: 'soon'"),
])
def test_quick_refuses_a_wrong_value_in_one_line(args, said):
    out = _bench("quick.py", *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith(said), out.stderr
