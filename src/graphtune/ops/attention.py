"""Decode attention as a tunable op: which SDPA backend (or plain matmuls) is fastest per batch.

One decode token per request attends over a static KV cache. PyTorch's
``scaled_dot_product_attention`` picks a backend by rules, not by measurement, and for this shape
(a handful of query rows per KV head, a long key axis, an additive mask) the rule-picked backend
can be several times slower than another one at large batch. The tuner measures instead.

Inputs of every runner: ``[q, keys, values, mask]`` with ``q [B, kv_heads, groups, head_dim]``
(the query heads that share a KV head form that head's query "sequence"), ``keys`` and ``values``
``[B, kv_heads, seq, head_dim]``, and an additive ``mask [B, 1, 1, seq]``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from graphtune.autotuner import (
    FALLBACK_TACTIC,
    ConstraintSpec,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
)

OP_NAME = "decode_attention"


def _sdpa_backends() -> dict[str, Any]:
    """SDPA backends this torch build names (the cuDNN one arrived in torch 2.5)."""
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:  # torch < 2.3: only the default dispatch is available
        return {}
    names = {"cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
    return {tactic: getattr(SDPBackend, attr) for tactic, attr in names.items()
            if hasattr(SDPBackend, attr)}


class SdpaAttention(TunableRunner):
    """``F.scaled_dot_product_attention``; a tactic forces one backend.

    Tactic ``-1`` lets PyTorch choose (always valid). Flash attention is not offered: it takes no
    attention mask. A backend that rejects the shape raises, and the tuner records it as failed.
    """

    def get_valid_tactics(self, inputs: list[Any], profile: Any) -> list[Any]:
        backends = list(_sdpa_backends()) if inputs[0].is_cuda else []
        return [FALLBACK_TACTIC, *backends]

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC) -> torch.Tensor:
        q, keys, values, mask = inputs
        if tactic == FALLBACK_TACTIC:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(_sdpa_backends()[tactic]):
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class MatmulAttention(TunableRunner):
    """Attention as two batched matmuls around a float32 softmax: memory-bound like decode itself.

    Tactic ``-1`` keeps the scores in float32 through the softmax (the reference numerics);
    ``"low_precision"`` runs the softmax in the input dtype (one conversion kernel fewer).
    """

    def get_valid_tactics(self, inputs: list[Any], profile: Any) -> list[Any]:
        tactics: list[Any] = [FALLBACK_TACTIC]
        if inputs[0].dtype in (torch.float16, torch.bfloat16):
            tactics.append("low_precision")
        return tactics

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC) -> torch.Tensor:
        q, keys, values, mask = inputs
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = torch.matmul(q, keys.transpose(-1, -2))
        if tactic == FALLBACK_TACTIC:
            probs = torch.softmax(scores.float() * scale + mask.float(), dim=-1).to(q.dtype)
        else:
            probs = torch.softmax(torch.addcmul(mask, scores, scores.new_tensor(scale)), dim=-1)
        return torch.matmul(probs, values)


RUNNERS: tuple[TunableRunner, ...] = (SdpaAttention(), MatmulAttention())


def tuning_config(max_batch_size: int) -> TuningConfig:
    """Batch is the dynamic dimension (power-of-two buckets up to ``max_batch_size``); keys,
    values and mask follow it."""
    follow_batch = [ConstraintSpec(i, 0, lambda shapes: shapes[0][0]) for i in (1, 2, 3)]
    return TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0, _buckets),),
        constraint_specs=tuple(follow_batch),
        max_value=max_batch_size,
    )


def _buckets(max_value: int) -> tuple[int, ...]:
    from graphtune.autotuner import power_of_two_buckets

    return power_of_two_buckets(max_value)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor, *, tuner: Any, config: TuningConfig) -> torch.Tensor:
    """Runs decode attention with the tuner's pick for this batch size (the fallback when untuned).

    Args:
        q, keys, values, mask: See the module docstring.
        tuner: The :class:`~graphtune.autotuner.AutoTuner` to ask.
        config: From :func:`tuning_config`.
    """
    inputs = [q, keys, values, mask]
    runner, tactic = tuner.choose_one(OP_NAME, RUNNERS, config, inputs)
    return runner.forward(inputs, tactic)
