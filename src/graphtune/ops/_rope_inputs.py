"""The inputs of the ``graphtune.rope_kv_cache`` op (``graphtune.ops.rotary``), unpacked and
checked once for both of its runners."""

from __future__ import annotations

from typing import Any

import torch

from graphtune.errors import InputError, describe_tensor, wrong_device_error
from graphtune.ops.rmsnorm import check_eps

_NAMES = ("qkv", "positions", "cos", "sin", "k_cache", "v_cache", "write_rows")


def head_norm_of(
    inputs: list[Any], num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor | None, float]:
    """``(head_norm, eps)``: inputs 7 and 8 (``(None, 1e-6)`` for a seven-input call).

    Raises:
        InputError: ``head_norm`` is not ``[heads + kv_heads, D]`` of ``qkv``'s dtype and device.
        ConfigError: ``eps`` is not a finite number >= 0 (:func:`~graphtune.ops.rmsnorm.check_eps`).
    """
    norm = inputs[7] if len(inputs) > 7 else None
    eps = check_eps("rope_kv_cache", inputs[8]) if len(inputs) > 8 else 1e-6
    if norm is None:
        return None, eps
    qkv, dim = inputs[0], inputs[2].shape[-1]
    want = (num_heads + num_kv_heads, dim)
    if (
        not isinstance(norm, torch.Tensor)
        or tuple(norm.shape) != want
        or norm.dtype != qkv.dtype
        or norm.device != qkv.device
    ):
        raise InputError(
            f"rope_kv_cache: head_norm must be the [heads + kv_heads, D] = {list(want)} "
            f"weight rows of the q/k norm in {qkv.dtype} on {qkv.device} (head_norm_weights), "
            f"got {describe_tensor(norm)}."
        )
    return norm, eps


def rope_tensors(inputs: list[Any], num_heads: int, num_kv_heads: int) -> list[Any]:
    """The seven tensor inputs (inputs 7 and 8 are :func:`head_norm_of`'s; a tenth, the
    step's ``graphtune.ops.rotary.RopeRows``, is not checked). Shapes, dtypes and devices
    only: the index values are :func:`check_rope_indices`' (a host synchronisation)."""
    qkv, positions, cos, sin, k_cache, v_cache, rows = inputs[:7]
    tables = [t for t in (cos, sin) if isinstance(t, torch.Tensor)]
    if len(tables) != 2 or any(t.dim() != 2 for t in tables):
        raise InputError(
            "rope_kv_cache: cos and sin must be [rows, D] tables (one row per position), got "
            f"cos {describe_tensor(cos)}, sin {describe_tensor(sin)}."
        )
    dim = cos.shape[-1]
    width = (num_heads + 2 * num_kv_heads) * dim
    if qkv.dim() != 2 or qkv.shape[1] != width or sin.dim() != 2 or sin.shape[-1] != dim:
        raise InputError(
            f"rope_kv_cache: qkv must be [B, (heads + 2 * kv_heads) * D] = [B, {width}] for "
            f"{num_heads}/{num_kv_heads} heads and D={dim} (cos/sin [rows, D]), "
            f"got qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}."
        )
    check_rope_operands("rope_kv_cache", "qkv", qkv, inputs[1:7], num_kv_heads)
    return inputs[:7]


def check_rope_operands(
    op: str, like: str, ref: torch.Tensor, operands: list[Any], num_kv_heads: int
) -> None:
    """The checks of ``positions, cos, sin, k_cache, v_cache, write_rows`` against ``ref``, the
    ``[B, ...]`` tensor whose batch, dtype and device they follow (``rope_kv_cache``'s ``qkv``;
    ``norm_qkv_rope``'s ``x``, whose projection that ``qkv`` is). The kernels index the caches
    and tables by these alone, so anything else reads or writes out of bounds. Metadata only (no
    host synchronisation: the runners call it inside CUDA graph capture).

    Raises:
        InputError: An operand of the wrong shape, dtype or device.
    """
    positions, cos, sin, k_cache, v_cache, rows = operands
    dim = cos.shape[-1] if cos.dim() == 2 else -1
    if cos.dim() != 2 or sin.dim() != 2 or sin.shape[-1] != dim:
        raise InputError(
            f"{op}: cos and sin must be [rows, D] tables, got cos {tuple(cos.shape)}, sin "
            f"{tuple(sin.shape)}."
        )
    batch = ref.shape[0]
    if positions.shape != (batch,) or rows.shape != (batch * num_kv_heads,):
        raise InputError(
            f"{op}: positions must be [B]={batch} and write_rows [B * kv_heads]="
            f"{batch * num_kv_heads}, got {tuple(positions.shape)} and "
            f"{tuple(rows.shape)}."
        )
    if (
        k_cache.dim() != 2
        or v_cache.dim() != 2
        or k_cache.shape[-1] != dim
        or v_cache.shape[-1] != dim
    ):
        raise InputError(
            f"{op}: caches must be flattened [rows, D={dim}] views, got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}."
        )
    if dim % 2:
        raise InputError(f"{op}: D must be even (rotated in halves), got {dim}.")
    if positions.dtype != torch.long or rows.dtype != torch.long:
        raise InputError(
            f"{op}: positions and write_rows must be int64, got {positions.dtype} and {rows.dtype}."
        )
    if k_cache.dtype != ref.dtype or v_cache.dtype != ref.dtype:
        raise InputError(
            f"{op}: the caches must have {like}'s dtype {ref.dtype}, got "
            f"{k_cache.dtype} and {v_cache.dtype}."
        )
    if cos.dtype != ref.dtype or sin.dtype != ref.dtype:
        # The rotated keys would be promoted to the tables' dtype and miss the caches'.
        raise InputError(
            f"{op}: cos and sin must have {like}'s dtype {ref.dtype}, got {cos.dtype} "
            f"and {sin.dtype}; build the tables in it (rope_tables(..., dtype)) or cast once."
        )
    device = ref.device
    if (
        positions.device != device
        or cos.device != device
        or sin.device != device
        or k_cache.device != device
        or v_cache.device != device
        or rows.device != device
    ):
        raise wrong_device_error(op, like, device, zip(_NAMES[1:], operands, strict=True))


#: :func:`checked_rope_inputs`' result: the seven tensor inputs, the head norm (or ``None``) and
#: its epsilon.
CheckedRope = tuple[list[Any], torch.Tensor | None, float]


def checked_rope_inputs(inputs: list[Any], num_heads: int, num_kv_heads: int) -> CheckedRope:
    """:func:`rope_tensors`, then :func:`head_norm_of`: every check of a call's inputs, so a
    runner runs it once per call and hands the result on.

    Raises:
        InputError: As those two.
    """
    tensors = rope_tensors(inputs, num_heads, num_kv_heads)
    norm, eps = head_norm_of(inputs, num_heads, num_kv_heads)
    return tensors, norm, eps


def check_rope_indices(inputs: list[Any]) -> None:
    """``positions`` must index rows of both tables and ``write_rows`` rows of both caches: the
    Triton kernel reads and writes out of bounds otherwise (the fallback's index ops raise on
    the CPU and assert on the GPU). A host synchronisation, so the runners check only under
    ``GRAPHTUNE_DEBUG``, and not while a CUDA stream is capturing (where it is illegal).

    Raises:
        InputError: An index is out of range.
    """
    qkv, positions, cos, sin, k_cache, v_cache, rows = inputs[:7]
    if qkv.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    bounds = (
        ("positions", positions, min(cos.shape[0], sin.shape[0]), "cos/sin rows"),
        ("write_rows", rows, min(k_cache.shape[0], v_cache.shape[0]), "cache rows"),
    )
    for name, value, bound, what in bounds:
        if value.numel():
            low, high = int(value.min()), int(value.max())
            if low < 0 or high >= bound:
                raise InputError(
                    f"rope_kv_cache: {name} must be in [0, {bound}) ({what}), got "
                    f"{low}..{high}; size the tables and caches for every position and slot."
                )
