#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up, then run pytest.
# Slow tests run only with GRPOKIT_SLOW=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
exec .venv/bin/python -m pytest -q "$@"
