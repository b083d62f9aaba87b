"""Cold-L2 mode: rotate input copies whose total exceeds the device's last-level cache.

Timing the same inputs over and over measures a kernel whose operands sit in L2, which flatters
memory-bound kernels compared with a real model step (there, the previous layer's work has
evicted them). Cold-L2 mode makes ``n`` copies of the input set and has the ``i``-th timed call
use copy ``i % n``. With ``copies * bytes >= factor * L2`` and ``factor >= 2``, the other
``n - 1`` copies touched between two uses of one copy always exceed the L2 size, so each call
finds its operands evicted (:func:`cold_l2_copies`). The timer must run at least ``n`` calls per
sample for this to hold (for the graph timer: ``repeat >= copies``).

The L2 size is read from the device (``torch.cuda.get_device_properties(d).L2_cache_size``). Where
a torch build lacks that attribute, :data:`CUDA_L2_FALLBACK_BYTES` (128 MiB, above every current
NVIDIA part) is used: overestimating only costs memory, underestimating would leave inputs hot.
On CPU the largest cache level listed under ``/sys/devices/system/cpu/cpu0/cache`` is used, else
:data:`CPU_CACHE_FALLBACK_BYTES`.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from graphtune.autotuner.timing._checks import as_device, check_int, check_number
from graphtune.autotuner.timing.base import TimedFn
from graphtune.errors import ConfigError

logger = logging.getLogger(__name__)

#: L2 size assumed for a CUDA device whose properties do not report one (128 MiB).
CUDA_L2_FALLBACK_BYTES = 128 * 1024 * 1024
#: Cache size assumed for a CPU whose cache sizes cannot be read (32 MiB).
CPU_CACHE_FALLBACK_BYTES = 32 * 1024 * 1024
#: Default cap on the number of copies: below this many, rotating them costs little host memory.
DEFAULT_MAX_COPIES = 16_384
#: Default cap on the copies' total bytes, as a fraction of device (or host) memory.
DEFAULT_MAX_MEMORY_FRACTION = 0.25

_CPU_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
_warned: set[tuple[str, int, int]] = set()


def l2_cache_bytes(device: torch.device | str | int | None) -> int:
    """Returns the size in bytes of the cache that cold-L2 mode must overflow.

    Args:
        device: A CUDA device (its L2 size, read from the device properties) or the CPU (the
            largest cache level the kernel reports). An int means ``cuda:<int>``; ``None`` means
            the current CUDA device when CUDA is available, else the CPU.

    Returns:
        The cache size in bytes (> 0). Falls back to :data:`CUDA_L2_FALLBACK_BYTES` or
        :data:`CPU_CACHE_FALLBACK_BYTES` (with a warning for CUDA) when it cannot be read.

    Raises:
        ConfigError: A CUDA device was requested but CUDA is not available.
    """
    resolved = _resolve(device)
    if resolved.type != "cuda":
        return _cpu_cache_bytes(_CPU_CACHE_DIR)
    if not torch.cuda.is_available():
        raise ConfigError(
            f"cannot read the L2 size of {resolved}: torch.cuda.is_available() is False; "
            "pass a CPU device, or run on a machine with CUDA"
        )
    index = resolved.index if resolved.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    size = getattr(props, "L2_cache_size", None)  # absent in some torch builds
    if isinstance(size, int) and size > 0:
        return size
    key = ("cuda-l2", index, 0)
    if key not in _warned:
        _warned.add(key)
        logger.warning(
            "cuda:%d (%s): this torch build does not report L2_cache_size; assuming %d MiB for "
            "cold-L2 rotation (more than any current NVIDIA GPU, so inputs still go cold)",
            index,
            getattr(props, "name", "?"),
            CUDA_L2_FALLBACK_BYTES // (1024 * 1024),
        )
    return CUDA_L2_FALLBACK_BYTES


def _resolve(device: torch.device | str | int | None) -> torch.device:
    """``None`` means the current CUDA device when CUDA is available, else the CPU."""
    resolved = as_device(device)
    if resolved is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return resolved


@functools.lru_cache(maxsize=4)
def _cpu_cache_bytes(cache_dir: Path) -> int:
    """Largest cache size listed in sysfs (the last level), else the fallback constant."""
    sizes: list[int] = []
    try:
        entries = sorted(cache_dir.glob("index*"))
    except OSError:
        entries = []
    for entry in entries:
        try:
            kind = (entry / "type").read_text().strip()
            text = (entry / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        parsed = parse_cache_size(text)
        if parsed:
            sizes.append(parsed)
    return max(sizes) if sizes else CPU_CACHE_FALLBACK_BYTES


def parse_cache_size(text: str) -> int | None:
    """Parses a sysfs cache size such as ``"32768K"``, ``"1M"`` or ``"512"`` into bytes."""
    text = text.strip().upper()
    if not text:
        return None
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1], 1)
    digits = text[:-1] if text[-1] in "KMG" else text
    try:
        value = int(digits)
    except ValueError:
        return None
    return value * scale if value > 0 else None


def device_memory_bytes(device: torch.device) -> int:
    """The memory of ``device``: a GPU's total memory, the host's physical memory otherwise
    (16 GiB when the platform does not say)."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not every platform has these names
        return 16 * 1024**3


def _default_max_total_bytes(device: torch.device) -> int:
    return int(device_memory_bytes(device) * DEFAULT_MAX_MEMORY_FRACTION)


def cold_l2_copies(
    bytes_per_input_set: int,
    device: torch.device | str | int | None,
    *,
    l2_bytes: int | None = None,
    factor: float = 2.0,
    min_copies: int = 2,
    max_copies: int = DEFAULT_MAX_COPIES,
    max_total_bytes: int | None = None,
) -> int:
    """Returns how many copies of an input set to rotate so the timed calls find L2 cold.

    ``copies = max(min_copies, ceil(factor * L2 / bytes_per_input_set))``, so
    ``copies * bytes_per_input_set >= factor * L2 > L2``: between two uses of one copy, the others
    touch at least one L2 size. The count is capped at ``max_copies`` (with a warning: input sets
    that small stay partly in L2, as they would in a real step).

    Args:
        bytes_per_input_set: Bytes of one set of inputs (all tensors of one call; see
            :func:`input_set_bytes`).
        device: Device whose cache to overflow (see :func:`l2_cache_bytes`).
        l2_bytes: Cache size to use instead of reading it from ``device``.
        factor: Multiple of the L2 size the copies must total (> 1; 2 gives margin for cache
            policies that are not strict LRU).
        min_copies: Lower bound (>= 2: one copy can never be cold on its second use).
        max_copies: Upper bound on the count.
        max_total_bytes: Largest total the copies may take; default a quarter of the device's
            (or, for CPU, the host's) memory.

    Returns:
        The number of copies.

    Raises:
        ConfigError: An argument is out of range, or the copies would exceed ``max_total_bytes``.
    """
    if isinstance(bytes_per_input_set, bool) or not isinstance(bytes_per_input_set, int):
        raise ConfigError(f"bytes_per_input_set must be an int, got {bytes_per_input_set!r}")
    if bytes_per_input_set <= 0:
        raise ConfigError(
            f"cold-L2 rotation needs inputs with bytes > 0, got {bytes_per_input_set}; "
            "turn cold_l2 off for ops without tensor inputs"
        )
    who = "cold_l2_copies"
    # factor > 1 so the copies exceed L2; a str or nan would fail in the comparison or ceil below.
    check_number(who, "factor", factor, above=1, default=2.0)
    check_int(who, "min_copies", min_copies, minimum=2, default=2)
    check_int(who, "max_copies", max_copies, minimum=min_copies, default=DEFAULT_MAX_COPIES)
    if l2_bytes is not None:
        check_number(who, "l2_bytes", l2_bytes, above=0, default=50 * 1024**2)
    if max_total_bytes is not None:
        check_number(who, "max_total_bytes", max_total_bytes, above=0, default=8 * 1024**3)
    resolved = _resolve(device)
    l2 = l2_cache_bytes(resolved) if l2_bytes is None else int(l2_bytes)
    if l2 <= 0:
        raise ConfigError(f"{who}: l2_bytes must be >= 1 byte, got {l2_bytes!r}; pass None")
    copies = max(min_copies, math.ceil(factor * l2 / bytes_per_input_set))
    if copies > max_copies:
        key = ("cap", bytes_per_input_set, l2)
        if key not in _warned:
            _warned.add(key)
            logger.warning(
                "cold-L2: an input set of %d bytes would need %d copies to exceed %.0fx the "
                "%d-byte L2; capping at %d copies (%d bytes), so these inputs stay partly in L2",
                bytes_per_input_set,
                copies,
                factor,
                l2,
                max_copies,
                max_copies * bytes_per_input_set,
            )
        copies = max_copies
    limit = _default_max_total_bytes(resolved) if max_total_bytes is None else max_total_bytes
    total = copies * bytes_per_input_set
    if total > limit:
        raise ConfigError(
            f"cold-L2 rotation needs {copies} copies of {bytes_per_input_set} bytes "
            f"= {total / 1024**3:.2f} GiB, above the limit of {limit / 1024**3:.2f} GiB. Rule: the "
            "copies must total more than the L2 size and fit in memory. Remedies: turn cold_l2 "
            "off for this op (its inputs are far larger than L2, so they are cold anyway), lower "
            "max_value to shrink the largest bucket, or pass a larger max_total_bytes."
        )
    return copies


def input_set_bytes(inputs: Any) -> int:
    """Bytes of all distinct tensors in a nested structure (tuples, lists, dicts) of inputs."""
    seen: set[int] = set()
    total = 0
    stack = [inputs]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if id(item) not in seen:
                seen.add(id(item))
                total += item.numel() * item.element_size()
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def rotating(call: Callable[[Any], object], input_sets: Sequence[Any]) -> TimedFn:
    """Returns ``fn(i)`` that calls ``call(input_sets[i % len(input_sets)])``.

    Args:
        call: Runs the op on one input set.
        input_sets: The copies to rotate through (at least one).

    Raises:
        ConfigError: ``input_sets`` is empty.
    """
    if not input_sets:
        raise ConfigError("rotating() needs at least one input set")
    count = len(input_sets)

    def fn(index: int) -> object:
        return call(input_sets[index % count])

    return fn
