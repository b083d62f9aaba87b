"""The mixture-of-experts MLP of the one forward.

A layer whose MLP is a mixture of experts (``LayerWeights.is_moe``) runs, in place of the dense
MLP stage (RMSNorm + gate/up + SiLU-and-mul, then the down projection + residual), one stage:

    h = rms_norm(x, mlp_norm)                                       [rows, hidden]
    logits = ops.gemm(h, router)                                    [rows, E]
    weights, ids = ops.route_top_k(logits, k, renormalize=norm_topk_prob)
    ops.fused_moe(h, experts_gate_up, experts_down, weights, ids, residual=x)   [x += experts]

through :meth:`graphtune.ops.OpContext.norm_moe_mlp`. Tuned, that is the fused op
:func:`graphtune.ops.fused.norm_moe_mlp`, whose runner 0 is this sequence of tunable ops and
whose Triton runner does it in three kernels at decode sizes (the router GEMV with the norm in
its prologue, then the experts' GEMVs, which normalise and route in their own prologue), so the
tuner decides per token bucket. Everything stays on the device with fixed shapes, so the whole
step can be captured in a CUDA graph. Untuned, ``fused_moe`` is its torch fallback: the loop over
the selected experts eagerly (one host synchronisation), the dense all-experts form while a
graph captures (capturable, but ``E / k`` times the work). The residual add happens inside the
stage (in place, in the Triton runners' last kernel), so the next layer's first stage keeps its
fused norm prologue.

The routing weights follow transformers: Qwen3-MoE casts them to the activations' dtype, Mixtral
keeps them in float32 (``ModelConfig.router_weights_in_float32``).
"""

from __future__ import annotations

import torch

from graphtune.engine.config import ModelConfig
from graphtune.engine.model import LayerWeights
from graphtune.ops.context import OpContext


def add_moe_mlp(
    ops: OpContext,
    x: torch.Tensor,
    layer: LayerWeights,
    config: ModelConfig,
    normed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MLP stage of a mixture-of-experts layer: ``x += experts(rms_norm(x))`` in place;
    returns ``x``. ``normed``: ``rms_norm(x, layer.mlp_norm)`` already computed (the stage
    hook's), so the norm is skipped."""
    return ops.norm_moe_mlp(
        x,
        layer.mlp_norm,
        config.rms_norm_eps,
        layer.router,
        layer.experts_gate_up,
        layer.experts_down,
        top_k=config.num_experts_per_tok,
        renormalize=config.norm_topk_prob,
        weights_dtype=torch.float32 if config.router_weights_in_float32 else x.dtype,
        normed=normed,
    )
