"""Device time of a callable from CUPTI (through ``torch.profiler``): the ground truth.

* :func:`cupti_kernel_time` — the device-side durations of a callable's kernels (and the memcpy /
  memset it issues), summed per call, median over calls.
* :func:`gpu_busy` — the same trace read for a report: busy time per call, device activities per
  call and the kernels that take the time.
* :func:`device_events_from_trace`, :func:`group_per_call` — the trace parsing both use (pure,
  tested on synthetic traces).

Importing this module needs torch but no GPU.
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphtune.bench.kernel_families import kernel_families

logger = logging.getLogger(__name__)

#: Trace categories that are device work: kernels, and memset/memcpy the op itself issues.
DEVICE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


@dataclass(frozen=True)
class DeviceEvent:
    """One device-side activity from a profiler trace (times in microseconds)."""

    name: str
    category: str
    start_us: float
    duration_us: float
    #: Correlation id of the launching API call; every kernel of one graph replay carries the id
    #: of that replay's ``cudaGraphLaunch``. ``None`` when the trace does not say.
    correlation: int | None = None

    @property
    def end_us(self) -> float:
        """End of the activity."""
        return self.start_us + self.duration_us


@dataclass(frozen=True)
class KernelTime:
    """Device time of one call by CUPTI.

    Attributes:
        per_call_us: Median over calls of the summed device durations of one call.
        samples_us: Per-call sums, in call order.
        kernels_per_call: Device activities per call, or ``None`` when the recorded count was not
            a multiple of the calls (then every sample is the total divided by the calls).
        kernel_names: Names of the activities of one call (the first call).
        calls: Profiled calls.
    """

    per_call_us: float
    samples_us: list[float]
    kernels_per_call: int | None
    kernel_names: list[str] = field(default_factory=list)
    calls: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (without the per-call samples)."""
        return {
            "per_call_us": self.per_call_us,
            "min_us": min(self.samples_us) if self.samples_us else None,
            "kernels_per_call": self.kernels_per_call,
            "kernel_names": self.kernel_names,
            "calls": self.calls,
        }


def device_events_from_trace(
    trace: dict[str, Any], categories: Sequence[str] = DEVICE_CATEGORIES
) -> list[DeviceEvent]:
    """Device activities of a Chrome trace (as ``torch.profiler`` exports it), by start time."""
    wanted = set(categories)
    events = [
        DeviceEvent(
            name=str(event.get("name", "")),
            category=str(event["cat"]),
            start_us=float(event.get("ts", 0.0)),
            duration_us=float(event["dur"]),
            correlation=correlation_id(event),
        )
        for event in trace.get("traceEvents", [])
        if isinstance(event, dict)
        and event.get("ph") == "X"
        and event.get("cat") in wanted
        and "dur" in event
    ]
    events.sort(key=lambda e: e.start_us)
    return events


def correlation_id(event: dict[str, Any]) -> int | None:
    """The ``correlation`` id of a trace event (links a kernel to the launch that issued it)."""
    args = event.get("args")
    value = args.get("correlation") if isinstance(args, dict) else None
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def group_per_call(events: Sequence[DeviceEvent], calls: int) -> tuple[list[float], int | None]:
    """Splits device events in call order into per-call sums.

    Returns:
        ``(per_call_us, events_per_call)``. When the event count is not a multiple of ``calls``
        (a lost or extra activity), every call gets the total divided by ``calls`` and the
        second element is ``None``.
    """
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    total = sum(e.duration_us for e in events)
    if not events or len(events) % calls:
        return [total / calls] * calls, None
    size = len(events) // calls
    sums = [sum(e.duration_us for e in events[k * size : (k + 1) * size]) for k in range(calls)]
    return sums, size


def profile_trace(fn: Callable[[int], object], first: int, calls: int, with_cpu: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA]
    if with_cpu:
        activities.insert(0, ProfilerActivity.CPU)
    with profile(activities=activities) as prof:
        for i in range(calls):
            fn(first + i)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def cupti_kernel_time(
    fn: Callable[[int], object],
    *,
    calls: int = 50,
    warmup: int = 5,
    categories: Sequence[str] = DEVICE_CATEGORIES,
) -> KernelTime:
    """Measures the device time of ``fn(i)`` from CUPTI kernel durations.

    Runs ``warmup`` unprofiled calls, then profiles ``calls`` eager calls with
    ``torch.profiler`` (``ProfilerActivity.CUDA``), reads the device activities from the exported
    trace, groups them per call in launch order and returns the median of the per-call sums.
    Device durations do not include host launch gaps, so this is the ground truth the timers
    are compared with. Call it with the same inputs (same cache state) as the timers.

    Raises:
        RuntimeError: The profiler recorded no device activity (CUPTI unavailable).
    """
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    events = device_events_from_trace(profile_trace(fn, warmup, calls, False), categories)
    if not events:
        # Some builds only export device activity when CPU activity is traced too.
        events = device_events_from_trace(profile_trace(fn, warmup, calls, True), categories)
    if not events:
        raise RuntimeError(
            "torch.profiler recorded no device kernels; is CUPTI available to this process "
            "(another profiler attached, or a build without kineto)?"
        )
    samples, per_call = group_per_call(events, calls)
    if per_call is None:
        logger.warning(
            "CUPTI: %d device activities for %d calls is not a multiple; using total / calls",
            len(events),
            calls,
        )
    names = [e.name for e in events[: per_call or 0]]
    return KernelTime(
        per_call_us=statistics.median(samples),
        samples_us=samples,
        kernels_per_call=per_call,
        kernel_names=names,
        calls=calls,
    )


@dataclass(frozen=True)
class BusyTime:
    """Where the GPU time of one call goes, by CUPTI (:func:`gpu_busy`).

    Attributes:
        per_call_ms: Median over calls of the summed device time of one call, in ms.
        activities_per_call: Device activities (kernels, copies) per call.
        top: The kernels that take the most device time, ``{"name", "calls", "us", "share"}``
            per call (``share`` of the busy time), largest first.
        families: Device time and activities per call by kernel family
            (:func:`graphtune.bench.kernel_families.kernel_families`).
    """

    per_call_ms: float
    activities_per_call: float
    top: list[dict[str, Any]]
    families: dict[str, dict[str, Any]] = field(default_factory=dict)


def top_kernels(events: Sequence[DeviceEvent], calls: int, top: int = 8) -> list[dict[str, Any]]:
    """The ``top`` activity names by device time, per call, with their share of the total."""
    by_name: dict[str, list[float]] = {}
    for event in events:
        entry = by_name.setdefault(event.name, [0.0, 0.0])
        entry[0] += event.duration_us
        entry[1] += 1
    busy_us = sum(total for total, _ in by_name.values()) / calls
    ordered = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return [
        {
            "name": name,
            "calls": count / calls,
            "us": total / calls,
            "share": total / calls / busy_us if busy_us > 0 else 0.0,
        }
        for name, (total, count) in ordered
    ]


def gpu_busy(fn: Callable[[], object], *, calls: int = 5, top: int = 8) -> BusyTime | None:
    """GPU-busy time of ``fn()`` and the kernels it spends it in, from one profiled run of
    ``calls`` calls (after one unprofiled call).

    Returns:
        The :class:`BusyTime`, or ``None`` when the profiler recorded no device activity (no
        CUPTI, or nothing ran on a GPU).
    """
    fn()
    torch.cuda.synchronize()
    events = device_events_from_trace(profile_trace(lambda i: fn(), 0, calls, True))
    if not events:
        return None
    sums, _ = group_per_call(events, calls)
    return BusyTime(
        per_call_ms=statistics.median(sums) / 1e3,
        activities_per_call=len(events) / calls,
        top=top_kernels(events, calls, top),
        families=kernel_families(events, calls),
    )
