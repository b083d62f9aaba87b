"""Attention, the one piece of the forward that differs between decode and prefill.

The forward (:meth:`graphtune.engine.step.DecodeStep.forward`) runs a flat batch of tokens; after
each layer's RoPE + K/V write it calls ``attention(layer, q)`` with ``q [rows, heads, head_dim]``
and expects ``[rows, heads * head_dim]`` back. Both kinds read keys and values from the KV cache,
where the forward has just written this batch's:

* :class:`DecodeAttention`: one token per request, attending over every cached position of its
  slot (static shapes, capturable), through the tunable decode-attention op;
* :class:`PrefillAttention`: one prompt, causal over itself, with torch SDPA (eager: every
  prompt has its own length).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from graphtune.engine.kv_cache import KVCache
from graphtune.engine.model import DecoderModel
from graphtune.ops.context import OpContext


class StepState(Protocol):
    """What attention reads of the step (:class:`~graphtune.engine.step.DecodeStep` has it)."""

    model: DecoderModel
    cache: KVCache
    contiguous_slots: bool
    key_positions: torch.Tensor
    zero: torch.Tensor
    neg_inf: torch.Tensor
    groups: int


class Attention(Protocol):
    """What the forward calls once per layer."""

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention output ``[rows, heads * head_dim]`` of layer ``layer`` for ``q``."""
        ...


def causal_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    zero: torch.Tensor,
    neg_inf: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Additive mask ``[queries, keys]``: 0 where a key is visible from a query, else ``-inf``.

    A key is visible when its position is at most the query's and, with a sliding ``window``,
    within the last ``window`` positions. ``zero`` and ``neg_inf`` are 0-d tensors of the mask's
    dtype on its device (made once: a tensor built from a Python number per call would be a host
    to device copy, which a CUDA graph cannot capture).
    """
    keys = key_positions[None, :]
    queries = query_positions[:, None]
    visible = keys <= queries
    if window is not None:
        visible = visible & (keys > queries - window)
    return torch.where(visible, zero, neg_inf)


class DecodeAttention:
    """One token per request over its cached keys: the decode step's attention.

    Grouped-query attention without repeating K/V: the query heads that share a KV head become
    that head's query "sequence" of length ``groups``, so the op sees ``q [B, kv_heads, groups,
    D]`` against ``keys [B, kv_heads, max_seq, D]`` and a mask over every cached position.

    Args:
        step: The step (cache, constants, ``contiguous_slots``).
        ops: The op context the attention op is looked up in.
        positions: ``[B]`` position of each row's token.
        slots: ``[B]`` KV slot of each row (read by index unless ``step.contiguous_slots``).
    """

    def __init__(
        self, step: StepState, ops: OpContext, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        window = step.model.config.sliding_window
        self.step = step
        self.ops = ops
        self.slots = slots
        self.mask = causal_mask(positions, step.key_positions, step.zero, step.neg_inf, window)[
            :, None, None, :
        ]

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        step = self.step
        cfg, cache = step.model.config, step.cache
        batch = q.shape[0]
        if step.contiguous_slots:
            keys, values = cache.k_layers[layer][:batch], cache.v_layers[layer][:batch]
        else:
            keys = cache.k_layers[layer].index_select(0, self.slots)
            values = cache.v_layers[layer].index_select(0, self.slots)
        grouped = q.reshape(batch, cfg.num_kv_heads, step.groups, cfg.dim_per_head)
        out = self.ops.decode_attention(grouped, keys, values, self.mask)
        return out.reshape(batch, cfg.num_heads * cfg.dim_per_head)


class PrefillAttention:
    """One prompt in one slot, causal over itself: prefill's attention.

    Args:
        step: The step (cache, constants).
        slot: The prompt's KV slot; positions ``[0, length)`` of it hold this prompt's K/V.
        length: Prompt tokens.
    """

    def __init__(self, step: StepState, slot: int, length: int) -> None:
        positions = step.key_positions[:length]
        window = step.model.config.sliding_window
        self.step = step
        self.slot = slot
        self.length = length
        self.mask = causal_mask(positions, positions, step.zero, step.neg_inf, window)

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        step = self.step
        cfg, cache = step.model.config, step.cache
        keys = cache.k_layers[layer][self.slot, :, : self.length]
        values = cache.v_layers[layer][self.slot, :, : self.length]
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.repeat_interleave(step.groups, dim=0),
            values.repeat_interleave(step.groups, dim=0),
            attn_mask=self.mask,
        )
        return attn.transpose(0, 1).reshape(self.length, cfg.num_heads * cfg.dim_per_head)
