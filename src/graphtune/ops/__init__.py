"""Tunable ops for LLM decode: GEMM (cuBLAS and Triton) and fused kernels, each a set of runners.

Every op is a plain function that asks the autotuner which (runner, tactic) to run for the live
shape; outside tuning mode that is a cache look-up, and an untuned shape runs the torch fallback
(tactic ``-1``). Triton is optional: without it each op offers only its torch runner.

* :func:`gemm` / :class:`TunableLinear` — ``F.linear`` semantics; cuBLAS, a tiled Triton GEMM
  (block / warp / stage / split-K tactics), a Triton GEMV for one or two rows and a
  swapped-operand tensor-core GEMM for 2 to 16 (:mod:`graphtune.ops._pruned` says which offers
  tactics where).
* :func:`fused_add_rms_norm` — residual add + RMSNorm, returning ``(out, new_residual)``;
  :func:`head_rms_norm_` — per-head RMSNorm of q and k in a QKV output, in place (Qwen3);
  :func:`head_rms_norm` the same out of place.
* :func:`rope_kv_cache` — rotary embedding of q and k and the K/V cache write, returning ``q``.
* :func:`silu_and_mul` — SwiGLU activation on a fused gate/up tensor; :func:`gated_activation`
  for any activation of :data:`GATED_ACTIVATIONS` (SiLU through :func:`silu_and_mul`).
* :mod:`attention` — decode attention (SDPA backends, a matmul runner and a Triton
  flash-decoding kernel as runners).
* :mod:`fused` — fused decode ops (norm + projection + epilogue in one kernel) whose first runner
  is the unfused sequence of the ops above.
* :func:`fused_moe` / :func:`route_top_k` — mixture-of-experts experts and router (:mod:`moe`).
* :class:`OpContext` — the op settings of one model step (tuner, largest batch), bound once; a
  forward calls its ops through it (``ops.gemm(h, w)``).
* :mod:`registry` — op name -> how to rebuild its runners and config in another process
  (:func:`rebuild_call`, :func:`tune_records`: ``graphtune tune --from-misses``).

A model is tuned by running its step in tuning mode (``graphtune.engine.tuning.tune_step``), so the
keys tuned are the keys its ops look up.

Importing this package imports neither Triton nor the kernels.
"""

from graphtune.ops import attention, fused
from graphtune.ops._triton import TritonUnavailableError, require_triton, triton_available
from graphtune.ops.activation import (
    GATED_ACTIVATIONS,
    TorchSiluAndMulRunner,
    TritonSiluAndMulRunner,
    gated_activation,
    silu_and_mul,
    silu_and_mul_config,
    silu_and_mul_runners,
    torch_gated_activation,
    torch_silu_and_mul,
)
from graphtune.ops.context import OpContext
from graphtune.ops.gemm import (
    TorchGemmRunner,
    TritonGemmRunner,
    TritonGemvRunner,
    TunableLinear,
    check_gemm_tactic,
    check_gemv_tactic,
    gemm,
    gemm_config,
    gemm_runners,
    gemm_tactics,
    gemv_tactics,
)
from graphtune.ops.moe import (
    TorchFusedMoeRunner,
    TritonFusedMoeRunner,
    fused_moe,
    fused_moe_config,
    fused_moe_runners,
    route_top_k,
    torch_route_top_k,
)
from graphtune.ops.registry import (
    OpSpec,
    rebuild_call,
    register_op,
    registered_ops,
    tune_records,
)
from graphtune.ops.rmsnorm import (
    TorchRMSNormRunner,
    TritonRMSNormRunner,
    fused_add_rms_norm,
    head_norm_weights,
    head_rms_norm,
    head_rms_norm_,
    rms_norm_config,
    rms_norm_runners,
    torch_rms_norm,
)
from graphtune.ops.rope_config import rope_config
from graphtune.ops.rotary import (
    RopeRows,
    TorchRopeRunner,
    TritonRopeRunner,
    rope_kv_cache,
    rope_runners,
    torch_rope_kv_cache,
)

__all__ = [
    "GATED_ACTIVATIONS",
    "OpContext",
    "OpSpec",
    "RopeRows",
    "TorchFusedMoeRunner",
    "TorchGemmRunner",
    "TorchRMSNormRunner",
    "TorchRopeRunner",
    "TorchSiluAndMulRunner",
    "TritonFusedMoeRunner",
    "TritonGemmRunner",
    "TritonGemvRunner",
    "TritonRMSNormRunner",
    "TritonRopeRunner",
    "TritonSiluAndMulRunner",
    "TritonUnavailableError",
    "TunableLinear",
    "attention",
    "check_gemm_tactic",
    "check_gemv_tactic",
    "fused",
    "fused_add_rms_norm",
    "fused_moe",
    "fused_moe_config",
    "fused_moe_runners",
    "gated_activation",
    "gemm",
    "gemm_config",
    "gemm_runners",
    "gemm_tactics",
    "gemv_tactics",
    "head_norm_weights",
    "head_rms_norm",
    "head_rms_norm_",
    "require_triton",
    "rebuild_call",
    "register_op",
    "registered_ops",
    "rms_norm_config",
    "rms_norm_runners",
    "rope_config",
    "rope_kv_cache",
    "rope_runners",
    "route_top_k",
    "silu_and_mul",
    "silu_and_mul_config",
    "silu_and_mul_runners",
    "torch_gated_activation",
    "torch_rms_norm",
    "torch_rope_kv_cache",
    "torch_route_top_k",
    "torch_silu_and_mul",
    "triton_available",
    "tune_records",
]
