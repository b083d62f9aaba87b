"""The mixture-of-experts MLP of the one forward, and Qwen3's q/k RMSNorm.

A layer whose MLP is a mixture of experts (``LayerWeights.is_moe``) runs, in place of the dense
gate/up GEMM, SiLU-and-mul and down GEMM:

    logits = ops.gemm(h, router)                                    [rows, E]
    weights, ids = ops.route_top_k(logits, k, renormalize=norm_topk_prob)
    out = ops.fused_moe(h, experts_gate_up, experts_down, weights, ids)

Everything stays on the device with fixed shapes (the router is softmax and top-k; the tuned
experts are the Triton sort and grouped GEMMs), so the whole step can be captured in a CUDA
graph. Untuned, ``fused_moe`` is its torch fallback: the loop over the selected experts eagerly
(one host synchronisation), the dense all-experts form while a graph captures (capturable, but
``E / k`` times the work). The router GEMM, the top-k routing and the experts go through the
step's :class:`~graphtune.ops.OpContext`, so ``tune_step`` tunes them like every other op.

The routing weights follow transformers: Qwen3-MoE casts them to the activations' dtype, Mixtral
keeps them in float32 (``ModelConfig.router_weights_in_float32``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphtune.engine.config import ModelConfig
from graphtune.engine.model import LayerWeights
from graphtune.ops.context import OpContext


def moe_experts(
    ops: OpContext, h: torch.Tensor, layer: LayerWeights, config: ModelConfig
) -> torch.Tensor:
    """The mixture-of-experts MLP of ``layer`` on the normed activations ``h [rows, hidden]``;
    returns ``[rows, hidden]`` (the residual is not added)."""
    logits = ops.gemm(h, layer.router)
    weights_dtype = torch.float32 if config.router_weights_in_float32 else logits.dtype
    weights, ids = ops.route_top_k(
        logits,
        config.num_experts_per_tok,
        renormalize=config.norm_topk_prob,
        weights_dtype=weights_dtype,
    )
    return ops.fused_moe(h, layer.experts_gate_up, layer.experts_down, weights, ids)


def qk_norm_weights(layer: LayerWeights, config: ModelConfig) -> torch.Tensor:
    """``[heads + kv_heads, head_dim]``: ``q_norm`` for every query head, then ``k_norm`` for
    every key head, the weight rows :func:`apply_qk_norm` multiplies by (built once per step)."""
    heads, kv_heads = config.num_heads, config.num_kv_heads
    return torch.cat([layer.q_norm.expand(heads, -1), layer.k_norm.expand(kv_heads, -1)])


def apply_qk_norm(qkv: torch.Tensor, weights: torch.Tensor, eps: float) -> None:
    """Qwen3's q/k RMSNorm, in place on the QKV projection ``qkv [rows, (H + 2 KV) * D]``:
    every query and key head normalised over its ``D`` values and scaled by its row of
    ``weights [H + KV, D]`` (:func:`qk_norm_weights`); the value heads are left alone.

    Rounding as transformers' ``Qwen3MoeRMSNorm``: float32 statistics, the normalised value
    rounded to the dtype, then multiplied by the weight in the dtype. Two kernels, no host sync.
    """
    heads, dim = weights.shape
    qk = qkv.unflatten(-1, (-1, dim))[:, :heads]
    torch.mul(F.rms_norm(qk, (dim,), eps=eps), weights, out=qk)
