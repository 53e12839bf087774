#!/usr/bin/env bash
# TRL's own GRPO tests, fetched (not committed: they are TRL's code) into this folder, at the TRL version
# pyproject.toml pins (trl==1.16.0). Then run them against the drop-in (tests/trl_upstream/conftest.py):
#     bash tests/trl_upstream/fetch.sh
#     GRPOKIT_TRL_UPSTREAM=dropin .venv/bin/python -m pytest -q tests/trl_upstream -k <subset>
# GRPOKIT_TRL_UPSTREAM=trl runs the same tests against TRL itself (which of them TRL passes offline here).
set -euo pipefail
cd "$(dirname "$0")"
tag="${1:-v1.16.0}"
for f in test_grpo_trainer.py testing_utils.py; do
  curl -fsSL "https://raw.githubusercontent.com/huggingface/trl/$tag/tests/$f" -o "$f"
done
echo "fetched TRL $tag's tests/test_grpo_trainer.py and tests/testing_utils.py into $(pwd)"
