#!/usr/bin/env bash
# GPU tests and every benchmark on the GPU machine; results (JSON, plots, logs) under $OUT.
# Usage (repo root): GRAPHTUNE_COMMIT=<sha> bash benchmarks/gpu_all.sh [PART] [--quick]
#   PART: tests | tuning | tuning-time | faults | timers | graphs | decode | tuned | moe |
#   moe-decode | qwen3 | trace | attention | gemv | gemm | tp | all (default all); moe-decode is the
#   Qwen3-30B-A3B-shape decode step (estimated 4 minutes alone); trace lays out one replay of the
#   tuned Llama-1B and Qwen3-30B-A3B steps kernel by kernel (about a minute); attention sweeps
#   decode attention's whole tactic space at the Llama-1B shape (about 1.5 minutes); gemv sweeps
#   the fused GEMV's tactic space at the Llama-1B projections, batches 8 and 16; gemm sweeps
#   the tiled GEMM's tactic space beside cuBLAS at those projections, batch 128 (about 1.5 minutes);
#   targets (not part of "all"; about 7 minutes, one device call) measures every open issue's
#   target at one commit: the tuned Llama-1B step at 1, 8 and 128 rows beside transformers'
#   compiled recipe, the Qwen3-30B-A3B shape at 1 and 64 rows and the Llama-3-8B shape at 1 row
#   against their floors, cold and warm tuning time, and pick quality (graph mode, 3 runs),
#   into $OUT/targets-<commit>-<gpu>/ and one .tar.gz of it (the last two steps exit 1, counted
#   as failed parts, when a target is missed);
#   tp (two GPUs, kind nvidia-h200-x2; not part of "all") runs the all-reduce benchmark, tuned
#   (TP=1) and TP=2 tuned / NCCL decode. One device call
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
# Whole-step tuning, cold and warm, with compile worker processes (default) and threads only.
want tuning-time && step tuning-time python3 benchmarks/tuning_time.py --out "$OUT" \
  --model llama-1b-shape --max-batch 128
want tuning-time && step tuning-time-threads python3 benchmarks/tuning_time.py --out "$OUT" \
  --model llama-1b-shape --max-batch 128 --compile-processes 0 --label threads
want moe && step moe python3 benchmarks/moe.py --out "$OUT" $QUICK
want faults && step faults python3 benchmarks/faults.py --out "$OUT" $QUICK
want timers && step timers python3 benchmarks/timers.py --out "$OUT" $QUICK
want graphs && step graphs python3 benchmarks/graph_runner.py --out "$OUT" $QUICK
want graphs && step graph-capture python3 benchmarks/graph_capture.py --out "$OUT" $QUICK
want graphs && step prefill python3 benchmarks/prefill.py --out "$OUT" $QUICK
want graphs && step memory-plan python3 benchmarks/memory_plan.py --out "$OUT" $QUICK
want decode && step decode python3 -m graphtune bench decode --model llama-1b-shape \
  --batch-sizes 1,8,32,128 --compare-compile --json "$OUT/decode-h200.json" \
  --plot "$OUT/decode-h200.png"
# The Qwen3-30B-A3B-shape MoE step: eager, graph, tuned graph, its bytes floor, transformers
# (eager on the same weights: --compare-hf's anchor for MoE models, with the logits check).
want moe-decode && step moe-decode python3 -m graphtune bench decode \
  --model qwen3-30b-a3b-shape --batch-sizes 1,8,64 --tune --compare-hf --steps 10 --repeats 3 \
  --json "$OUT/decode-moe-qwen3-30b-a3b-h200.json"
# Qwen3-1.7B's shape (per-head q/k norms, head_dim 128): eager, graph and tuned graph.
want qwen3 && step qwen3 python3 -m graphtune bench decode --model qwen3-1.7b-shape \
  --batch-sizes 1,8,32,128 --tune --runner both --json "$OUT/decode-qwen3-1.7b-h200.json"
# Where the tuned steps' time goes, kernel by kernel (one CUPTI-traced graph replay each).
want trace && step step-trace-1b python3 benchmarks/step_trace.py --out "$OUT" \
  --model llama-1b-shape --batches 1,8
want trace && step step-trace-moe python3 benchmarks/step_trace.py --out "$OUT" \
  --model qwen3-30b-a3b-shape --batches 1
# Decode attention's whole Triton tactic space against what the tuner is offered.
want attention && step attention-sweep python3 benchmarks/attention_sweep.py --out "$OUT" \
  --batches 1,8,32,128
# The fused GEMV's tactic space (split-K included) at the decode projections.
want gemv && step gemv-sweep python3 benchmarks/gemv_sweep.py --out "$OUT" --batches 8,16
# The tiled GEMM's tactic space beside cuBLAS where cuBLAS serves the step (128 rows).
want gemm && step gemm-sweep python3 benchmarks/gemm_sweep.py --out "$OUT" --batches 128
# The tuned single-GPU step (also TP=1, the baseline of tp): eager, graph and tuned graph.
tuned_decode() {
  step tuned python3 -m graphtune bench decode --model llama-1b-shape --batch-sizes 1,8,32,128 \
    --tune --runner both --json "$OUT/decode-tuned-h200.json"
}
if [[ " $PARTS " == *" tp "* ]]; then
  step allreduce python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    benchmarks/allreduce.py --out "$OUT"
  tuned_decode
  step tp2 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m graphtune bench \
    decode --model llama-1b-shape --batch-sizes 1,8,32,128 --tp 2 --tune --runner both \
    --json "$OUT/decode-tp2-h200.json"
  step tp2-nccl python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m graphtune \
    bench decode --model llama-1b-shape --batch-sizes 1,8,32,128 --tp 2 --all-reduce nccl \
    --runner graph --json "$OUT/decode-tp2-nccl-h200.json"
elif want tuned; then
  tuned_decode
fi
if [[ " $PARTS " == *" targets "* ]]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-')
  tag="$GRAPHTUNE_COMMIT-$gpu"
  # Every file of the part in one folder, and that folder in one archive at the end.
  ALL_OUT=$OUT; OUT="$ALL_OUT/targets-$tag"; mkdir -p "$OUT"
  step targets-1b python3 -m graphtune bench decode --model llama-1b-shape --batch-sizes 1,8,128 \
    --tune --runner graph --compare-hf --repeats 7 --json "$OUT/decode-hf-$tag.json"
  for b in 1 64; do
    step "targets-qwen3-b$b" python3 -m graphtune bench decode --model qwen3-30b-a3b-shape \
      --batch-sizes $b --tune --runner graph --steps 10 --repeats 3 \
      --json "$OUT/decode-moe-$tag-b$b.json"
  done
  step targets-8b python3 -m graphtune bench decode --model llama-3-8b-shape --batch-sizes 1 \
    --tune --runner graph --steps 10 --repeats 3 --json "$OUT/decode-8b-$tag-b1.json"
  step targets-tuning-time python3 benchmarks/tuning_time.py --out "$OUT"
  step targets-pick-quality python3 benchmarks/tuning.py --out "$OUT" --modes graph --runs 3
  OUT=$ALL_OUT; tar -czf "$OUT/targets-$tag.tar.gz" -C "$OUT" "targets-$tag"
fi
echo "failed parts: $failed"
exit $failed
