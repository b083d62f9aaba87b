"""Comparing the non-tensor values a graph was captured with (constant inputs, break results).

A graph bakes such a value in, so every later call checks that it got the same value again. The
check must hold for every value that did not change: ``==`` alone fails for NaN (never equal to
itself) and for numpy arrays (``==`` is elementwise, and an array's truth value is ambiguous).
"""

from __future__ import annotations

import decimal
import math
import sys
from typing import Any


def same_constant(a: Any, b: Any) -> bool:
    """Whether ``a`` is the captured constant ``b``: the very object, or one of the same type
    (1, 1.0 and True are equal in Python but trace other graphs) and value. NaN equals NaN
    (float, complex and ``Decimal`` NaNs, and numpy's NaN and NaT elements), and numpy arrays and
    scalars are equal when their shape, dtype and elements are."""
    # A value not equal to itself (an odd __eq__) is still the same object.
    return a is b or _same_value(a, b)


def equal_to_itself(value: Any) -> bool:
    """Whether ``value`` is equal to itself by :func:`same_constant`'s rules, identity aside:
    False for a value a new but equal object of would never match (an ``__eq__`` that raises or
    is ambiguous)."""
    return _same_value(value, value)


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, (float, complex)):
        return _same_number(a, b)
    if isinstance(a, decimal.Decimal) and a.is_nan():
        return b.is_nan() and a.is_snan() == b.is_snan()
    numpy = sys.modules.get("numpy")  # only values of an imported numpy can be numpy's
    if numpy is not None and isinstance(a, (numpy.ndarray, numpy.generic)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        try:  # equal_nan only exists for numbers and dates: NaN and NaT elements stay equal
            return bool(numpy.array_equal(a, b, equal_nan=a.dtype.kind in "fcmM"))
        except (TypeError, ValueError):  # object arrays of values that cannot be compared
            return False
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError, ArithmeticError):  # ambiguous, or a signalling
        return False  # NaN (decimal.InvalidOperation)


def _same_number(a: complex, b: complex) -> bool:
    """``a == b`` for floats and complex numbers, with a NaN part equal to a NaN part."""
    if a == b:
        return True
    parts = ((a.real, b.real), (a.imag, b.imag))
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in parts)
