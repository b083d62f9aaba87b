"""Comparing the non-tensor values a graph was captured with (constant inputs, break results).

A graph bakes such a value in, so every later call checks that it got the same value again. The
check must hold for every value that did not change: ``==`` alone fails for NaN (never equal to
itself) and for numpy arrays (``==`` is elementwise, and an array's truth value is ambiguous).
"""

from __future__ import annotations

import math
import sys
from typing import Any


def same_constant(a: Any, b: Any) -> bool:
    """Whether ``a`` is the captured constant ``b``: the same type (1, 1.0 and True are equal
    in Python but trace other graphs) and value; NaN equals NaN, and numpy arrays and scalars
    are equal when their shape, dtype and elements are."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    numpy = sys.modules.get("numpy")  # only values of an imported numpy can be numpy's
    if numpy is not None and isinstance(a, (numpy.ndarray, numpy.generic)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        try:  # equal_nan only exists for numbers: NaN elements of a constant stay equal
            return bool(numpy.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
        except (TypeError, ValueError):  # object arrays of values that cannot be compared
            return False
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # a truth value that is ambiguous
        return False
