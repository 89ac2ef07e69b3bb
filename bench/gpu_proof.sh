#!/usr/bin/env bash
# The GPU proof: one prepared run on a lent GPU machine, within 8 minutes, and the same run on CPU in the suite.
#
#   bash bench/gpu_proof.sh                               # on the GPU machine (carry .whl with the tree)
#   DIFFPIPE_PROOF_DEVICE=cpu bash bench/gpu_proof.sh     # on CPU at tiny sizes: tests/test_gpu_proof.py runs it
#
# 1. install: the wheels in .whl/ (built by `python bench/proof_wheels.py`; bench/proof_wheels.txt says which and
#    what is left out, and why) go into a folder of their own, put with the repository's source folders on
#    PYTHONPATH (diffpipe itself travels as source). On CPU they are only checked to install for CPython 3.12
#    (when .whl/ exists) and this environment's packages are used. Left out, to fit in 64 MiB: HF datasets with
#    pyarrow and pandas (67 MB: the cache does not run on a GPU), bitsandbytes' libraries for CUDA before 12.6,
#    ROCm and XPU, and PyAV, tensorboard, wandb (not in the proof);
# 2. tests: the suite's cuda-marked tests (tests/test_cuda_proof.py: block swap, activation offload, nf4/int8/float8
#    bases, the Kahan optimizer, compile, sampling, 1-process training of the reference model and of a Flux-shaped
#    one, 2 stages over NCCL when there are two GPUs), each against the CPU's result; on CPU, their CPU twins.
#    Only that file: collecting the whole suite would import packages the GPU machine does not get (HF datasets);
# 3. memory: bench/gpu_memory.py, a Flux-dev-sized LoRA at 1024^2 in five variants (plain, checkpointing,
#    swap + offload, nf4, float8): peak memory, step time, MFU, losses; on CPU a tiny Flux;
# 4. $OUT/gpu_proof.log (all of the above as printed) and $OUT/gpu_proof.json (bench/proof_report.py: the same keys
#    on both devices). Each step has a time limit (wheels 60 s, tests 200 s, the memory bench what is left of 465 s),
#    so the JSON is written within 8 minutes whatever hangs.
#
# Environment: OUT (default: a new temporary folder), DIFFPIPE_PROOF_DEVICE (cuda, the default, or cpu),
# DIFFPIPE_PROOF_PYTHON (default: python3 on a GPU machine, else .venv/bin/python when there is one).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
DEVICE=${DIFFPIPE_PROOF_DEVICE:-cuda}
case "$DEVICE" in cuda | cpu) ;; *)
  echo "diffpipe: DIFFPIPE_PROOF_DEVICE=$DEVICE: use cuda or cpu" >&2
  exit 2
  ;;
esac
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LOG=$OUT/gpu_proof.log
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
TEE=$!
if [ -n "${DIFFPIPE_PROOF_PYTHON:-}" ]; then
  PY=$DIFFPIPE_PROOF_PYTHON
elif [ "$DEVICE" = cpu ] && [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
fi
# time limits (s): the whole run, the tests; the memory bench gets what is left but 15 s for the report
if [ "$DEVICE" = cpu ]; then
  TOTAL_LIMIT=900 TEST_LIMIT=480 MARKS="not cuda" MEMORY_ARGS="--small --device cpu --steps 8"
else
  TOTAL_LIMIT=465 TEST_LIMIT=200 MARKS="cuda" MEMORY_ARGS="--device cuda --steps 20"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 # only pytest itself: no plugin of this environment the GPU machine lacks
export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor TRITON_CACHE_DIR=$WORK/triton
START=$(date +%s)
step() { echo "diffpipe: [$1/4] $2 ($(($(date +%s) - START)) s in)"; }

step 1 "install the carried wheels"
PLATFORMS=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS="$PLATFORMS --platform $p"
done
SITE=$WORK/site
INSTALL_RC=0
if compgen -G ".whl/*.whl" >/dev/null; then
  if [ "$DEVICE" = cpu ]; then # a check only: this machine's Python may not be 3.12
    # shellcheck disable=SC2086
    timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      --python-version 3.12 --implementation cp $PLATFORMS --only-binary=:all: .whl/*.whl >"$WORK/install.txt" 2>&1
  else
    timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .whl/*.whl >"$WORK/install.txt" 2>&1
  fi
  INSTALL_RC=$?
  grep -v -i "warning" "$WORK/install.txt" | tail -n 20
  echo "diffpipe: $(compgen -G '.whl/*.whl' | wc -l) wheels installed (exit $INSTALL_RC)"
elif [ "$DEVICE" = cuda ]; then
  echo "diffpipe: no wheels in .whl/: build them with python bench/proof_wheels.py and carry .whl with the run"
  INSTALL_RC=3
else
  echo "diffpipe: no .whl/ here (python bench/proof_wheels.py builds it): using this environment's packages"
  INSTALL_RC=-1
fi
SOURCES=$REPO:$REPO/diffpipe_flux/src:$REPO/tests/reference_plugin
if [ "$DEVICE" = cuda ]; then
  export PYTHONPATH=$SITE:$SOURCES${PYTHONPATH:+:$PYTHONPATH}
  export PATH=$SITE/bin:$PATH
else # record what every process imports, to tell a package the GPU machine would lack
  mkdir -p "$WORK/imports"
  export PYTHONPATH=$REPO/bench/proof_imports:$SOURCES${PYTHONPATH:+:$PYTHONPATH}
  export DIFFPIPE_PROOF_IMPORTS=$WORK/imports
fi
"$PY" -c "import torch; print('diffpipe: torch', torch.__version__, 'CUDA', torch.version.cuda, 'devices', \
torch.cuda.device_count(), *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))"

step 2 "the cuda-marked tests ($MARKS), at most $TEST_LIMIT s"
T0=$(date +%s)
timeout -k 10 "$TEST_LIMIT" "$PY" -m pytest -p no:cacheprovider -v -rfEs -m "$MARKS" \
  tests/test_cuda_proof.py 2>&1 | tee "$WORK/tests.txt"
TEST_RC=${PIPESTATUS[0]}
TEST_SECONDS=$(($(date +%s) - T0))

MEMORY_LIMIT=$((TOTAL_LIMIT - 15 - 10 - ($(date +%s) - START)))
[ "$MEMORY_LIMIT" -ge 30 ] || MEMORY_LIMIT=30 # timeout 0 would mean none
step 3 "bench/gpu_memory.py $MEMORY_ARGS, at most $MEMORY_LIMIT s"
T0=$(date +%s)
# shellcheck disable=SC2086
timeout -k 10 "$MEMORY_LIMIT" "$PY" bench/gpu_memory.py $MEMORY_ARGS --json "$WORK/memory.json" 2>&1 |
  grep -v -e "kernels-community" -e "^\s*warnings.warn"
MEMORY_RC=${PIPESTATUS[0]}
MEMORY_SECONDS=$(($(date +%s) - T0))

step 4 "the report"
"$PY" bench/proof_report.py --device "$DEVICE" --work "$WORK" --out "$OUT/gpu_proof.json" \
  --install-rc "$INSTALL_RC" --tests-rc "$TEST_RC" --tests-seconds "$TEST_SECONDS" \
  --memory-rc "$MEMORY_RC" --memory-seconds "$MEMORY_SECONDS" --seconds "$(($(date +%s) - START))"
REPORT_RC=$?
exec >&- 2>&- # let tee write the last lines to the log before the run's files are collected
wait "$TEE"
exit "$REPORT_RC"
