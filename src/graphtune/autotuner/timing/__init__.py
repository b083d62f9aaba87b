"""Timers behind one protocol, and cold-L2 input rotation.

* :class:`GraphTimer` (``"graph"``): back-to-back calls captured in one CUDA graph, replays timed
  with events. The default on CUDA: it measures the op the way it runs inside a graph, without
  host launch cost. It is a :class:`SessionTimer`: ``open`` captures once and every measurement
  of the session replays that graph.
* :class:`EventTimer` (``"events"``): CUDA events around back-to-back calls issued behind a delay
  kernel sized from the measured host launch cost. For ops that cannot be captured.
* :class:`WallClockTimer` (``"wallclock"``): host clock around windows of calls. The default on
  CPU.

:func:`resolve_timer` maps a ``TuningConfig.timing`` string and a device to a timer;
:func:`l2_cache_bytes` and :func:`cold_l2_copies` size cold-L2 rotation.
"""

from __future__ import annotations

import functools

import torch

from graphtune.autotuner.timing._checks import as_device
from graphtune.autotuner.timing.base import (
    Measurement,
    SessionTimer,
    TimedFn,
    Timer,
    TimerSession,
)
from graphtune.autotuner.timing.cold_l2 import (
    cold_l2_copies,
    device_memory_bytes,
    input_set_bytes,
    l2_cache_bytes,
    rotating,
)
from graphtune.autotuner.timing.delay import GpuDelay, delay_us_for_host_time
from graphtune.autotuner.timing.events import EventTimer
from graphtune.autotuner.timing.graph import GraphSession, GraphTimer, sizes_its_samples
from graphtune.autotuner.timing.sizing import auto_repeat_calls
from graphtune.autotuner.timing.wallclock import WallClockTimer
from graphtune.errors import ConfigError

#: The timing modes :func:`resolve_timer` accepts.
TIMING_MODES = ("auto", "graph", "events", "wallclock")

__all__ = [
    "TIMING_MODES",
    "EventTimer",
    "GpuDelay",
    "GraphSession",
    "GraphTimer",
    "Measurement",
    "SessionTimer",
    "TimedFn",
    "Timer",
    "TimerSession",
    "WallClockTimer",
    "auto_repeat_calls",
    "cold_l2_copies",
    "device_memory_bytes",
    "delay_us_for_host_time",
    "input_set_bytes",
    "l2_cache_bytes",
    "resolve_timer",
    "rotating",
    "sizes_its_samples",
]


def resolve_timer(mode: str, device: torch.device | str | int | None) -> Timer:
    """Returns the timer for a timing mode on a device.

    Args:
        mode: ``"auto"`` (graph on CUDA, wallclock on CPU), ``"graph"``, ``"events"`` or
            ``"wallclock"`` (on a CUDA device it synchronizes the device around each window).
        device: Device of the inputs being timed. ``None`` means the CPU.

    Returns:
        A new timer instance with default settings.

    Raises:
        ConfigError: Unknown mode, or ``"graph"``/``"events"`` (or a CUDA device) without CUDA.
    """
    if not isinstance(mode, str) or mode not in TIMING_MODES:
        raise ConfigError(
            f"unknown timing mode {mode!r}; use one of {', '.join(repr(m) for m in TIMING_MODES)}"
        )
    resolved = as_device(device) or torch.device("cpu")
    is_cuda = resolved.type == "cuda"
    if is_cuda and not torch.cuda.is_available():
        raise ConfigError(
            f"timing mode {mode!r} was asked for device {resolved}, but torch.cuda.is_available() "
            "is False; pass CPU tensors, or run on a machine with CUDA"
        )
    if mode == "auto":
        mode = "graph" if is_cuda else "wallclock"
    if mode in ("graph", "events") and not is_cuda:
        raise ConfigError(
            f"timing mode {mode!r} times CUDA work, but the inputs are on {resolved}; "
            "use timing='wallclock' or 'auto' for CPU tensors"
        )
    if mode == "graph":
        return GraphTimer(device=resolved)
    if mode == "events":
        return EventTimer(device=resolved)
    if is_cuda:
        return WallClockTimer(sync=functools.partial(torch.cuda.synchronize, resolved))
    return WallClockTimer()
