#!/usr/bin/env bash
# GPU tests and every benchmark on the GPU machine; results (JSON, plots, logs) under $OUT.
# Usage (repo root): GRAPHTUNE_COMMIT=<sha> bash benchmarks/gpu_all.sh [PART] [--quick]
#   PART: tests | tuning | faults | timers | graphs | decode | all (default all). One device call
#   has a 10-minute limit, so a full run is split into two calls, e.g. "tests tuning faults" and
#   "timers graphs decode" (several parts may be given, space-separated, as the first argument).
# Every part runs even when an earlier one failed; the exit code is the number of failed parts.
set -u -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
PARTS=${1:-all}
QUICK=${2:-}
export PYTHONPATH=src PYTHONUNBUFFERED=1 GRAPHTUNE_NO_PROGRESS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GRAPHTUNE_COMMIT=${GRAPHTUNE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
failed=0
want() { [[ " $PARTS " == *" all "* || " $PARTS " == *" $1 "* ]]; }
step() {
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  if ! "$@" 2>&1 | tee "$OUT/$name.log"; then
    echo "!!! $name FAILED"; failed=$((failed + 1))
  fi
  echo "=== $name took $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
want tests && step tests python3 -m pytest -q -rfE --timeout=300 -p no:cacheprovider tests/gpu
want tuning && step tuning python3 benchmarks/tuning.py --out "$OUT" $QUICK
want faults && step faults python3 benchmarks/faults.py --out "$OUT" $QUICK
want timers && step timers python3 benchmarks/timers.py --out "$OUT" $QUICK
want graphs && step graphs python3 benchmarks/graph_runner.py --out "$OUT" $QUICK
want decode && step decode python3 -m graphtune bench decode --model llama-1b-shape \
  --batch-sizes 1,8,32,128 --compare-compile --json "$OUT/decode-h200.json" \
  --plot "$OUT/decode-h200.png"
echo "failed parts: $failed"
exit $failed
