#!/usr/bin/env bash
# The main job on a fresh machine: set up, then run the offline GRPO demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh math
exec .venv/bin/grpokit demo "$@"
