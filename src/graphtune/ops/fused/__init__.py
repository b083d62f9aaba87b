"""Fused decode ops: each a tunable op whose first runner is the unfused sequence of ops.

A decode layer in about five kernels (with decode attention between the first two):

* :func:`norm_qkv_rope` — RMSNorm prologue + QKV projection (+ bias) + RoPE + K/V cache write;
* :func:`norm_gate_up_silu` — RMSNorm prologue + gate/up projection + SiLU-and-mul (the step
  offers both of these with the norm in the GEMV's main loop, or as the RMSNorm kernel followed
  by the GEMV without a norm);
* :func:`add_projection` — ``x += a @ weight.T`` (output and down projections, residual in place);
* :func:`norm_linear` — RMSNorm prologue + a linear layer (the final norm and the LM head).

Runner 0, tactic ``-1`` of each is the unfused path through the existing tunable ops (each asks
the same tuner for its own pick), so the tuner decides per shape bucket between the fused
kernel's tactics and the unfused path (:mod:`graphtune.ops.fused._base`). The fused kernel is
the Triton GEMV family of :mod:`graphtune.ops.fused_gemv` (which the GEMM op's skinny-``M``
runner launches too), launched with programmatic dependent launch where the GPU supports it
(:mod:`graphtune.ops._pdl`). Importing this package imports neither Triton nor the kernels.
"""

from graphtune.ops.fused.mlp import (
    TritonGateUpSiluAfterNorm,
    TritonGateUpSiluNormInLoop,
    TritonGateUpSiluTiled,
    TritonNormGateUpSilu,
    UnfusedNormGateUpSilu,
    norm_gate_up_silu,
    norm_gate_up_silu_config,
    norm_gate_up_silu_runners,
    torch_norm_gate_up_silu,
)
from graphtune.ops.fused.projection import (
    TritonAddProjection,
    TritonNormLinear,
    TritonNormLinearInLoop,
    UnfusedAddProjection,
    UnfusedNormLinear,
    add_projection,
    add_projection_config,
    add_projection_runners,
    norm_linear,
    norm_linear_config,
    norm_linear_runners,
)
from graphtune.ops.fused.qkv import (
    TritonNormQkvRope,
    TritonQkvRopeAfterNorm,
    TritonQkvRopeNormInLoop,
    UnfusedNormQkvRope,
    norm_qkv_rope,
    norm_qkv_rope_config,
    norm_qkv_rope_runners,
)

__all__ = [
    "TritonAddProjection",
    "TritonGateUpSiluAfterNorm",
    "TritonGateUpSiluNormInLoop",
    "TritonGateUpSiluTiled",
    "TritonNormGateUpSilu",
    "TritonNormLinear",
    "TritonNormLinearInLoop",
    "TritonNormQkvRope",
    "TritonQkvRopeAfterNorm",
    "TritonQkvRopeNormInLoop",
    "UnfusedAddProjection",
    "UnfusedNormGateUpSilu",
    "UnfusedNormLinear",
    "UnfusedNormQkvRope",
    "add_projection",
    "add_projection_config",
    "add_projection_runners",
    "norm_gate_up_silu",
    "norm_gate_up_silu_config",
    "norm_gate_up_silu_runners",
    "norm_linear",
    "norm_linear_config",
    "norm_linear_runners",
    "norm_qkv_rope",
    "norm_qkv_rope_config",
    "norm_qkv_rope_runners",
    "torch_norm_gate_up_silu",
]
