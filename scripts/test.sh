#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up, lint (ruff, pyproject.toml), then run pytest.
# Slow tests run only with GRPOKIT_SLOW=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
# chromium for the HTML-report browser test; once it is there, that test may not skip
if bash scripts/ensure_chromium.sh; then export GRPOKIT_REQUIRE_BROWSER="${GRPOKIT_REQUIRE_BROWSER:-1}"; fi
# bubblewrap for the code sandbox's hostile-answer tests; once it is there, they may not skip
if bash scripts/ensure_bubblewrap.sh; then export GRPOKIT_REQUIRE_SANDBOX="${GRPOKIT_REQUIRE_SANDBOX:-1}"; fi
.venv/bin/ruff check src tests bench scripts
# Two test workers (pytest-xdist): most tests wait on a process start or a file, so two share the two cores
# well (13 min instead of 19 here); each worker uses one torch thread. GRPOKIT_TEST_WORKERS=0 runs them in turn.
workers="${GRPOKIT_TEST_WORKERS:-2}"
if [ "$workers" = 0 ]; then exec .venv/bin/python -m pytest -q "$@"; fi
exec .venv/bin/python -m pytest -q -n "$workers" "$@"
