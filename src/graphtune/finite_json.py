"""JSON as the standard writes it: Python's ``json`` reads ``NaN``, ``Infinity`` and
``-Infinity``, which JSON has not, and graphtune's files (tuning caches, misses records,
results) never hold; a hand-edited file could smuggle one in (a NaN time into a cache's merge
rule, a NaN epsilon into a model). :func:`parse_json` refuses them and names the field."""

from __future__ import annotations

import json
import math
from typing import Any


class NonFiniteNumber(ValueError):
    """A ``NaN`` or ``Infinity`` in JSON text.

    Attributes:
        constant: The spelling found (``"NaN"``, ``"Infinity"``, ``"-Infinity"``).
        field: The key of the object it is a value of (inside lists too), or ``None`` outside
            any object.
    """

    def __init__(self, constant: str, field: str | None = None) -> None:
        where = f" in field {field!r}" if field is not None else ""
        super().__init__(f"non-finite number {constant}{where} (JSON has none)")
        self.constant, self.field = constant, field


class _Constant(str):
    """What the parser makes of a non-finite constant until :func:`parse_json` refuses it."""


def _float(text: str) -> float | _Constant:
    """A JSON number as a float; one too large for a float (``1e999``) would be an infinity,
    so it is kept as its text and refused like ``Infinity``."""
    value = float(text)
    return value if math.isfinite(value) else _Constant(text)


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
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and numbers that overflow a float.

    Raises:
        NonFiniteNumber: The text holds one (a ``ValueError``, like a syntax error).
        ValueError: The text is not JSON.
    """
    doc = json.loads(text, parse_constant=_Constant, parse_float=_float, object_pairs_hook=_object)
    constant = _constant_in(doc)
    if constant is not None:
        raise NonFiniteNumber(constant)
    return doc
