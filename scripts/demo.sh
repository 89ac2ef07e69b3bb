#!/usr/bin/env bash
# Set up .venv if needed, write a tiny random-weight model to demo/model in its real on-disk format,
# then cache the bundled sample dataset and train a LoRA for a few steps on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${DIFFPIPE_VENV:-.venv}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
mkdir -p demo
"$VENV/bin/python" -c "from diffpipe_reference.model import write_tiny_model; write_tiny_model('demo/model')"
"$VENV/bin/diffpipe" models
"$VENV/bin/diffpipe" validate --config examples/demo/run.toml
"$VENV/bin/diffpipe" data --config examples/demo/run.toml
"$VENV/bin/diffpipe" train --config examples/demo/run.toml --num-procs "${NUM_PROCS:-1}"
echo "diffpipe: the LoRA is in $(ls -d demo/runs/*/saved/final | tail -n 1)"
