"""Prefill: the prompts of an admission round packed into one flat batch of the one forward.

:class:`PrefillStep` runs ``tokens [T]``, ``positions [T]``, ``slots [T]`` and ``logit_rows [T]``
through :meth:`~graphtune.engine.step.DecodeStep.forward` with :class:`~graphtune.engine.attention.
PrefillAttention`, which runs as a graph break. A graph runner over it therefore captures each
token-count bucket (:func:`prefill_capture_sizes`) as pieces between the layers' attention, pads
a call up to its bucket (padded tokens are token 0 at position 0 in the KV cache's scratch slot,
:func:`prefill_pad_rule`), and runs every layer's attention eagerly on the real prompts, whose
layout (:class:`~graphtune.engine.attention.PrefillBatch`) the engine sets before each call.

The logits of a call are those of the rows ``logit_rows[:k]``, ``k = min(T, max_prompts)``: the
last token of each prompt first, then any row (the LM head over every prompt token would be the
largest GEMM of the call). Prefill runs the untuned ops: its token counts are not the decode
step's tuned batch buckets.

:func:`pack_prompts` lays out one call, :func:`plan_chunks` splits an admission round into calls
of at most ``max_tokens`` tokens, and :func:`prefill_logits` runs them. :func:`prefill` is one
prompt, eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphtune.engine.attention import PrefillAttention, PrefillBatch, PromptRun
from graphtune.engine.model import DecoderModel
from graphtune.engine.step import UNTUNED, DecodeStep
from graphtune.errors import CaptureError, ConfigError, InputError

logger = logging.getLogger(__name__)

#: Smallest prefill bucket: shorter prompts pad up to it.
MIN_PREFILL_BUCKET = 16
#: Default most tokens of one prefill call (an engine's largest prefill graph).
DEFAULT_MAX_PREFILL_TOKENS = 2048


def prefill_capture_sizes(max_tokens: int) -> tuple[int, ...]:
    """Token-count buckets of the prefill graphs: 16, 24, 32, 48, 64, ... (each power of two and
    1.5 times it, so a call pads by less than half), up to ``max_tokens``, which is always one.

    Raises:
        ConfigError: ``max_tokens`` is not a positive int.
    """
    check_max_tokens(max_tokens)
    sizes = set()
    power = MIN_PREFILL_BUCKET
    while power <= max_tokens:
        sizes.add(power)
        if power * 3 // 2 <= max_tokens:
            sizes.add(power * 3 // 2)
        power *= 2
    sizes.add(max_tokens)
    return tuple(sorted(sizes))


def check_max_tokens(max_tokens: Any) -> None:
    """Raises ConfigError unless ``max_tokens`` (tokens per prefill call) is a positive int."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(
            f"max_prefill_tokens must be a positive int, got {max_tokens!r}; it bounds the tokens "
            "of one prefill call (the largest prefill graph), e.g. 2048"
        )


def default_prefill_runner(model: DecoderModel, runner: str) -> str:
    """The prefill runner an engine with decode ``runner`` uses by default: the same, except
    ``"eager"`` for a model with mixture-of-experts layers. Prefill runs the untuned ops, and an
    untuned MoE layer inside a capture runs every expert on every token (the dense form, ``E / k``
    times the work of the loop over the selected experts, which needs a host synchronisation)."""
    return "eager" if any(layer.is_moe for layer in model.layers) else runner


def prefill_pad_rule(scratch_slot: int) -> tuple[int, int, int, int]:
    """Pad rule for the prefill step's inputs ``(tokens, positions, slots, logit_rows)``: padded
    tokens are token 0 at position 0 in the scratch slot, so their K/V writes land where no live
    request reads, and their logit rows point at row 0."""
    return (0, 0, scratch_slot, 0)


class PrefillStep:
    """Prefill of a packed batch of prompts through the one forward, for a graph runner.

    Args:
        step: The engine's decode step (model, KV cache, RoPE tables; a tensor-parallel step
            brings its all-reduce). Prefill calls its forward with the untuned ops.
        max_tokens: Largest token count a call is captured for (the output buffer of the
            attention break has this many rows); longer calls run eagerly.

    Raises:
        ConfigError: ``max_tokens`` is not a positive int.
    """

    def __init__(self, step: DecodeStep, max_tokens: int) -> None:
        check_max_tokens(max_tokens)
        self.step = step
        self.max_tokens = max_tokens
        #: Most prompts in one call (the KV cache's slots); the logits have this many rows at most.
        self.max_prompts = step.max_batch_size
        self.attention = PrefillAttention(step, rows=max_tokens)

    @property
    def batch(self) -> PrefillBatch:
        """The layout the next call's attention uses."""
        return self.attention.batch

    def set_batch(self, batch: PrefillBatch) -> None:
        """Sets the layout of the next call (read by the attention break at every layer)."""
        self.attention.batch = batch

    @property
    def buffer_bytes(self) -> int:
        """Bytes this step holds besides the decode step's (the attention output buffer)."""
        return self.attention.buffer_bytes

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Runs the packed batch; returns logits ``[min(T, max_prompts), vocab]`` of the rows
        ``logit_rows[:min(T, max_prompts)]``.

        Args:
            tokens: ``[T]`` token ids, prompts back to back as :attr:`batch` lays them out.
            positions: ``[T]`` position of each token in its prompt.
            slots: ``[T]`` KV slot of each token (the scratch slot for padded tokens).
            logit_rows: ``[T]`` rows whose logits to return: each prompt's last token first.
        """
        step = self.step
        rows = min(tokens.shape[0], self.max_prompts)
        write_rows = step.write_rows(positions, slots)
        return step.forward(
            UNTUNED, tokens, positions, write_rows, self.attention, logit_rows=logit_rows[:rows]
        )

    def example_inputs(
        self, tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs of ``tokens`` padded tokens (write only the scratch slot), for capture and
        profiling; sets the next call's layout to no prompts, as these inputs hold none."""
        self.set_batch(PrefillBatch())
        device = self.step.model.device
        zeros = torch.zeros(tokens, dtype=torch.long, device=device)
        return zeros, zeros.clone(), torch.full_like(zeros, self.step.cache.scratch_slot), zeros


@dataclass(frozen=True)
class PackedPrefill:
    """Host inputs of one prefill call.

    Attributes:
        inputs: ``[4, tokens]`` int64 on the host: tokens, positions, slots, logit rows.
        batch: The prompts' layout for the attention break.
    """

    inputs: torch.Tensor
    batch: PrefillBatch

    @property
    def prompts(self) -> int:
        """Prompts in the call (the first rows of its logits)."""
        return self.batch.prompts


def pack_prompts(prompts: Sequence[Sequence[int]], slots: Sequence[int]) -> PackedPrefill:
    """Lays out one prefill call: prompts back to back, consecutive prompts of one length
    grouped into one :class:`PromptRun` (one attention call per layer for the group).

    Args:
        prompts: Token ids of each prompt (non-empty).
        slots: The KV slot of each prompt.

    Raises:
        ConfigError: The lists differ in length, or a prompt is empty.
    """
    if len(prompts) != len(slots) or not prompts:
        raise ConfigError(
            f"pack_prompts needs one slot per prompt and at least one prompt, got {len(prompts)} "
            f"prompts and {len(slots)} slots"
        )
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1:
        raise ConfigError("pack_prompts: every prompt needs at least one token")
    runs: list[PromptRun] = []
    start = 0
    for length, slot in zip(lengths, slots, strict=True):
        last = runs[-1] if runs else None
        if last is not None and last.length == length:
            runs[-1] = PromptRun(last.start, length, (*last.slots, slot))
        else:
            runs.append(PromptRun(start, length, (slot,)))
        start += length
    total = start
    lengths_t = torch.tensor(lengths, dtype=torch.long)
    ends = torch.cumsum(lengths_t, 0)
    tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    positions = torch.arange(total, dtype=torch.long) - torch.repeat_interleave(
        ends - lengths_t, lengths_t
    )
    slot_rows = torch.repeat_interleave(torch.tensor(list(slots), dtype=torch.long), lengths_t)
    logit_rows = torch.zeros(total, dtype=torch.long)
    logit_rows[: len(prompts)] = ends - 1
    inputs = torch.stack((tokens, positions, slot_rows, logit_rows))
    return PackedPrefill(inputs, PrefillBatch(runs))


def plan_chunks(lengths: Sequence[int], max_tokens: int, max_prompts: int) -> list[range]:
    """Splits prompts, in the given order, into prefill calls of consecutive prompts: each call
    holds at most ``max_tokens`` tokens and ``max_prompts`` prompts; a prompt longer than
    ``max_tokens`` is a call of its own (it runs eagerly: no graph is that large).

    Returns:
        The index range of each call.
    """
    chunks: list[range] = []
    first, tokens = 0, 0
    for index, length in enumerate(lengths):
        full = index - first >= max_prompts or tokens + length > max_tokens
        if index > first and full:
            chunks.append(range(first, index))
            first, tokens = index, 0
        tokens += length
    if lengths:
        chunks.append(range(first, len(lengths)))
    return chunks


def prefill_logits(
    step: PrefillStep,
    runner: Any,
    prompts: Sequence[Sequence[int]],
    slots: Sequence[int],
    *,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Prefills ``prompts`` into ``slots`` and returns the logits of each prompt's last token,
    ``[len(prompts), vocab]`` in prompt order.

    The prompts go through ``runner`` (a graph or eager runner over ``step``) in calls of at most
    ``max_tokens`` tokens (default ``step.max_tokens``). With one call the result is the runner's
    output, valid until its next call; with several it is a new tensor.
    """
    limit = step.max_tokens if max_tokens is None else max_tokens
    device = step.step.model.device
    chunks = plan_chunks([len(p) for p in prompts], limit, step.max_prompts)
    parts = []
    for chunk in chunks:
        packed = pack_prompts([prompts[i] for i in chunk], [slots[i] for i in chunk])
        inputs = _padded(packed.inputs, _least_tokens(runner, step, limit), step)
        inputs = inputs.to(device, non_blocking=True)
        step.set_batch(packed.batch)
        try:
            out = runner(inputs[0], inputs[1], inputs[2], inputs[3])
        except CaptureError:
            # A lazy capture failed after a graph break had run part of this call. The runner
            # will not run an arbitrary fn twice; a prefill call may: it writes the same rows.
            out = step(inputs[0], inputs[1], inputs[2], inputs[3])
        logits = out[: packed.prompts]
        # The next call overwrites a graph's output: keep a copy when another call follows.
        parts.append(logits if len(chunks) == 1 else logits.clone())
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _least_tokens(runner: Any, step: PrefillStep, limit: int) -> int:
    """Tokens a call of ``runner`` is padded to: ``max_prompts``, at most the smallest captured
    size (a graph pads up to it anyway, so this costs nothing), for a runner with graphs; none
    for an eager runner, whose calls have the rows of their tokens."""
    sizes = getattr(runner, "capture_sizes", ())
    return min(step.max_prompts, min(sizes), limit) if sizes else 0


def _padded(inputs: torch.Tensor, tokens: int, step: PrefillStep) -> torch.Tensor:
    """``inputs [4, T]`` padded with :func:`prefill_pad_rule` tokens to at least ``tokens``.

    A call of fewer tokens than ``max_prompts`` would have fewer logit rows than the graphs'
    ``max_prompts`` at every captured size, and a graph runner cannot tell such a constant from
    a cap of the batch without running one such call eagerly; padded, every call has the rows
    of the graphs."""
    short = tokens - inputs.shape[1]
    if short <= 0:
        return inputs
    rule = prefill_pad_rule(step.step.cache.scratch_slot)
    pad = torch.tensor(rule, dtype=inputs.dtype)[:, None].expand(len(rule), short)
    return torch.cat((inputs, pad), dim=1)


def prefill(
    step: DecodeStep, tokens: torch.Tensor, slot: int, *, all_logits: bool = False
) -> torch.Tensor:
    """Runs one prompt through the model eagerly, filling positions ``[0, L)`` of ``slot``.

    The same forward and the same prefill attention as the engine's prefill calls, with the
    untuned ops and no graph.

    Args:
        step: The decode step whose model, cache and RoPE tables to use.
        tokens: ``[L]`` prompt token ids on the model's device.
        slot: Cache slot owned by this request.
        all_logits: Return logits for every position (tests) instead of only the last.

    Returns:
        ``[vocab]`` logits of the last position, or ``[L, vocab]`` with ``all_logits``.

    Raises:
        InputError: ``tokens`` is not a non-empty 1-D integer tensor on the model's device, has
            more tokens than the cache holds per slot or ids outside the vocabulary (one host
            read), or ``slot`` is not a slot of the cache.
    """
    _check_prefill_inputs(step, tokens, slot)
    length = tokens.shape[0]
    positions = step.key_positions[:length]
    slots = torch.full_like(positions, slot)
    attention = PrefillAttention(step)
    attention.batch = PrefillBatch([PromptRun(0, length, (slot,))])
    logits = step.forward(
        UNTUNED,
        tokens,
        positions,
        step.write_rows(positions, slots),
        attention,
        logit_rows=None if all_logits else positions[-1:],
    )
    return logits if all_logits else logits[0]


def _check_prefill_inputs(step: DecodeStep, tokens: Any, slot: Any) -> None:
    # Each broken rule would otherwise surface as a shape or index error deep in the forward.
    where = step.key_positions.device
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.dim() != 1
        or tokens.dtype not in (torch.int32, torch.int64)
    ):
        raise InputError(
            f"prefill: tokens must be a 1-D int64 (or int32) tensor of prompt ids, got "
            f"{getattr(tokens, 'dtype', type(tokens).__name__)} "
            f"{tuple(getattr(tokens, 'shape', ()))}"
        )
    if tokens.device.type != where.type or where.index not in (None, tokens.device.index):
        raise InputError(f"prefill: tokens are on {tokens.device}, the model on {where}; move them")
    capacity = step.key_positions.shape[0]
    if not 1 <= tokens.shape[0] <= capacity:
        raise InputError(
            f"prefill: {tokens.shape[0]} tokens, but a prompt needs 1 to {capacity} (the KV "
            "cache's max_seq_len); shorten it or build the cache longer"
        )
    vocab = step.model.config.vocab_size
    # One device-to-host read for both bounds: prefill() is timed per request.
    low, high = torch.stack(torch.aminmax(tokens)).tolist()
    if low < 0 or high >= vocab:
        raise InputError(f"prefill: token ids must be in [0, {vocab}), got {low}..{high}")
    slots = step.cache.max_batch_size
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < slots:
        raise InputError(f"prefill: slot must be an int in [0, {slots}), got {slot!r}")
