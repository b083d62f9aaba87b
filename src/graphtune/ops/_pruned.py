"""Row counts at which a runner offers no tactics, because it measured far from the best there.

A pruned candidate is never compiled or timed, which is most of what cold tuning costs. Every
runner that reads a limit lists this module in its ``source_modules``, so editing a limit changes
the runner's cache identity and its picks are tuned again. Each
limit below comes from the per-candidate table of a cold whole-model tuning run
(``candidates_table`` of ``benchmarks/results/tuning-time-h200-25accda.json``: Llama-1B's decode
ops at buckets 1 to 128 on the H200, every candidate's time as the tuner measured it). Rerun the
count with ``python3 benchmarks/pruning_evidence.py FILE`` on a newer run of
``benchmarks/tuning_time.py``. In that table:

* :data:`GEMV_MAX_ROWS`: at 4 and 8 rows none of the Triton GEMV's 102 candidates came within 5%
  of its profile's best (the tensor-core skinny GEMM and cuBLAS win there).
* :data:`TILED_GEMM_MIN_ROWS`: from 2 to 16 rows the tiled GEMM (``bm`` 16) won 2 of 32 profiles,
  by 0.6% and 0.2% over the swapped-operand skinny GEMM, which covers these rows with the same
  tensor-core tiles; its 232 candidates there were 15% of the run's. The rule holds only where
  the skinny GEMM takes the inputs (unit strides along ``K``) and offers tactics for them (it
  offers none for small ``N`` or ``K``, say a router of 8 experts).
* :data:`ADD_PROJECTION_MIN_ROWS`: at 1 and 2 rows none of the fused residual projection's 54
  candidates came within 5% (the GEMM op with the residual in its epilogue won every profile).
* :data:`QKV_AFTER_NORM_MIN_ROWS`: at 1 and 2 rows none of the norm-first fused QKV's 27
  candidates came within 5% (the norm-in-loop kernel won at 1 row, the unfused ops at 2).
* :data:`NORM_LINEAR_IN_LOOP_MIN_ROWS`: up to 4 rows none of the norm-in-loop LM head's 38
  candidates came within 5% (the unfused norm and GEMM won every profile of the op).

Two limits on the elementwise kernels' tactics come from three such runs (that one and the two of
``benchmarks/results/tuning-time-h200-s49-*.json``), 8 profiles each, rows of 2048 and 8192:

* :data:`RMS_NORM_ONE_PASS_UP_TO`: none of the 192 two-pass RMSNorm candidates (blocks of 512 and
  1024 on a 2048-wide row) came within 5%; the one-pass block won every profile.
* :data:`SILU_MAX_PER_THREAD`: none of the 96 SiLU-and-mul candidates with 16 elements per thread
  came within 5%.

The one-kernel decode attention (``graphtune.ops.attention.TritonDecodeAttentionOneKernel``) is
left out of the op's default runners for the same reason: none of its 45 candidates came within
5%, and forced into the tuned step it was slower than the split + combine pair at every tactic
(``benchmarks/results/README.md``, "Decode attention in the step").
"""

from __future__ import annotations

# The runners read these at call time (``_pruned.NAME``), so a test can lift a limit.

#: Largest bucket for which the Triton GEMV offers tactics.
GEMV_MAX_ROWS = 2
#: Smallest bucket for which the tiled Triton GEMM offers tactics (when the skinny GEMM applies).
TILED_GEMM_MIN_ROWS = 17
#: Smallest bucket for which the fused GEMV with the residual add offers tactics.
ADD_PROJECTION_MIN_ROWS = 3
#: Smallest bucket for which the norm-first fused QKV + RoPE kernel offers tactics.
QKV_AFTER_NORM_MIN_ROWS = 3
#: Smallest bucket for which the norm-in-loop fused LM head offers tactics.
NORM_LINEAR_IN_LOOP_MIN_ROWS = 5
#: Longest row for which RMSNorm offers only the one-pass (whole-row) block.
RMS_NORM_ONE_PASS_UP_TO = 2048
#: Most elements per thread a SiLU-and-mul tactic may give each thread.
SILU_MAX_PER_THREAD = 8
