"""What picks a Triton binary for a launch: :func:`launch_key`.

A launch ``kernel[grid](*args, **meta)`` runs one compiled binary of the kernel. :func:`launch_key`
says which, at least as finely as Triton's default specialisation does, so two launches with one
key always run one binary (a finer key only means a binary is looked for twice):

* the kernel, and its compile-time parameters and options (``meta``);
* a tensor: its dtype, its device and whether its address is a multiple of 16 bytes;
* an int: whether it is 1, a multiple of 16, or neither, and whether it needs 64 bits; for a
  parameter declared ``do_not_specialize`` only the width;
* a bool, a float, ``None``, a string, a dtype: the value itself;
* any argument bound to a ``tl.constexpr`` parameter: its value.

A runner uses it to find which of its (profile, tactic) pairs share one binary before compiling
them (:mod:`graphtune.ops._triton_runner`). ``tests/cpu/sm90_compile.py`` checks the "at least
as fine" rule against the JIT's own specialisation over every launch the runners make.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch

_INT32 = 2**31


def _tensor_key(value: torch.Tensor) -> tuple[Any, ...]:
    return ("t", value.dtype, value.get_device(), value.data_ptr() % 16 == 0)


def _int_key(value: int, specialize: bool) -> tuple[Any, ...]:
    wide = not -_INT32 <= value < _INT32
    if not specialize:
        return ("i", wide)
    return ("i", 1 if value == 1 else (16 if value % 16 == 0 else 0), wide)


class KernelParams:
    """What :func:`launch_key` needs to know about one kernel's parameters (read once).

    Attributes:
        names: Parameter names in declaration order.
        constexpr: Positions of the ``tl.constexpr`` parameters.
        plain: Positions of the parameters declared ``do_not_specialize``.
    """

    __slots__ = ("names", "constexpr", "plain")

    def __init__(self, kernel: Any) -> None:
        self.names: tuple[str, ...] = tuple(getattr(kernel, "arg_names", None) or ())
        params = getattr(kernel, "params", None)
        if params is not None:
            constexpr = {i for i, p in enumerate(params) if getattr(p, "is_constexpr", False)}
        else:  # the interpreter's function has no params: its compile-time ones by annotation
            constexpr = _annotated_constexpr(kernel, self.names)
        self.constexpr = frozenset(constexpr)
        self.plain = _unspecialized_positions(kernel, self.names)


def _annotated_constexpr(kernel: Any, names: tuple[str, ...]) -> set[int]:
    fn = getattr(kernel, "fn", None)
    if fn is None:
        return set()
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return set()
    found = set()
    for i, name in enumerate(names):
        param = signature.parameters.get(name)
        text = str(param.annotation) if param is not None else ""
        if "constexpr" in text:
            found.add(i)
    return found


def _unspecialized_positions(kernel: Any, names: tuple[str, ...]) -> frozenset[int]:
    # ``@triton.jit(do_not_specialize=...)`` by name or position; the interpreter's function
    # keeps the decorator's arguments in ``kwargs``.
    declared = getattr(kernel, "do_not_specialize", None)
    if declared is None:
        declared = getattr(kernel, "kwargs", {}).get("do_not_specialize")
    return frozenset(
        d if isinstance(d, int) else names.index(d)
        for d in declared or ()
        if isinstance(d, int) or d in names
    )


_PARAMS: dict[int, tuple[Any, KernelParams]] = {}
_PARAMS_LOCK = threading.Lock()


def kernel_params(kernel: Any) -> KernelParams:
    """The :class:`KernelParams` of ``kernel``, computed on its first use in this process."""
    found = _PARAMS.get(id(kernel))
    if found is not None and found[0] is kernel:
        return found[1]
    params = KernelParams(kernel)
    with _PARAMS_LOCK:  # the entry keeps the kernel alive, so its id is never reused
        _PARAMS[id(kernel)] = (kernel, params)
    return params


def launch_key(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> tuple[Any, ...]:
    """What decides the binary ``kernel[grid](*args, **meta)`` runs (see the module docstring).

    Raises:
        TypeError: A value of ``meta``, or an argument the key holds by value, is unhashable.
    """
    info = kernel_params(kernel)
    parts: list[Any] = [id(kernel), tuple(sorted(meta.items()))]
    constexpr, plain = info.constexpr, info.plain
    for i, value in enumerate(args):
        if i in constexpr:
            parts.append(("c", value))
        elif isinstance(value, torch.Tensor):
            parts.append(_tensor_key(value))
        elif isinstance(value, bool) or not isinstance(value, int):
            parts.append((type(value), value))
        else:
            parts.append(_int_key(value, i not in plain))
    key = tuple(parts)
    hash(key)
    return key
