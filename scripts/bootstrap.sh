#!/usr/bin/env bash
# Create .venv (if missing) and install grpokit with the given extras.
# torch is installed first and pinned through constraints.txt, so no later
# requirement can replace it with a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=".venv/.grpokit-installed-${extras:-core}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0"
  spec="."
  [ -n "$extras" ] && spec=".[$extras]"
  .venv/bin/python -m pip install -q -c constraints.txt -e "$spec"
  touch "$stamp"
fi
