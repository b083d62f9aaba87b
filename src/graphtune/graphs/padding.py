"""Pad rules: how the graph runner fills the rows between a call's batch and the captured size.

A rule is ``"zeros"``, ``"repeat"`` (row 0), a number or a callable ``fn(pad_rows, real_rows)``
(:data:`PadRule`). This module says which values are rules, rejects the ones that cannot work
before anything is captured, and turns a rule into the filler a padded call runs
(:class:`~graphtune.graphs.buffers.StaticInputs` uses them).
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable
from typing import Any

import torch

from graphtune.errors import ConfigError
from graphtune.graphs.tree import Path, path_str

PadFn = Callable[[torch.Tensor, torch.Tensor], None]
PadRule = str | int | float | PadFn
"""``"zeros"``, ``"repeat"`` (copy row 0), a number (fill), or ``fn(pad_rows, real_rows)``."""

PAD_RULES = ("zeros", "repeat")


def is_pad_rule(value: Any) -> bool:
    """Whether ``value`` is one pad rule (as opposed to a mapping or structure of rules)."""
    if isinstance(value, str):
        return value in PAD_RULES
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Number) or callable(value)


def check_pad_argument(pad: Any) -> None:
    """Rejects a misspelt top-level pad string early, with the accepted spellings."""
    if isinstance(pad, str) and pad not in PAD_RULES:
        raise ConfigError(
            f"pad={pad!r} is not a pad rule; use 'zeros', 'repeat', a number, a callable "
            "fn(pad_rows, real_rows), or a dict mapping input paths to those"
        )
    if isinstance(pad, bool):
        raise ConfigError("pad=True/False is ambiguous; use 'zeros', 'repeat' or a number")


def check_pad_value(rule: Any, leaf: torch.Tensor, path: Path) -> None:
    """A number pad rule must be a value of the input's dtype: for an integer input an integer
    in its range (1.5 would be truncated to 1, nan and 2**70 fail on every padded call), for a
    floating or complex input one that converts without overflow (``1e6`` for float16, a complex
    number for a real dtype fail on every padded call; ``inf``, ``-inf`` and ``nan`` fit)."""
    if not isinstance(rule, (numbers.Number, str)) and callable(rule):
        _check_pad_callable(rule, path)
    if not isinstance(rule, numbers.Number):
        return
    if leaf.dtype.is_floating_point or leaf.dtype.is_complex:
        _check_float_pad_value(rule, leaf.dtype, path)
        return
    value: int | None = None
    if isinstance(rule, numbers.Integral) or (isinstance(rule, float) and rule.is_integer()):
        value = int(rule)
    info = torch.iinfo(leaf.dtype) if leaf.dtype != torch.bool else None
    in_range = (
        value in (0, 1) if info is None else value is not None and info.min <= value <= info.max
    )
    if not in_range:
        raise ConfigError(
            f"pad rule {rule!r} for input {path_str(path)} is not a value of its dtype "
            f"{leaf.dtype}; give an integer"
            + (f" in [{info.min}, {info.max}]" if info is not None else " (0 or 1)")
        )


def _check_pad_callable(rule: Callable, path: Path) -> None:
    """A callable rule is called as ``fn(pad_rows, real_rows)`` on every padded call; one that
    cannot take those two arguments is refused here (unless its signature cannot be read)."""
    try:
        signature = inspect.signature(rule)
    except (TypeError, ValueError):  # some builtins and extension types
        return
    try:
        signature.bind(None, None)
    except TypeError as exc:
        name = getattr(rule, "__qualname__", None) or repr(rule)
        raise ConfigError(
            f"pad rule {name}{signature} for input {path_str(path)} cannot be called as "
            f"fn(pad_rows, real_rows) ({exc}); give a callable taking those two tensors and "
            "writing pad_rows in place"
        ) from None


def _check_float_pad_value(rule: Any, dtype: torch.dtype, path: Path) -> None:
    """Fills a small CPU tensor of ``dtype`` as every padded call fills its rows (two elements:
    a one-element fill takes a path that does not check for overflow)."""
    try:
        if not dtype.is_complex and not isinstance(rule, numbers.Real):
            raise TypeError("a complex number for a real dtype")
        torch.empty(2, dtype=dtype).fill_(rule)
    except (RuntimeError, OverflowError, TypeError) as exc:
        if dtype.is_complex:
            hint = "a number in its range"
        else:
            info = torch.finfo(dtype)
            hint = f"a real number in [{info.min:g}, {info.max:g}] (or inf, -inf, nan)"
        raise ConfigError(
            f"pad rule {rule!r} for input {path_str(path)} is not a value of its dtype "
            f"{dtype} ({exc}); give {hint}"
        ) from None


def pad_filler(rule: PadRule | None, pad_rows: torch.Tensor, real_rows: torch.Tensor) -> Callable:
    """A zero-argument callable that fills ``pad_rows`` by ``rule`` (run on every padded call)."""
    if rule is None or rule == "zeros":
        return pad_rows.zero_
    if rule == "repeat":
        # Reads row 0 at execution time, so it always repeats the current call's first row.
        return functools.partial(pad_rows.copy_, real_rows[0:1].expand_as(pad_rows))
    if isinstance(rule, numbers.Number):
        return functools.partial(pad_rows.fill_, rule)
    if not callable(rule):
        raise ConfigError(f"pad rule {rule!r} is not 'zeros', 'repeat', a number or a callable")
    return functools.partial(rule, pad_rows, real_rows)
