#!/usr/bin/env bash
# Set up .venv if needed, write a tiny random-weight Flux to demo/flux-tiny in the diffusers folder layout,
# then cache the bundled sample dataset (examples/sample_dataset) and train a LoRA for a few steps on CPU.
# DEMO_MODEL=reference trains the core's tiny reference DiT instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${DIFFPIPE_VENV:-.venv}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
mkdir -p demo
if [ "${DEMO_MODEL:-flux}" = "reference" ]; then
  "$VENV/bin/python" -c "from diffpipe_reference.model import write_tiny_model; write_tiny_model('demo/model')"
  CONFIG=examples/demo/run.toml
else
  "$VENV/bin/python" -m diffpipe_flux.testing demo/flux-tiny
  CONFIG=diffpipe_flux/examples/run.toml
fi
"$VENV/bin/diffpipe" models
"$VENV/bin/diffpipe" validate --config "$CONFIG"
"$VENV/bin/diffpipe" data --config "$CONFIG"
# its last line, the demo's last: the mean loss of the first and the last quarter of the steps, and where the LoRA is
"$VENV/bin/diffpipe" train --config "$CONFIG" --num-procs "${NUM_PROCS:-1}"
