#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (CPU, about 27 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${DIFFPIPE_VENV:-.venv}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
"$VENV/bin/ruff" check .
"$VENV/bin/python" -m pytest -q --durations=15 "$@"
