"""The inputs of the ``graphtune.rope_kv_cache`` op (``graphtune.ops.rotary``), unpacked and
checked once for both of its runners."""

from __future__ import annotations

from typing import Any

import torch

from graphtune.errors import InputError, describe_tensor


def head_norm_of(
    inputs: list[Any], num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor | None, float]:
    """``(head_norm, eps)``: inputs 7 and 8 (``(None, 1e-6)`` for a seven-input call).

    Raises:
        InputError: ``head_norm`` is not ``[heads + kv_heads, D]`` of ``qkv``'s dtype.
    """
    norm = inputs[7] if len(inputs) > 7 else None
    eps = float(inputs[8]) if len(inputs) > 8 else 1e-6
    if norm is None:
        return None, eps
    qkv, dim = inputs[0], inputs[2].shape[-1]
    want = (num_heads + num_kv_heads, dim)
    if not isinstance(norm, torch.Tensor) or tuple(norm.shape) != want or norm.dtype != qkv.dtype:
        raise InputError(
            f"rope_kv_cache: head_norm must be the [heads + kv_heads, D] = {list(want)} "
            f"weight rows of the q/k norm in {qkv.dtype} (head_norm_weights), got "
            f"{describe_tensor(norm)}."
        )
    return norm, eps


def rope_tensors(inputs: list[Any], num_heads: int, num_kv_heads: int) -> list[Any]:
    """The seven tensor inputs (inputs 7 and 8 are :func:`head_norm_of`'s; a tenth, the
    step's ``graphtune.ops.rotary.RopeRows``, is not checked)."""
    qkv, positions, cos, sin, k_cache, v_cache, rows = inputs[:7]
    batch, dim = qkv.shape[0], cos.shape[-1]
    width = (num_heads + 2 * num_kv_heads) * dim
    if qkv.dim() != 2 or qkv.shape[1] != width or sin.shape[-1] != dim:
        raise InputError(
            f"rope_kv_cache: qkv must be [B, (heads + 2 * kv_heads) * D] = [B, {width}] for "
            f"{num_heads}/{num_kv_heads} heads and D={dim} (cos/sin [rows, D]), "
            f"got qkv {tuple(qkv.shape)}."
        )
    if positions.shape != (batch,) or rows.shape != (batch * num_kv_heads,):
        raise InputError(
            f"rope_kv_cache: positions must be [B]={batch} and write_rows [B * kv_heads]="
            f"{batch * num_kv_heads}, got {tuple(positions.shape)} and "
            f"{tuple(rows.shape)}."
        )
    if k_cache.shape[-1] != dim or v_cache.shape[-1] != dim or k_cache.dim() != 2:
        raise InputError(
            f"rope_kv_cache: caches must be flattened [rows, D={dim}] views, got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}."
        )
    if dim % 2:
        raise InputError(f"rope_kv_cache: D must be even (rotated in halves), got {dim}.")
    if positions.dtype != torch.long or rows.dtype != torch.long:
        raise InputError(
            f"rope_kv_cache: positions and write_rows must be int64, got {positions.dtype} "
            f"and {rows.dtype}."
        )
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise InputError(
            f"rope_kv_cache: the caches must have qkv's dtype {qkv.dtype}, got "
            f"{k_cache.dtype} and {v_cache.dtype}."
        )
    return inputs[:7]
