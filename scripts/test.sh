#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (CPU, about 14 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
# the test command compares goldens, it never rewrites them (diffpipe_core/testing/golden.py)
if [[ -n "${DIFFPIPE_GOLDEN_WRITE:-}" ]]; then
    echo "scripts/test.sh: DIFFPIPE_GOLDEN_WRITE=$DIFFPIPE_GOLDEN_WRITE is set, which rewrites the golden manifests" \
        "instead of comparing them; unset it (to rewrite goldens, run their tests with it: they fail after writing)" >&2
    exit 2
fi
bash scripts/setup.sh
VENV=${DIFFPIPE_VENV:-.venv}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
"$VENV/bin/ruff" check .
# the manual (docs/, mkdocs.yml): generated pages fresh, no broken link, no page left out of the navigation; built into
# a temporary folder, quiet unless it fails
"$VENV/bin/python" -m diffpipe_core.manual --check
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
if ! NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --quiet --site-dir "$SITE" >"$SITE.log" 2>&1; then
    cat "$SITE.log" >&2; rm -f "$SITE.log"
    echo "scripts/test.sh: mkdocs build --strict failed (above)" >&2
    exit 1
fi
rm -f "$SITE.log"
# two xdist workers (the CI machine has 2 cores), one thread each: more threads than cores make OpenMP spin-wait
# (conftest.py keeps the tests that share a session fixture on one worker)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$VENV/bin/python" -m pytest -q -n "${DIFFPIPE_TEST_WORKERS:-2}" --durations=15 "$@"
