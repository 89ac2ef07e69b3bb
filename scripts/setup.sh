#!/usr/bin/env bash
# Create .venv (once) and install diffpipe-core (with its wandb extra), the model plugins (reference, flux, sdxl,
# hunyuan, ltx, cosmos, and those under plugins/), the optimizers plugin (prodigy, schedule-free, torch-optimi,
# pytorch-optimizer) and the dev tools.
# torch is pinned here, not in the packages: CI and these CPU machines use the 2.13.0 CPU build;
# on a GPU machine keep your own CUDA torch (set DIFFPIPE_TORCH to the spec you want, or "skip").
# pip's and the build backends' own output goes to $VENV/setup.log (shown on failure; DIFFPIPE_VERBOSE=1 shows it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DIFFPIPE_VENV:-.venv}
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_quietly() {
  if [ -n "${DIFFPIPE_VERBOSE:-}" ]; then
    "$VENV/bin/python" -m pip "$@"
  elif ! "$VENV/bin/python" -m pip --quiet "$@" >>"$VENV/setup.log" 2>&1; then
    tail -n 40 "$VENV/setup.log" >&2
    echo "diffpipe: set-up failed: pip $*; the full log is $VENV/setup.log" >&2
    exit 1
  fi
}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  pip_quietly install --upgrade pip
fi
: >"$VENV/setup.log"
TORCH_SPEC=${DIFFPIPE_TORCH:-torch==2.13.0}
if [ "$TORCH_SPEC" != "skip" ]; then
  pip_quietly install "$TORCH_SPEC"
fi
# compat editable mode puts each plugin's src/ on sys.path, so the distribution folders of the same name
# (diffpipe_flux/ holding src/diffpipe_flux/) never shadow the packages when run from the repo root
# bench/proof_wheels.txt pins the versions CI tests (and the GPU proof carries), scripts/docs_tools.txt the manual's
# build tools: a library's new release reaches CI
# only when that file says so, never by surprise
pip_quietly install --config-settings editable_mode=compat -c bench/proof_wheels.txt -c scripts/docs_tools.txt \
  -e ".[dev,wandb]" -e tests/reference_plugin -e diffpipe_flux -e diffpipe_sdxl \
  -e diffpipe_hunyuan -e diffpipe_ltx -e diffpipe_cosmos -e plugins/diffpipe_optimizers -e plugins/diffpipe_wan \
  -e plugins/diffpipe_qwenimage -e plugins/diffpipe_zimage \
  -e plugins/diffpipe_sd3 -e plugins/diffpipe_auraflow -e plugins/diffpipe_krea -e plugins/diffpipe_lumina \
  -e plugins/diffpipe_ideogram -e plugins/diffpipe_hidream -e plugins/diffpipe_omnigen \
  -e plugins/diffpipe_ernie -e plugins/diffpipe_minimax
echo "diffpipe: environment ready in $VENV"
