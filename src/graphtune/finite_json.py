"""JSON as the standard writes it: Python's ``json`` reads ``NaN``, ``Infinity`` and
``-Infinity``, which JSON has not, and graphtune's files (tuning caches, misses records,
results) never hold; a hand-edited file could smuggle one in (a NaN time into a cache's merge
rule, a NaN epsilon into a model). :func:`parse_json` refuses them, and numbers too large for a
float (``1e999``, an integer of 400 digits), and names the field; :func:`finite_float` is the
same rule for a number given in Python."""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

_CONSTANTS = ("NaN", "Infinity", "-Infinity")


class NonFiniteNumber(ValueError):
    """A ``NaN`` or ``Infinity`` in JSON text, or a number too large for a float.

    Attributes:
        constant: The spelling found (``"NaN"``, ``"Infinity"``, ``"-Infinity"``, ``"1e999"``;
            an integer of many digits shortened, with its number of digits).
        field: The key of the object it is a value of (inside lists too), or ``None`` outside
            any object.
        problem: What is wrong with it, for a message (``"is not a finite number ..."``).
    """

    def __init__(self, constant: str, field: str | None = None) -> None:
        where = f" in field {field!r}" if field is not None else ""
        if constant in _CONSTANTS:
            self.problem = "is not a finite number (JSON has none)"
        else:
            self.problem = "is too large for a float"
        super().__init__(f"number {constant}{where} {self.problem}")
        self.constant, self.field = constant, field


class _Constant(str):
    """What the parser makes of a non-finite constant until :func:`parse_json` refuses it."""


def _float(text: str) -> float | _Constant:
    """A JSON number as a float; one too large for a float (``1e999``) would be an infinity,
    so it is kept as its text and refused like ``Infinity``."""
    value = float(text)
    return value if math.isfinite(value) else _Constant(text)


def _int(text: str) -> int | _Constant:
    """A JSON integer; one too large for a float (``float()`` of it raises ``OverflowError``:
    a ``rope_theta`` of 400 digits) is kept as its text, shortened, and refused as ``1e999``."""
    value = int(text)
    if finite_float(value):
        return value
    digits = text.lstrip("-")
    short = text if len(digits) <= 20 else f"{text[: len(text) - len(digits) + 10]}... "
    return _Constant(short if short == text else f"{short}({len(digits)} digits)")


def finite_float(value: object) -> bool:
    """Whether ``value`` is a real number (an int, a float, a NumPy scalar; not a bool) whose
    float is finite: not a NaN, an infinity, or an integer too large for a float
    (``math.isfinite`` and ``float()`` raise ``OverflowError`` for ``10**400``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _constant_in(value: Any) -> str | None:
    if isinstance(value, _Constant):
        return str(value)
    if isinstance(value, list):
        return next((c for c in map(_constant_in, value) if c is not None), None)
    return None  # objects were checked when they were built


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    for key, value in pairs:
        constant = _constant_in(value)
        if constant is not None:
            raise NonFiniteNumber(constant, key)
    return dict(pairs)


def parse_json(text: str) -> Any:
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and numbers that overflow a float
    (``1e999``, an integer beyond a float's range).

    Raises:
        NonFiniteNumber: The text holds one (a ``ValueError``, like a syntax error).
        ValueError: The text is not JSON.
    """
    doc = json.loads(
        text,
        parse_constant=_Constant,
        parse_float=_float,
        parse_int=_int,
        object_pairs_hook=_object,
    )
    constant = _constant_in(doc)
    if constant is not None:
        raise NonFiniteNumber(constant)
    return doc


def brief(value: Any, limit: int = 40) -> str:
    """``value`` for a one-line message, never raising: ``repr`` cut to ``limit`` characters; an
    int of more than about 40 digits by its number of digits (``repr`` of one past 4300 digits
    raises ``ValueError``); an array or tensor by its type and shape; a value whose ``repr``
    fails by its type."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        digits = math.floor(abs(value).bit_length() * math.log10(2)) + 1
        return f"{'a negative' if value < 0 else 'an'} int of about {digits} digits"
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, numbers.Number):
        try:
            return f"a {type(value).__name__} of shape {tuple(shape)}"
        except Exception:  # a shape that is not a sequence: repr below
            pass
    try:
        text = repr(value)
    except Exception:  # a huge int inside a container, a broken __repr__
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: max(limit - 3, 1)] + "..."
