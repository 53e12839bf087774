"""Dependencies: every one has a tested range in pyproject.toml (an upper bound before the next major
release), and tested-versions.txt (the exact versions the suite last passed with, which
GRPOKIT_TESTED_VERSIONS=1 makes scripts/bootstrap.sh install) lies inside those ranges."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
UNTESTED = {"wandb", "vllm"}  # not installed where the suite runs (wandb: an optional sink; vllm: CUDA)


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + [r for extra in project["optional-dependencies"].values()
                                                             for r in extra]]


def tested_versions() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "tested-versions.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_every_dependency_has_an_upper_bound():
    unbounded = [str(r) for r in requirements() if r.name not in {"wandb"}
                 and not any(s.operator in ("<", "<=", "==", "~=") for s in r.specifier)]
    assert not unbounded, f"give these a tested range (an upper bound at the next major release): {unbounded}"


def test_the_tested_versions_lie_in_the_ranges_and_cover_every_dependency():
    pins = tested_versions()
    for r in requirements():
        if r.name in UNTESTED:
            continue
        name = r.name.lower().replace("_", "-")
        assert name in pins, f"{name} is not in tested-versions.txt; rerun scripts/freeze_tested_versions.sh"
        assert r.specifier.contains(pins[name], prereleases=True), f"tested {name}=={pins[name]} is outside {r}"
    assert "+" not in "".join(pins.values())  # no local labels: torch==2.13.0 matches its CPU and CUDA builds
    assert pins["torch"] == (ROOT / "constraints.txt").read_text().split("==")[1].strip()


def test_the_bootstrap_uses_the_tested_versions_when_asked():
    text = (ROOT / "scripts" / "bootstrap.sh").read_text()
    assert 'GRPOKIT_TESTED_VERSIONS:-0}" = 1' in text and "-c tested-versions.txt" in text
    assert "scripts/bootstrap.sh" in (ROOT / "scripts" / "test.sh").read_text()


def test_the_agents_extra_installs_the_verifiers_whose_classic_environments_the_adapter_takes():
    """Issue 43 point 12: `verifiers>=0.3,<1` installed 0.4.0, which has no vf.ToolEnv, vf.SingleTurnEnv or vf.Rubric
    (its classic environments are gone), so the documented path failed on a fresh `pip install 'grpokit[agents]'`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extra in ("agents", "test"):
        (verifiers,) = [Requirement(r) for r in project["optional-dependencies"][extra] if r.startswith("verifiers")]
        assert verifiers.specifier.contains("0.3.1") and not verifiers.specifier.contains("0.4.0"), (extra, verifiers)
