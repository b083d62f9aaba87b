"""Whether an op's output shares memory with an operand it reads.

An op that writes its result where it still reads ``a`` or the weight reads values it already
overwrote: ``gemm(y, w, out=y)`` and ``add_projection(y, y, w)`` gave relative errors near 1, on
the torch path too (``addmm_`` does not detect it). The ops refuse such calls.
"""

from __future__ import annotations

import torch

from graphtune.errors import InputError


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last (strides are never negative)."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` are views of one storage whose byte ranges overlap (two strided
    views that interleave without sharing an element count too: the ops refuse both).

    Tensors of different storages never overlap, and telling them apart is the cheap part: two
    pointer reads, paid on every eager call of the ops that check.
    """
    if x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
        return False
    if x.numel() == 0 or y.numel() == 0:
        return False
    x0, y0 = x.data_ptr(), y.data_ptr()
    return x0 < y0 + _span(y) and y0 < x0 + _span(x)


def check_written_apart(op: str, written: str, out: torch.Tensor, **read: torch.Tensor) -> None:
    """Raises unless ``out`` (named ``written``) shares no memory with the tensors in ``read``.

    Raises:
        InputError: Names the op, both tensors and the fix.
    """
    for name, operand in read.items():
        if overlaps(out, operand):
            raise InputError(
                f"{op}: {written} (written by the op) and {name} share memory, so writing it "
                f"would change {name} while the op still reads it; pass a separate tensor "
                f"(e.g. {name}.clone())."
            )
