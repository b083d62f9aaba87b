#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then every benchmark, results under $OUT (or ./out).
# Usage (from the repo root): GRAPHTUNE_COMMIT=<sha> bash benchmarks/gpu_all.sh [--quick]
# Each step runs even when an earlier one failed; the exit code is the number of failed steps.
set -u -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
QUICK=${1:-}
export PYTHONPATH=src PYTHONUNBUFFERED=1 GRAPHTUNE_NO_PROGRESS=1
export GRAPHTUNE_COMMIT=${GRAPHTUNE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
failed=0
step() {
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  if ! "$@" 2>&1 | tee -a "$OUT/gpu-run.log"; then
    echo "!!! $name FAILED"; failed=$((failed + 1))
  fi
  echo "=== $name took $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu-run.log"
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
step gpu-tests python3 -m pytest -q --timeout=300 -p no:cacheprovider tests/gpu
step timers python3 benchmarks/timers.py --out "$OUT" $QUICK
step graph-runner python3 benchmarks/graph_runner.py --out "$OUT" $QUICK
step decode python3 -m graphtune bench decode --model llama-1b-shape --batch-sizes 1,8,32,128 \
  --compare-compile --json "$OUT/decode-h200.json" --plot "$OUT/decode-h200.png"
echo "failed steps: $failed"
exit $failed
