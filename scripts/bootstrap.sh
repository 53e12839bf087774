#!/usr/bin/env bash
# Create .venv (if missing) and install grpokit with the given extras.
# torch is installed first and pinned through constraints.txt, so no later
# requirement can replace it with a multi-GB CUDA build. With GRPOKIT_TESTED_VERSIONS=1
# every package is held at the exact version the suite last passed with (tested-versions.txt);
# otherwise pip picks the newest within pyproject.toml's ranges.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=".venv/.grpokit-installed-${extras:-core}"
constraints=(-c constraints.txt)
if [ "${GRPOKIT_TESTED_VERSIONS:-0}" = 1 ]; then
  constraints+=(-c tested-versions.txt)
  stamp="$stamp-tested"
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ] \
    || { [ "${GRPOKIT_TESTED_VERSIONS:-0}" = 1 ] && [ tested-versions.txt -nt "$stamp" ]; }; then
  .venv/bin/python -m pip install -q "${constraints[@]}" "torch==2.13.0"
  spec="."
  [ -n "$extras" ] && spec=".[$extras]"
  .venv/bin/python -m pip install -q "${constraints[@]}" -e "$spec"
  rm -f ".venv/.grpokit-installed-${extras:-core}" ".venv/.grpokit-installed-${extras:-core}-tested"  # the other mode's
  touch "$stamp"
fi
