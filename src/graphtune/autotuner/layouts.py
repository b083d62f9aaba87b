"""The layout class of a non-contiguous tensor input, which its cache key names.

A cache key holds the class, not the strides (``float16 order(1,0)``): a kernel's validity and
speed depend on the stride order and on gaps, and keying exact strides would make every slice of
a buffer its own key. :func:`tensor_layout` gives it for a live call and, laid out like the live
tensor, for each bucket a tuning run sweeps, so both keys come from one rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

#: A non-contiguous tensor's layout class: its dims from outermost to innermost stride, and
#: whether it is dense (no gaps between its elements, none shared).
Layout = tuple[tuple[int, ...], bool]


def tensor_layout(x: torch.Tensor, shape: Sequence[int] | None = None) -> Layout | None:
    """The layout class of a non-contiguous tensor (``None`` for a row-major one), or with
    ``shape``, that of a tensor of ``shape`` laid out like ``x``: the key of a live call and the
    keys of the buckets a tuning run sweeps all come from here, so a bucket keys as a live call
    of its shape does.

    The class is the dims sorted from outermost to innermost stride (ties: the lower dim outer;
    a size-1 dim, whose stride does not matter, counts as outermost) and whether the tensor is
    dense.

    Rows of a wider buffer (packed but for a longer stride of dim 0, as the query sliced out of
    fused QKV rows) and one row broadcast over dim 0 (``bias.expand(B, N)``) count as
    row-major: at batch 1 torch gives a size-1 dim a packed stride, so the gap cannot be seen
    there, and keying it apart would tune every bucket twice, once from a batch-1 call and once
    from a larger one.

    At another ``shape``, ``x``'s stride order is laid over a dense tensor of that shape, each
    gap scaled from ``x``'s and a broadcast dim kept at stride 0 (:func:`_strides_like`), and
    that tensor is classed: where a size-1 dim makes it contiguous (``zeros(64, n).t()`` at
    n = 1), it is row-major, as torch makes the live call of that shape. What a size-1 dim of
    ``x`` would be at a larger size cannot be seen: it is taken as packed and outermost."""
    if x.is_contiguous():
        return None
    live = _layout_class(x.shape, x.stride())
    if live is None or shape is None:
        return live
    return _layout_class(shape, _strides_like(x, live[0], shape))


def _layout_class(shape: Sequence[int], strides: Sequence[int]) -> Layout | None:
    """:func:`tensor_layout` of a tensor with these sizes and strides."""
    if math.prod(shape) == 0 or _packed(range(len(shape)), strides, shape):  # contiguous
        return None
    rows = len(shape) >= 2 and _packed(range(1, len(shape)), strides, shape)
    if rows and (strides[0] == 0 or strides[0] >= math.prod(shape[1:])):
        return None
    # Size-1 dims first, whatever their strides: otherwise their arbitrary strides would order
    # them, and a bucket's order (from packed strides) would differ from a live call's.
    order = tuple(
        sorted(range(len(shape)), key=lambda d: (0, 0, d) if shape[d] == 1 else (1, -strides[d], d))
    )
    return order, _packed(order, strides, shape)


def _strides_like(x: torch.Tensor, order: Sequence[int], shape: Sequence[int]) -> list[int]:
    """Strides for ``shape`` in ``x``'s stride ``order``: each dim's stride is its packed one
    times the ratio of ``x``'s stride of it to its packed one in ``x`` (rounded up), so a dense
    order stays dense, a step (``x[:, ::2]``) keeps its step and at ``x``'s own shape the strides
    are ``x``'s; a broadcast dim keeps its stride 0, and a size-1 dim of ``x`` is packed."""
    strides = [0] * len(shape)
    packed = live_packed = 1
    for d in reversed(order):
        size, stride = x.shape[d], x.stride(d)
        if size == 1:
            strides[d] = packed
        elif stride == 0:  # takes no memory, so the dims outside it pack as if it were not there
            continue
        else:
            strides[d] = -(-stride * packed // live_packed)
            live_packed = stride * size
        packed = strides[d] * shape[d]
    return strides


def _packed(order: Iterable[int], strides: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether the dims ``order`` lists (outermost first) have exactly the packed strides of
    their sizes; a size-1 dim's stride does not matter (as in ``Tensor.is_contiguous()``)."""
    expected = 1
    for d in reversed(list(order)):
        if shape[d] != 1 and strides[d] != expected:
            return False
        expected *= shape[d]
    return True


def layout_text(layout: Layout) -> str:
    """A layout's text in a cache key: ``order(1,0)``, plus `` gaps`` when it is not dense."""
    order, dense = layout
    return f"order({','.join(map(str, order))})" + ("" if dense else " gaps")
