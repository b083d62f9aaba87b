"""Timing helpers on the library's own timers: per-call time, copy bandwidth, bytes floor, and
how fast the host runs Python and torch's dispatcher (:func:`host_speed`).

Per-call times come from :mod:`graphtune.autotuner.timing`: CUDA events around back-to-back calls
without a delay kernel on CUDA (``EventTimer(delay=False)``: what a caller pays, host launch cost
and idle gaps included), the wall clock elsewhere. A timer can be passed in, so CPU tests drive
the real helpers with a fake one. GPU-busy time from CUPTI is in :mod:`graphtune.bench.cupti`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from graphtune.autotuner.timing import EventTimer, WallClockTimer
from graphtune.autotuner.timing.base import Measurement, Timer

if TYPE_CHECKING:
    from graphtune.engine.config import ModelConfig


def sync(device: torch.device) -> None:
    """Waits for ``device`` to drain (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_timer(device: torch.device, repeats: int) -> Timer:
    """The timer :func:`time_per_call_ms` uses on ``device``, with ``repeats`` samples."""
    if device.type == "cuda":
        return EventTimer(samples=repeats, delay=False, device=device)
    return WallClockTimer(samples=repeats)


def time_per_call_ms(
    fn: Callable[[], object],
    device: torch.device,
    steps: int,
    repeats: int,
    *,
    warmup: int = 3,
    timer: Timer | None = None,
) -> float:
    """Median over ``repeats`` samples of the mean time of ``steps`` back-to-back calls, in ms
    (:func:`measure_per_call`'s median).

    On CUDA the calls are bracketed by CUDA events (no host synchronisation per call, no delay
    kernel), so a host-bound eager step is measured as the GPU sees it, idle gaps included, and
    graph replays are not charged a synchronisation each.

    Args:
        fn: One call (e.g. a decode step with its inputs bound).
        device: Where it runs.
        steps: Calls per sample.
        repeats: Samples.
        warmup: Untimed calls first.
        timer: Replaces :func:`call_timer`'s choice (tests).
    """
    return measure_per_call(fn, device, steps, repeats, warmup=warmup, timer=timer).median_us / 1e3


def measure_per_call(
    fn: Callable[[], object],
    device: torch.device,
    steps: int,
    repeats: int,
    *,
    warmup: int = 3,
    timer: Timer | None = None,
) -> Measurement:
    """The per-call :class:`~graphtune.autotuner.timing.base.Measurement` behind
    :func:`time_per_call_ms` (median, fastest sample and relative spread of the ``repeats``
    samples, in µs); same arguments."""
    chosen = timer if timer is not None else call_timer(device, repeats)
    return chosen.measure(lambda i: fn(), warmup=warmup, repeat=steps)


def copy_bandwidth_gbps(
    device: torch.device, nbytes: int = 1 << 30, *, timer: Timer | None = None
) -> float | None:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written; ``None``
    off CUDA (the bytes floor is a GPU notion)."""
    if device.type != "cuda" and timer is None:
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = time_per_call_ms(lambda: dst.copy_(src), device, steps=10, repeats=5, timer=timer)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def kv_positions_read(context: int, config: ModelConfig) -> int:
    """K/V positions one decode row at ``context`` must read: ``context + 1`` (the keys up to
    its own), or the last ``sliding_window`` of them when the model has a window (the mask hides
    the older keys, and the Triton attention reads only the visible span)."""
    visible = context + 1
    window = config.sliding_window
    return visible if window is None else min(visible, window)


def bytes_floor_ms(nbytes: int, bandwidth_gbps: float) -> float:
    """The time to move ``nbytes`` once at ``bandwidth_gbps``: a memory-bound step's floor."""
    return nbytes / (bandwidth_gbps * 1e9) * 1e3


def _python_work() -> int:
    total = 0
    for i in range(1000):
        total += i & 7
    return total


def host_speed(
    *, repeats: int = 5, calls: int = 1000, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """How fast this process's host thread runs, for results whose time is spent on the host
    (captures, tuning, a restart): the median over ``repeats`` samples of the time per call of a
    fixed pure-Python loop (``python_loop_us``, 1000 additions) and of ``torch.empty`` on the CPU
    (``torch_empty_us``, the dispatcher and allocator). Two runs of the same code on hosts whose
    values differ by 2x differ in their host-bound times by about as much, so a result with
    these fields can be compared with one from another process or machine.

    Args:
        repeats: Samples (each ``calls`` back-to-back calls).
        calls: Calls per sample.
        clock: Seconds (tests pass a fake).
    """
    cpu = torch.device("cpu")

    def per_call_us(fn: Callable[[], object]) -> float:
        timer = WallClockTimer(samples=repeats, clock=clock)
        return 1e3 * time_per_call_ms(fn, cpu, calls, repeats, warmup=1, timer=timer)

    return {
        "python_loop_us": per_call_us(_python_work),
        "torch_empty_us": per_call_us(lambda: torch.empty(8)),
    }
