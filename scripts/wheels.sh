#!/usr/bin/env bash
# Build the wheels of diffpipe-core and of every model plugin in this repository into dist/ (or $1), to install
# diffpipe where there is no clone: pip install dist/*.whl (after the torch build you want: the wheels do not pin
# it). Uses .venv's pip (scripts/setup.sh makes it) and the build backend from pip's cache or the index.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-dist}
VENV=${DIFFPIPE_VENV:-.venv}
PYTHON=$([ -x "$VENV/bin/python" ] && echo "$VENV/bin/python" || echo python3)
"$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$OUT" \
  ./ ./diffpipe_flux ./diffpipe_sdxl ./diffpipe_hunyuan ./diffpipe_ltx ./diffpipe_cosmos \
  ./plugins/diffpipe_wan ./plugins/diffpipe_qwenimage ./plugins/diffpipe_zimage ./plugins/diffpipe_sd3 \
  ./plugins/diffpipe_auraflow ./plugins/diffpipe_krea ./plugins/diffpipe_lumina ./plugins/diffpipe_ideogram ./plugins/diffpipe_hidream \
  ./plugins/diffpipe_omnigen ./plugins/diffpipe_ernie ./plugins/diffpipe_minimax
ls "$OUT"/*.whl
echo "diffpipe: wheels in $OUT; install with: pip install $OUT/*.whl"
