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
    (float, complex and ``Decimal`` NaNs, and numpy's NaN and NaT elements), a zero only a zero
    of its sign (``x / c`` is ``-inf`` for ``c = -0.0``), and numpy arrays and scalars are equal
    when their shape, dtype and elements are."""
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
    if isinstance(a, decimal.Decimal):
        if a.is_nan():
            return b.is_nan() and a.is_snan() == b.is_snan()
        if a.is_zero():
            return b.is_zero() and a.is_signed() == b.is_signed()
    numpy = sys.modules.get("numpy")  # only values of an imported numpy can be numpy's
    if numpy is not None and isinstance(a, (numpy.ndarray, numpy.generic)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        try:  # equal_nan only exists for numbers and dates: NaN and NaT elements stay equal
            if not numpy.array_equal(a, b, equal_nan=a.dtype.kind in "fcmM"):
                return False
        except (TypeError, ValueError):  # object arrays of values that cannot be compared
            return False
        return a.dtype.kind not in "fc" or _same_zero_signs(numpy, a, b)
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError, ArithmeticError):  # ambiguous, or a signalling
        return False  # NaN (decimal.InvalidOperation)


def _same_number(a: complex, b: complex) -> bool:
    """``a == b`` for floats and complex numbers, part by part: a NaN part equals a NaN part,
    and a zero part only a zero of its sign."""
    return _same_part(a.real, b.real) and _same_part(a.imag, b.imag)


def _same_part(x: float, y: float) -> bool:
    if x == y:
        return x != 0 or math.copysign(1.0, x) == math.copysign(1.0, y)
    return math.isnan(x) and math.isnan(y)


def _same_zero_signs(numpy: Any, a: Any, b: Any) -> bool:
    """Whether the zeros of two equal float or complex arrays (or scalars) have equal signs,
    part by part (``numpy.array_equal`` counts ``-0.0`` equal to ``0.0``)."""
    a, b = numpy.asarray(a), numpy.asarray(b)
    pairs = ((a.real, b.real), (a.imag, b.imag)) if a.dtype.kind == "c" else ((a, b),)
    for x, y in pairs:
        zeros = x == 0  # equal arrays have their zeros at the same places
        if not numpy.array_equal(numpy.signbit(x[zeros]), numpy.signbit(y[zeros])):
            return False
    return True
