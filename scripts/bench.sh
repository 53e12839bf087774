#!/usr/bin/env bash
# grpokit vs TRL's GRPOTrainer on this machine (see BENCHMARKS.md): set up, then run bench/run.py.
# Arguments go to bench/run.py, e.g. --only S,M or --ablations. Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test  # the test extra carries TRL
exec .venv/bin/python bench/run.py "$@"
