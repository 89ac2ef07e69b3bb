#!/usr/bin/env bash
# Create .venv (once) and install diffpipe-core, the model plugins (reference, flux, sdxl) and the dev tools.
# torch is pinned here, not in the packages: CI and these CPU machines use the 2.13.0 CPU build;
# on a GPU machine keep your own CUDA torch (set DIFFPIPE_TORCH to the spec you want, or "skip").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DIFFPIPE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
TORCH_SPEC=${DIFFPIPE_TORCH:-torch==2.13.0}
if [ "$TORCH_SPEC" != "skip" ]; then
  "$VENV/bin/python" -m pip install --quiet "$TORCH_SPEC"
fi
# compat editable mode puts each plugin's src/ on sys.path, so the distribution folders of the same name
# (diffpipe_flux/ holding src/diffpipe_flux/) never shadow the packages when run from the repo root
"$VENV/bin/python" -m pip install --quiet --config-settings editable_mode=compat \
  -e ".[dev]" -e tests/reference_plugin -e diffpipe_flux -e diffpipe_sdxl
echo "diffpipe: environment ready in $VENV"
