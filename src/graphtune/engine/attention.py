"""Attention, the one piece of the forward that differs between decode and prefill.

The forward (:meth:`graphtune.engine.step.DecodeStep.forward`) runs a flat batch of tokens; after
each layer's RoPE + K/V write it calls ``attention(layer, q)`` with ``q [rows, heads, head_dim]``
and expects ``[rows, heads * head_dim]`` back. Both kinds read keys and values from the KV cache,
where the forward has just written this batch's:

* :class:`DecodeAttention`: one token per request, attending over every cached position of its
  slot (static shapes, capturable), through the tunable decode-attention op;
* :class:`PrefillAttention`: the prompts of a packed prefill batch (:class:`PrefillBatch`), each
  causal over itself, with torch SDPA. Every prompt has its own length, so it runs as a graph
  break (:func:`graphtune.graphs.graph_break`): the prefill step around it is captured in pieces
  per token-count bucket, and the break reads the batch's layout from the host at every call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphtune.engine.kv_cache import KVCache
from graphtune.engine.model import DecoderModel
from graphtune.errors import InputError
from graphtune.graphs import graph_break
from graphtune.ops.context import OpContext

#: SDPA backends prefill attention may use. Not cuDNN: its attention builds an execution plan for
#: every new shape, and a prefill meets a new shape with every new prompt length.
PREFILL_SDPA_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


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
        mask: The ``[B, 1, 1, max_seq]`` mask when the caller made it already
            (``graphtune.ops.step_inputs``); ``None``: built here from ``positions``.
    """

    def __init__(
        self,
        step: StepState,
        ops: OpContext,
        positions: torch.Tensor,
        slots: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
    ) -> None:
        window = step.model.config.sliding_window
        self.step = step
        self.ops = ops
        self.slots = slots
        if mask is None:
            mask = causal_mask(positions, step.key_positions, step.zero, step.neg_inf, window)[
                :, None, None, :
            ]
        self.mask = mask

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


@dataclass(frozen=True)
class PromptRun:
    """Consecutive prompts of one length in a packed prefill batch (one SDPA call per layer).

    Attributes:
        start: Row of the run's first token in the packed batch.
        length: Tokens of each prompt of the run.
        slots: KV slot of each prompt, in packing order (its tokens are rows ``start + i *
            length`` to ``start + (i + 1) * length - 1``).
    """

    start: int
    length: int
    slots: tuple[int, ...]

    @property
    def rows(self) -> int:
        """Tokens of the whole run."""
        return self.length * len(self.slots)

    @property
    def contiguous(self) -> bool:
        """Whether the slots are ascending and consecutive (the cache is read as a slice)."""
        return self.slots == tuple(range(self.slots[0], self.slots[0] + len(self.slots)))


class PrefillBatch:
    """The layout of one packed prefill call: its prompt runs and its real token count.

    Host data the attention break reads at every call; the engine sets a new one before each
    call (:meth:`graphtune.engine.prefill.PrefillStep.set_batch`). Device tensors the break
    derives from it (slot indices, sliding-window masks) are made once per batch and shared by
    the layers.

    Args:
        runs: The runs in row order, covering rows ``[0, tokens)`` without gaps.
    """

    __slots__ = ("runs", "tokens", "_derived")

    def __init__(self, runs: Sequence[PromptRun] = ()) -> None:
        self.runs = tuple(runs)
        self.tokens = sum(run.rows for run in self.runs)
        self._derived: dict[tuple, torch.Tensor] = {}

    @property
    def prompts(self) -> int:
        """Prompts in the batch."""
        return sum(len(run.slots) for run in self.runs)

    def derived(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()`` on first use for ``key``, the same tensor afterwards (for this batch)."""
        tensor = self._derived.get(key)
        if tensor is None:
            tensor = make()
            self._derived[key] = tensor
        return tensor


class PrefillAttention:
    """Causal attention of every prompt of a packed prefill batch over itself, as a graph break.

    The forward calls ``attention(layer, q)`` with ``q [rows, heads, head_dim]`` for the packed
    tokens; the forward has just written their keys and values into their slots, so each run of
    prompts reads positions ``[0, length)`` of its slots back and runs one causal SDPA call
    (grouped-query heads without repeating K/V where the flash kernel runs; a mask only for a
    sliding window shorter than the prompt). Rows past :attr:`PrefillBatch.tokens` (padding)
    get zeros.

    The work happens in :meth:`attend`, called through :func:`graphtune.graphs.graph_break`: when a
    graph runner captures the prefill step it runs eagerly between the captured pieces, on every
    replay, reading the current :attr:`batch`. It writes into an output buffer the object owns (one
    for all layers: each layer's output is consumed by the output projection before the next
    layer's attention), so the pieces after it read a fixed address and no copy is made.

    Args:
        step: The step (cache, constants).
        rows: Rows of the output buffer (the largest token count captured); ``0``: a new output
            tensor per call (eager use).
    """

    def __init__(self, step: StepState, rows: int = 0) -> None:
        cfg = step.model.config
        self.step = step
        self.width = cfg.num_heads * cfg.dim_per_head
        self.batch = PrefillBatch()
        self.buffer = (
            torch.zeros((rows, self.width), device=step.model.device, dtype=step.model.dtype)
            if rows > 0
            else None
        )

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the output buffer."""
        buffer = self.buffer
        return 0 if buffer is None else buffer.numel() * buffer.element_size()

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        rows = q.shape[0]
        buffer = self.buffer
        out = buffer[:rows] if buffer is not None and rows <= buffer.shape[0] else None
        if out is None:
            out = q.new_empty((rows, self.width))
        graph_break(self.attend, q, layer, out)
        return out

    def attend(self, q: torch.Tensor, layer: int, out: torch.Tensor) -> None:
        """Writes the attention output of :attr:`batch`'s prompts into ``out [rows, width]``."""
        step, batch = self.step, self.batch
        if batch.tokens > q.shape[0]:
            raise InputError(
                f"the prefill batch lays out {batch.tokens} tokens but the call has "
                f"{q.shape[0]} rows; set the call's layout (PrefillStep.set_batch) before each "
                "call, and capture with PrefillStep.example_inputs (no prompts)"
            )
        cfg = step.model.config
        heads, dim = cfg.num_heads, cfg.dim_per_head
        with sdpa_kernel(PREFILL_SDPA_BACKENDS):
            for index, run in enumerate(batch.runs):
                prompts, length = len(run.slots), run.length
                rows = slice(run.start, run.start + run.rows)
                queries = q[rows].unflatten(0, (prompts, length)).transpose(1, 2)
                keys, values = self._keys_values(layer, index, run)
                mask = self._mask(length)
                # Only the flash backend takes grouped K/V (no mask, 16-bit); for the others the
                # K/V heads are repeated, which keeps the efficient kernel instead of the math one.
                gqa = step.groups > 1 and mask is None and q.dtype in _FLASH_DTYPES
                if step.groups > 1 and not gqa:
                    keys = keys.repeat_interleave(step.groups, dim=1)
                    values = values.repeat_interleave(step.groups, dim=1)
                attn = F.scaled_dot_product_attention(
                    queries, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa
                )
                out[rows].view(prompts, length, heads, dim).copy_(attn.transpose(1, 2))
        if batch.tokens < out.shape[0]:
            out[batch.tokens :].zero_()

    def _keys_values(
        self, layer: int, index: int, run: PromptRun
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.step.cache
        keys = cache.k_layers[layer][:, :, : run.length]
        values = cache.v_layers[layer][:, :, : run.length]
        if run.contiguous:
            first = run.slots[0]
            end = first + len(run.slots)
            return keys[first:end], values[first:end]
        # Made once per call, copied without blocking (a plain device tensor from a list would
        # wait for the stream, that is for the piece the break follows).
        slots = self.batch.derived(
            ("slots", index),
            lambda: torch.tensor(run.slots, dtype=torch.long).to(keys.device, non_blocking=True),
        )
        return keys.index_select(0, slots), values.index_select(0, slots)

    def _mask(self, length: int) -> torch.Tensor | None:
        step = self.step
        window = step.model.config.sliding_window
        if window is None or length <= window:
            return None
        positions = step.key_positions[:length]
        return self.batch.derived(
            ("mask", length),
            lambda: causal_mask(positions, positions, step.zero, step.neg_inf, window),
        )
