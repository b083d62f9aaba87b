"""The fused decode GEMV family: one Triton GEMV kernel, its tactics, launch and runner base.

The kernel (:mod:`graphtune.ops.fused_gemv._kernels`, needs Triton) streams a weight once with an
optional prologue (RMSNorm of the input rows) and epilogue (SiLU-and-mul of column pairs, RoPE
and the KV-cache write, bias and residual add); :mod:`graphtune.ops.fused_gemv.family` holds its
tactics (:func:`fused_gemv_tactics`) and launch code (:func:`launch_fused_gemv`), and
:class:`FusedTritonRunner` is the base of every runner that launches it. This package sits below
the two that use it, the GEMM op (:mod:`graphtune.ops.gemm`, its skinny-``M`` tensor-core
runner) and the fused stages (:mod:`graphtune.ops.fused`), and imports neither; importing it
imports neither Triton nor the kernel.
"""

from graphtune.ops.fused_gemv.family import (
    PLAIN,
    GemvShape,
    check_fused_tactic,
    fused_gemv_tactics,
    launch_fused_gemv,
)
from graphtune.ops.fused_gemv.runner import FusedTritonRunner

__all__ = [
    "PLAIN",
    "FusedTritonRunner",
    "GemvShape",
    "check_fused_tactic",
    "fused_gemv_tactics",
    "launch_fused_gemv",
]
