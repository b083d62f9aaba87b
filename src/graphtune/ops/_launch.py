"""What picks a Triton binary for a launch, and launches that skip Triton's per-call binding.

:func:`binary_key` says which compiled binary a launch ``kernel[grid](*args, **meta)`` runs: the
kernel, its compile-time parameters and options (``meta``), and each positional argument the way
Triton's default specialisation sees it. It is at least as fine as Triton's own key, so two
launches with one key always run one binary:

* a tensor: its dtype, its device and whether its address is a multiple of 16 bytes;
* an int: whether it is 1, a multiple of 16, or neither, and whether it needs 64 bits; for a
  parameter declared ``do_not_specialize`` only the width;
* a bool, a float, ``None``, a string, a dtype: the value itself (Triton specialises fewer of
  them; a finer key only costs an extra entry);
* any argument bound to a ``tl.constexpr`` parameter: its value.

:class:`LaunchCache` uses it to launch without ``JITFunction.run``. That call binds the arguments
in Python, specialises each one, formats the compile options into its cache key, checks the
kernel's globals and reads Triton's settings, on every launch: tens of microseconds of host time
that a replayed CUDA graph hides, but that every capture, every eager step and every one of the
tuner's timing captures pays for each launch. The first launch of a key goes through Triton as
usual and returns the ``CompiledKernel`` it ran; the cache keeps it with the values of the
parameters after the positional ones (the compile-time ones, from ``meta`` or their defaults),
and later launches of that key call ``compiled[grid](*args, *rest)`` directly. That is the same
binary with the same arguments in the same order as Triton's own launch, on the current stream.

The cache is used only for plain ``JITFunction`` kernels on Triton 3.3 or later (where a compiled
kernel takes every parameter, compile-time ones included, as Triton's own launch passes them),
never under the interpreter, and not for a launch that passes a runtime argument by keyword
(``meta`` then holds values that change per call). ``GRAPHTUNE_FAST_LAUNCH=0`` turns it off.
It does not see changes Triton would: a kernel's globals redefined after its first launch, or
Triton's debug settings changed while the process runs.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch

#: Entries kept before the cache starts over (a float argument that changes every call would
#: otherwise grow it without bound).
MAX_ENTRIES = 4096
_INT32 = 2**31


def _tensor_key(value: torch.Tensor) -> tuple[Any, ...]:
    return ("t", value.dtype, value.get_device(), value.data_ptr() % 16 == 0)


def _int_key(value: int, specialize: bool) -> tuple[Any, ...]:
    wide = not -_INT32 <= value < _INT32
    if not specialize:
        return ("i", wide)
    return ("i", 1 if value == 1 else (16 if value % 16 == 0 else 0), wide)


class KernelParams:
    """What :func:`binary_key` needs to know about one kernel's parameters (read once).

    Attributes:
        names: Parameter names in declaration order.
        constexpr: Positions of the ``tl.constexpr`` parameters.
        plain: Positions of the parameters declared ``do_not_specialize``.
        defaults: Default value of each parameter that has one, by name.
    """

    __slots__ = ("names", "constexpr", "plain", "defaults")

    def __init__(self, kernel: Any) -> None:
        self.names: tuple[str, ...] = tuple(getattr(kernel, "arg_names", None) or ())
        params = getattr(kernel, "params", None)
        if params is not None:
            constexpr = {i for i, p in enumerate(params) if getattr(p, "is_constexpr", False)}
        else:  # the interpreter's function has no params: its compile-time ones by annotation
            constexpr = _annotated_constexpr(kernel, self.names)
        self.constexpr = frozenset(constexpr)
        self.plain = _unspecialized_positions(kernel, self.names)
        self.defaults = _defaults(kernel)


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


def _defaults(kernel: Any) -> dict[str, Any]:
    fn = getattr(kernel, "fn", None)
    try:
        signature = inspect.signature(fn) if fn is not None else None
    except (TypeError, ValueError):
        signature = None
    if signature is None:
        return {}
    return {
        name: p.default
        for name, p in signature.parameters.items()
        if p.default is not inspect.Parameter.empty
    }


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


def binary_key(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> tuple[Any, ...]:
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


@functools.lru_cache(maxsize=1)
def triton_launches_every_param() -> bool:
    """Whether the installed Triton's compiled kernels take every parameter, compile-time ones
    included, in declaration order (Triton 3.3 and later); before that they took only the
    runtime ones."""
    try:
        import triton
    except ImportError:
        return False
    try:
        major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (3, 3)


def trailing_values(
    kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]
) -> tuple[Any, ...] | None:
    """The values of ``kernel``'s parameters after ``args`` as Triton binds them for this launch
    (from ``meta``, else their defaults), or ``None`` when one of them is a runtime parameter (its
    value may change from call to call) or has neither."""
    info = kernel_params(kernel)
    rest = []
    for position in range(len(args), len(info.names)):
        name = info.names[position]
        if position not in info.constexpr:
            return None
        if name in meta:
            rest.append(meta[name])
        elif name in info.defaults:
            rest.append(info.defaults[name])
        else:
            return None
    return tuple(rest)


def _plain_jit_function(kernel: Any) -> bool:
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return type(kernel) is JITFunction


class LaunchCache:
    """Compiled kernels by :func:`binary_key`, launched without ``JITFunction.run``.

    Args:
        current_device: Index of the current CUDA device (Triton compiles and launches on it).
    """

    def __init__(self, current_device: Callable[[], int] = torch.cuda.current_device) -> None:
        self._current_device = current_device
        self._entries: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}
        self.hits = 0
        self.misses = 0

    def key(self, kernel: Any, args: tuple[Any, ...], meta: dict[str, Any], extra: Any) -> Any:
        """The entry key of a launch (``extra``: what else decides the binary, e.g. the PDL
        switch), or ``None`` when this launch cannot use the cache."""
        if not _plain_jit_function(kernel) or not triton_launches_every_param():
            return None
        try:
            return (self._current_device(), extra, binary_key(kernel, args, meta))
        except TypeError:  # an unhashable value: Triton's own launch handles it
            return None

    def launch(self, key: Any, grid: tuple[int, ...], args: tuple[Any, ...]) -> bool:
        """Launches the entry of ``key`` on ``grid``; ``False`` when there is none."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        compiled, rest = entry
        size = len(grid)
        full = (grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1)
        compiled[full](*args, *rest)
        self.hits += 1
        return True

    def remember(
        self, key: Any, kernel: Any, args: tuple[Any, ...], meta: dict[str, Any], compiled: Any
    ) -> None:
        """Keeps ``compiled`` (what ``kernel[grid](*args, **meta)`` returned) for ``key``, with
        :func:`trailing_values`; nothing when those cannot be fixed."""
        self.misses += 1
        rest = trailing_values(kernel, args, meta)
        if compiled is None or not hasattr(compiled, "__getitem__") or rest is None:
            return
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.clear()
        self._entries[key] = (compiled, rest)

    def clear(self) -> None:
        """Forgets every entry (the next launch of each key goes through Triton again)."""
        self._entries.clear()
