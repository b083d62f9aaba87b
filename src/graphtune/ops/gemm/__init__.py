"""Tunable GEMM ``out = a @ weight.T (+ bias) (+ residual)``: cuBLAS through torch, and Triton.

The shape is the one of ``torch.nn.functional.linear``: ``a [M, K]`` activations, ``weight [N, K]``
(the layout a checkpoint stores), optional ``bias [N]``, and an optional ``residual [M, N]`` added
in the epilogue (``torch.addmm`` semantics, optionally in place like ``residual.addmm_``, which is
how the decode step folds its residual adds into the output projections). ``M`` (tokens in the
batch) is the dynamic dimension, tuned in power-of-two buckets; ``N`` and ``K`` are fixed per
weight.

Batches of at most 8 rows also get :class:`TritonGemvRunner`, a GEMV kernel without ``tl.dot``
that streams the weight once for all rows, and batches of at most 16 rows
:class:`TritonSkinnyGemmRunner`, the fused GEMV family of :mod:`graphtune.ops.fused_gemv` with
swapped operands on the tensor cores; :func:`gemm_runners` lists them last.

Modules: :mod:`~graphtune.ops.gemm.common` (the input rules, ``out=`` / in-place handling, the
split-K plumbing and the torch path every runner shares), :mod:`~graphtune.ops.gemm.tiled` (the
tiled Triton GEMM and its pruning rules), :mod:`~graphtune.ops.gemm.gemv` (the GEMV and its
rules), :mod:`~graphtune.ops.gemm.skinny` (the tensor-core skinny runner) and
:mod:`~graphtune.ops.gemm.op` (:func:`gemm`, :func:`gemm_config`,
:func:`gemm_runners`, :class:`TunableLinear`).
"""

from graphtune.ops.gemm.common import TorchGemmRunner, torch_gemm, unpack_gemm_inputs
from graphtune.ops.gemm.gemv import TritonGemvRunner, check_gemv_tactic, gemv_tactics
from graphtune.ops.gemm.op import OP_NAME, TunableLinear, gemm, gemm_config, gemm_runners
from graphtune.ops.gemm.skinny import TritonSkinnyGemmRunner
from graphtune.ops.gemm.tiled import TritonGemmRunner, check_gemm_tactic, gemm_tactics

__all__ = [
    "OP_NAME",
    "TorchGemmRunner",
    "TritonGemmRunner",
    "TritonGemvRunner",
    "TritonSkinnyGemmRunner",
    "TunableLinear",
    "check_gemm_tactic",
    "check_gemv_tactic",
    "gemm",
    "gemm_config",
    "gemm_runners",
    "gemm_tactics",
    "gemv_tactics",
    "torch_gemm",
    "unpack_gemm_inputs",
]
