"""The router of a mixture-of-experts layer: softmax, top-k, optional renormalisation.

``route_top_k(router_logits, top_k, renormalize=..., weights_dtype=...)`` computes, per token,

    probs = softmax(float32(router_logits))          over the E experts
    weights, ids = topk(probs, k)                    (largest first)
    weights = weights / sum(weights)                 when ``renormalize``
    weights = weights.to(weights_dtype)

which is the router of transformers' Qwen3-MoE (``Qwen3MoeTopKRouter``: renormalised when the
config's ``norm_topk_prob`` is set, weights cast back to the logits' dtype) and Mixtral
(``MixtralTopKRouter``: always renormalised, weights kept in float32). Mixtral's paper writes the
router as a softmax over the top-k logits; that is the same number, since
``exp(l_i) / sum_topk exp(l_j)`` is ``p_i / sum_topk p_j``.

Rounding points: the softmax, the top-k and the renormalisation run in float32 (the logits are
converted once); the only rounding after that is the cast to ``weights_dtype``. Ties between equal
probabilities are broken as ``torch.topk`` breaks them (not by lowest index), which is the op
transformers uses, so both select the same experts on the same device.

Everything here is a fixed-shape torch op on the device (no host synchronisation), so it can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from graphtune.errors import ConfigError, InputError


def route_top_k(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    weights_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selects ``top_k`` experts per token and their routing weights.

    Args:
        router_logits: ``[T, E]`` router outputs (any float dtype).
        top_k: Experts per token, ``1 <= top_k <= E``.
        renormalize: Divide the selected probabilities by their sum (Qwen3-MoE's
            ``norm_topk_prob``; always for Mixtral).
        weights_dtype: dtype of the returned weights (Qwen3-MoE: the logits' dtype; Mixtral:
            float32).

    Returns:
        ``(topk_weights [T, k] weights_dtype, topk_ids [T, k] int64)``, largest weight first.

    Raises:
        InputError: ``router_logits`` is not a 2-D float tensor.
        ConfigError: ``top_k`` is not an int in ``[1, E]`` or ``weights_dtype`` is not a float
            dtype.
    """
    if router_logits.dim() != 2 or not router_logits.dtype.is_floating_point:
        raise InputError(
            f"route_top_k needs float router_logits [T, E], got {tuple(router_logits.shape)} "
            f"{router_logits.dtype}; flatten the leading dims of the logits first."
        )
    experts = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ConfigError(
            f"route_top_k: top_k must be an int in [1, E={experts}], got {top_k!r}; it is the "
            "config's num_experts_per_tok."
        )
    if not weights_dtype.is_floating_point:
        raise ConfigError(
            f"route_top_k: weights_dtype must be a float dtype, got {weights_dtype}; pass the "
            "logits' dtype (Qwen3-MoE) or torch.float32 (Mixtral)."
        )
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids
