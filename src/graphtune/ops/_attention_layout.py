"""The input layout of decode attention (``graphtune.ops.attention``): what every runner takes,
and what its Triton kernel needs besides."""

from __future__ import annotations

from typing import Any

import torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_GROUPS = 32  # query rows per KV head held in registers (GQA ratios are 1..16 in practice)


def layout_problem(inputs: list[Any]) -> str | None:
    """Why no runner can take these inputs (the layout of the module docstring), or ``None``."""
    q, keys, values, mask = inputs
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        return (
            "q, keys, values and mask must be tensors (the mask additive, -inf where masked), "
            f"got {', '.join(type(t).__name__ for t in inputs)}"
        )
    if q.dim() != 4 or keys.dim() != 4 or keys.shape != values.shape:
        return (
            "need q [B, KV, G, D] and keys == values [B, KV, S, D], got q "
            f"{_shape(q)}, keys {_shape(keys)}, values {_shape(values)}"
        )
    batch, kv_heads, _, dim = q.shape
    if tuple(keys.shape[:2]) != (batch, kv_heads) or keys.shape[3] != dim:
        return f"keys {tuple(keys.shape)} do not match q {tuple(q.shape)} in B, KV or D"
    seq = keys.shape[2]
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or tuple(mask.shape[1:]) != (1, 1, seq):
        return f"need an additive mask [B or 1, 1, 1, S={seq}], got {tuple(mask.shape)}"
    if keys.dtype != q.dtype or values.dtype != q.dtype:
        return f"q, keys and values need one dtype, got {q.dtype}, {keys.dtype}, {values.dtype}"
    if not q.dtype.is_floating_point:
        return f"q, keys and values need a floating dtype, got {q.dtype}"
    if not mask.dtype.is_floating_point:
        return f"the mask must be additive (a float dtype), got {mask.dtype}"
    if len({t.device for t in inputs}) != 1:
        return "q, keys, values and mask must be on one device"
    return None


def _shape(value: Any) -> Any:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def triton_layout_problem(inputs: list[Any]) -> str | None:
    """:func:`layout_problem`, and what the Triton kernel needs besides."""
    problem = layout_problem(inputs)
    if problem is not None:
        return problem
    q = inputs[0]
    groups, dim = q.shape[2], q.shape[3]
    if q.dtype not in _DTYPES:
        return f"q, keys and values need a dtype of {_DTYPES}, got {q.dtype}"
    if dim < 16 or dim > 256 or dim & (dim - 1):
        return f"head_dim must be a power of two in [16, 256] (tl.dot tiles), got {dim}"
    if groups > _MAX_GROUPS:
        return f"at most {_MAX_GROUPS} query heads per KV head, got {groups}"
    return None
