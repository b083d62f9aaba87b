"""Per-call device time of a callable inside a CUDA graph, from CUPTI: the in-graph truth.

:func:`cupti.cupti_kernel_time` sums kernel durations, so it leaves out the gap between consecutive
kernels; inside a graph (how a decode step runs) every kernel boundary still costs the GPU some
hundreds of ns. :func:`cupti_graph_time` captures the callable many times back to back in one
graph, replays it under the profiler and reads the span per call (:func:`split_replays`,
:func:`replay_spans`), host launch cost excluded. Importing this module needs torch but no GPU.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphtune.bench import cupti
from graphtune.bench.cupti import DEVICE_CATEGORIES, DeviceEvent, device_events_from_trace
from graphtune.bench.graphs import capture_calls, capture_stream, release

logger = logging.getLogger(__name__)

#: A profiled graph replay should last at least this long (see :func:`graph_calls_for`).
GRAPH_MIN_REPLAY_US = 50.0
#: Fewest and most calls captured in one graph by :func:`cupti_graph_time`.
GRAPH_MIN_CALLS, GRAPH_MAX_CALLS = 20, 200


@dataclass(frozen=True)
class GraphKernelTime:
    """Per-call device time of a callable inside a CUDA graph, by CUPTI (:func:`cupti_graph_time`).

    Attributes:
        per_call_us: Median over replays of ``(end of the last activity - start of the first) /
            calls_per_graph``: kernel durations plus the gaps between the graph's kernels.
        samples_us: That span per call for each replay, in replay order.
        kernel_sum_us: Median over replays of the summed activity durations per call, inside
            the graph (``per_call_us - kernel_sum_us`` is the in-graph gap per call).
        kernels_per_call: Device activities per call in a replay (``None`` when it is not a
            whole number).
        kernel_names: Names of the activities of the first call of the first replay.
        calls_per_graph: Calls captured back to back in the graph.
        replays: Replays found in the trace and used (at most the replays profiled).
        grouping: How the activities were split into replays: ``"correlation"`` (by the
            correlation id of each replay's launch) or ``"gaps"`` (at the widest time gaps).
        events_per_call_us: Check without CUPTI: median over replays timed with CUDA events (no
            profiler attached) divided by the calls; it also holds the replay's own device-side
            start cost (a few µs spread over the calls), so it reads slightly above
            ``per_call_us``. ``None`` when not measured.
    """

    per_call_us: float
    samples_us: list[float]
    kernel_sum_us: float
    kernels_per_call: int | None
    kernel_names: list[str]
    calls_per_graph: int
    replays: int
    grouping: str
    events_per_call_us: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (without the per-replay samples)."""
        return {
            "per_call_us": self.per_call_us,
            "min_us": min(self.samples_us) if self.samples_us else None,
            "kernel_sum_us": self.kernel_sum_us,
            "gap_us": self.per_call_us - self.kernel_sum_us,
            "kernels_per_call": self.kernels_per_call,
            "kernel_names": self.kernel_names,
            "calls_per_graph": self.calls_per_graph,
            "replays": self.replays,
            "grouping": self.grouping,
            "events_per_call_us": self.events_per_call_us,
        }


def graph_calls_for(
    estimate_us: float | None,
    *,
    min_replay_us: float = GRAPH_MIN_REPLAY_US,
    min_calls: int = GRAPH_MIN_CALLS,
    max_calls: int = GRAPH_MAX_CALLS,
) -> int:
    """Calls to capture in one graph so that a replay lasts about ``min_replay_us``.

    ``max(min_calls, ceil(min_replay_us / estimate_us))``, capped at ``max_calls``. The span of a
    replay is divided by the calls, so a long replay makes the first kernel's start latency and
    the last one's tail negligible per call; the cap bounds capture time and trace size.

    Args:
        estimate_us: Expected device time of one call (the eager kernel sum is good enough);
            ``None``, non-finite or not positive gives ``min_calls``.
        min_replay_us: Target replay duration.
        min_calls: Fewest calls.
        max_calls: Most calls.

    Raises:
        ValueError: ``min_calls < 1`` or ``max_calls < min_calls``.
    """
    if min_calls < 1 or max_calls < min_calls:
        raise ValueError(f"need 1 <= min_calls <= max_calls, got {min_calls}, {max_calls}")
    if estimate_us is None or not math.isfinite(estimate_us) or estimate_us <= 0:
        return min_calls
    wanted = math.ceil(min_replay_us / estimate_us - 1e-9)  # 50 / 2.5 = 20.000...01 -> 20
    return max(min_calls, min(max_calls, wanted))


def split_replays(
    events: Sequence[DeviceEvent], *, replays: int, calls_per_graph: int
) -> tuple[list[list[DeviceEvent]], str]:
    """Splits the device activities of ``replays`` profiled graph replays into one list each.

    By correlation id first: every activity of one replay carries the correlation id of that
    replay's ``cudaGraphLaunch``. Groups with fewer activities than ``calls_per_graph`` are not
    replays (every captured call launches at least one kernel) but work the host issued outside
    the graph, such as the RNG-offset fill some torch versions run before each replay; they are
    dropped, since counting them would stretch the span by a launch latency. When ids are
    missing, or no group is large enough, or there are more large groups than replays, the
    activities are split in time order at the ``replays - 1`` widest gaps (the replays ran with a
    host synchronisation between them, so those gaps are the boundaries).

    Either way only groups whose size is a multiple of ``calls_per_graph`` and equal to the most
    common such size are kept: a group that lost or gained an activity has an unreliable span.

    Returns:
        ``(groups, method)``: the groups in time order, each sorted by start, and
        ``"correlation"`` or ``"gaps"``.

    Raises:
        ValueError: Bad counts, or no group passes the checks (the trace cannot be trusted).
    """
    if replays < 1 or calls_per_graph < 1:
        raise ValueError(
            f"need replays >= 1 and calls_per_graph >= 1, got {replays}, {calls_per_graph}"
        )
    ordered = sorted(events, key=lambda e: e.start_us)
    if not ordered:
        raise ValueError("no device activities to split into replays")
    groups: list[list[DeviceEvent]] = []
    method = "correlation"
    if all(e.correlation is not None for e in ordered):
        by_id: dict[int, list[DeviceEvent]] = {}
        for event in ordered:
            by_id.setdefault(int(event.correlation), []).append(event)  # type: ignore[arg-type]
        groups = [g for g in by_id.values() if len(g) >= calls_per_graph]
        if len(groups) > replays:
            groups = []
    if not groups:
        method = "gaps"
        groups = _split_at_widest_gaps(ordered, replays)
    whole = [g for g in groups if len(g) % calls_per_graph == 0]
    if not whole:
        sizes = sorted({len(g) for g in groups})
        raise ValueError(
            f"graph replays ({method}) hold {sizes} device activities, none a multiple of the "
            f"{calls_per_graph} captured calls; the trace lost or gained activities"
        )
    sizes = [len(g) for g in whole]
    common = max(set(sizes), key=lambda n: (sizes.count(n), n))
    kept = [g for g in whole if len(g) == common]
    if len(kept) < len(groups):
        logger.warning(
            "CUPTI graph replays: kept %d of %d replays (activity counts %s)",
            len(kept),
            len(groups),
            sorted(len(g) for g in groups),
        )
    kept.sort(key=lambda g: g[0].start_us)
    return kept, method


def _split_at_widest_gaps(ordered: list[DeviceEvent], replays: int) -> list[list[DeviceEvent]]:
    if replays == 1:
        return [ordered]
    if len(ordered) < replays:
        raise ValueError(f"{len(ordered)} device activities cannot form {replays} replays")
    gaps = []
    latest_end = ordered[0].end_us
    for i in range(1, len(ordered)):
        gaps.append((ordered[i].start_us - latest_end, i))
        latest_end = max(latest_end, ordered[i].end_us)
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[: replays - 1])
    bounds = [0, *cuts, len(ordered)]
    return [ordered[bounds[k] : bounds[k + 1]] for k in range(len(bounds) - 1)]


def replay_spans(
    groups: Sequence[Sequence[DeviceEvent]], calls_per_graph: int
) -> tuple[list[float], list[float]]:
    """Per-call span and per-call kernel sum of each replay.

    Returns:
        ``(spans, sums)``: for each group, ``(max end - min start) / calls_per_graph`` and
        ``sum(durations) / calls_per_graph``.
    """
    spans = [
        (max(e.end_us for e in g) - min(e.start_us for e in g)) / calls_per_graph for g in groups
    ]
    sums = [sum(e.duration_us for e in g) / calls_per_graph for g in groups]
    return spans, sums


def cupti_graph_time(
    fn: Callable[[int], object],
    *,
    calls_per_graph: int | None = None,
    replays: int = 20,
    warmup: int = 3,
    estimate_us: float | None = None,
    categories: Sequence[str] = DEVICE_CATEGORIES,
    event_check: bool = True,
) -> GraphKernelTime:
    """Measures the per-call device time of ``fn(i)`` as it runs inside a CUDA graph, by CUPTI.

    Why a second truth: :func:`cupti.cupti_kernel_time` sums kernel durations, so it leaves out
    the gap between consecutive kernels. Inside a graph (how a decode step runs) every kernel
    boundary still costs the GPU some hundreds of ns (drain of one grid, launch of the next), so a
    tactic with two kernels (a split-K GEMM and its reduction) or with a larger grid can read
    faster by kernel sum and run slower in the graph. This measures what the graph pays, host
    launch cost excluded.

    Procedure:

    1. ``calls_per_graph``: when ``None``, :func:`graph_calls_for` of ``estimate_us`` (or, when
       that is ``None`` too, of a short :func:`cupti.cupti_kernel_time`): at least 20 calls,
       enough for a replay of about 50 µs, at most 200.
    2. :func:`~graphtune.bench.graphs.capture_calls`: ``max(1, warmup)`` calls on the side
       stream, then ``fn(warmup) .. fn(warmup + calls_per_graph - 1)`` captured back to back in
       one ``torch.cuda.CUDAGraph`` on that stream with a private memory pool.
    3. One unprofiled replay (the first replay uploads the graph), then ``replays`` replays under
       ``torch.profiler`` (CUDA activity), each followed by a stream synchronisation so replays
       never overlap.
    4. The trace's device activities are split per replay (:func:`split_replays`); per replay,
       ``(end of its last activity - start of its first) / calls_per_graph``; the median over
       replays is reported. The span of N calls holds the N calls' kernels, the gaps inside each
       call and the N - 1 gaps between calls, which is what a call costs in a graph.
    5. With ``event_check``, the same graph is replayed ``replays`` times between CUDA events
       without the profiler (``events_per_call_us``), to show whether CUPTI tracing itself
       changed the in-graph gaps.

    The graph is reset before returning, also on errors.

    Args:
        fn: The call; ``i`` counts calls (for input rotation).
        calls_per_graph: Calls captured in the graph (see step 1).
        replays: Profiled replays (samples).
        warmup: Uncaptured calls before capture.
        estimate_us: Expected device time of one call, for step 1.
        categories: Trace categories that count as device work.
        event_check: Also time the replays with CUDA events (step 5).

    Raises:
        ValueError: Bad counts, or the trace cannot be split into replays.
        RuntimeError: The profiler recorded no device activity, or the capture failed.
    """
    if replays < 1 or warmup < 0:
        raise ValueError(f"need replays >= 1 and warmup >= 0, got {replays}, {warmup}")
    if calls_per_graph is None:
        if estimate_us is None:
            estimate = cupti.cupti_kernel_time(fn, calls=10, warmup=warmup, categories=categories)
            estimate_us = estimate.per_call_us
        calls_per_graph = graph_calls_for(estimate_us)
    if calls_per_graph < 1:
        raise ValueError(f"calls_per_graph must be >= 1, got {calls_per_graph}")
    caller = torch.cuda.current_stream()
    stream = capture_stream()
    graph = capture_calls(fn, calls_per_graph, warmup=warmup, stream=stream)
    try:

        def replay(_: int) -> None:
            graph.replay()
            stream.synchronize()  # keeps replays apart in the trace (and in time)

        with torch.cuda.stream(stream):
            replay(0)  # uploads the graph; never measured
            trace = cupti.profile_trace(replay, 0, replays, False)
            events = device_events_from_trace(trace, categories)
            if not events:
                # Some builds only export device activity when CPU activity is traced too.
                trace = cupti.profile_trace(replay, 0, replays, True)
                events = device_events_from_trace(trace, categories)
            if not events:
                raise RuntimeError(
                    "torch.profiler recorded no device activity for the graph replays; is CUPTI "
                    "available to this process?"
                )
            checked = (
                _event_replay_us(graph, stream, replays) / calls_per_graph if event_check else None
            )
    finally:
        release(graph)
        caller.wait_stream(stream)
    groups, method = split_replays(events, replays=replays, calls_per_graph=calls_per_graph)
    spans, sums = replay_spans(groups, calls_per_graph)
    per_call = len(groups[0]) // calls_per_graph
    return GraphKernelTime(
        per_call_us=statistics.median(spans),
        samples_us=spans,
        kernel_sum_us=statistics.median(sums),
        kernels_per_call=per_call,
        kernel_names=[e.name for e in groups[0][:per_call]],
        calls_per_graph=calls_per_graph,
        replays=len(groups),
        grouping=method,
        events_per_call_us=checked,
    )


def _event_replay_us(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, count: int) -> float:
    """Median device time of ``count`` replays between CUDA events, in µs (no profiler)."""
    pairs = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(count)
    ]
    # The untimed replay keeps the GPU busy while the host queues the timed ones, so a timed
    # replay never waits for its own launch (a replay is >= ~50 us; its launch a few us).
    graph.replay()
    for start, end in pairs:
        start.record(stream)
        graph.replay()
        end.record(stream)
    stream.synchronize()
    return statistics.median(start.elapsed_time(end) * 1000.0 for start, end in pairs)
