"""The mixture-of-experts MLP of the one forward.

A layer whose MLP is a mixture of experts (``LayerWeights.is_moe``) runs, in place of the dense
MLP stage (RMSNorm + gate/up + SiLU-and-mul, then the down projection + residual):

    h = rms_norm(x, mlp_norm)                                       [rows, hidden]
    weights, ids = ops.moe_router(h, router, k, renormalize=norm_topk_prob)
        (tuned: the router GEMM then the routing, or one fused kernel)
    ops.fused_moe(h, experts_gate_up, experts_down, weights, ids, residual=x)   [x += experts]

Everything stays on the device with fixed shapes (the router is softmax and top-k; the tuned
experts are the Triton sort and grouped GEMMs), so the whole step can be captured in a CUDA
graph. Untuned, ``fused_moe`` is its torch fallback: the loop over the selected experts eagerly
(one host synchronisation), the dense all-experts form while a graph captures (capturable, but
``E / k`` times the work). The norm, the router (GEMM and top-k routing) and the experts go
through the step's :class:`~graphtune.ops.OpContext`, so ``tune_step`` tunes them like every
other op. The residual add happens inside the op (in place, in the Triton runners' last kernel),
so the next layer's first stage keeps its fused norm prologue.

The routing weights follow transformers: Qwen3-MoE casts them to the activations' dtype, Mixtral
keeps them in float32 (``ModelConfig.router_weights_in_float32``).
"""

from __future__ import annotations

import torch

from graphtune.engine.config import ModelConfig
from graphtune.engine.model import LayerWeights
from graphtune.ops.context import OpContext


def moe_experts(
    ops: OpContext,
    h: torch.Tensor,
    layer: LayerWeights,
    config: ModelConfig,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mixture-of-experts MLP of ``layer`` on the normed activations ``h [rows, hidden]``;
    returns ``[rows, hidden]``, or with ``residual`` adds it to that in place and returns it."""
    weights_dtype = torch.float32 if config.router_weights_in_float32 else h.dtype
    weights, ids = ops.moe_router(
        h,
        layer.router,
        config.num_experts_per_tok,
        renormalize=config.norm_topk_prob,
        weights_dtype=weights_dtype,
    )
    return ops.fused_moe(
        h, layer.experts_gate_up, layer.experts_down, weights, ids, residual=residual
    )


def add_moe_mlp(
    ops: OpContext,
    x: torch.Tensor,
    layer: LayerWeights,
    config: ModelConfig,
    normed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MLP stage of a mixture-of-experts layer: ``x += moe_experts(rms_norm(x))`` in place;
    returns ``x``. ``normed``: ``rms_norm(x, layer.mlp_norm)`` already computed (the stage
    hook's), so the norm is skipped."""
    h = normed if normed is not None else ops.rms_norm(x, layer.mlp_norm, config.rms_norm_eps)
    return moe_experts(ops, h, layer, config, residual=x)
