"""In-graph CUPTI truth for many candidates at once: one profiler session, interleaved replays.

``_common.cupti_graph_time`` opens a profiler session per candidate, which costs about a second
each on an H200 (CUPTI set-up, trace export and parse); an exhaustive sweep of a tactic space
over several buckets would spend minutes on that alone. :func:`cupti_graph_sweep` captures one
CUDA graph per candidate first (each with ``calls`` back-to-back calls, its own memory pool),
then replays them round-robin (``replays`` rounds: candidate 0, 1, ..., then again, so a drift of
clocks or temperature hits all alike) inside a single ``torch.profiler`` session, and splits the
trace by the correlation id of each replay's launch. Per replay the span ``(end of its last
activity - start of its first) / calls`` is what a call costs inside a graph (kernels plus the
gaps between them, host launch excluded), as in ``_common.cupti_graph_time``; the median over
replays is the candidate's truth.

If the trace cannot be split exactly (a replay's activities missing, or a count that is not a
whole number of calls), the affected candidates are measured again one at a time with
``_common.cupti_graph_time`` and marked ``"grouping": "single"``.
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import _common
import torch

logger = logging.getLogger(__name__)


def _capture(
    fn: Callable[[int], object], calls: int, warmup: int, stream: torch.cuda.Stream
) -> torch.cuda.CUDAGraph:
    caller = torch.cuda.current_stream()
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        for i in range(max(1, warmup)):
            fn(i)
    caller.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), stream=stream):
        for i in range(calls):
            fn(warmup + i)
    return graph


def _groups_by_launch(events: Sequence[_common.DeviceEvent]) -> list[list[_common.DeviceEvent]]:
    """Device activities grouped by launch correlation id, in time order of each group's start."""
    by_id: dict[int, list[_common.DeviceEvent]] = {}
    for event in events:
        if event.correlation is None:
            return []
        by_id.setdefault(int(event.correlation), []).append(event)
    groups = [sorted(g, key=lambda e: e.start_us) for g in by_id.values()]
    return sorted(groups, key=lambda g: g[0].start_us)


def cupti_graph_sweep(
    fns: Sequence[Callable[[int], object]],
    calls: Sequence[int],
    *,
    replays: int = 10,
    warmup: int = 1,
) -> list[dict[str, Any]]:
    """Per-call in-graph device time of every ``fns[i]`` (captured ``calls[i]`` times).

    Returns:
        One dict per candidate: ``per_call_us`` (median over replays; ``inf`` when it failed),
        ``samples_us``, ``kernels_per_call``, ``calls_per_graph``, ``grouping`` (``"sweep"`` or
        ``"single"``) and ``error`` (``None``, or why it could not be measured).
    """
    if len(fns) != len(calls) or replays < 1:
        raise ValueError(
            f"need one call count per fn and replays >= 1, got {len(calls)}, {replays}"
        )
    results: list[dict[str, Any]] = [
        {
            "per_call_us": math.inf,
            "samples_us": [],
            "kernels_per_call": None,
            "calls_per_graph": n,
            "grouping": "sweep",
            "error": None,
        }
        for n in calls
    ]
    stream = _common._capture_stream()
    graphs: list[torch.cuda.CUDAGraph | None] = []
    gc.collect()
    for i, (fn, n) in enumerate(zip(fns, calls, strict=True)):
        try:
            graphs.append(_capture(fn, n, warmup, stream))
        except Exception as exc:  # a candidate that cannot be captured is reported, not fatal
            results[i]["error"] = f"capture: {type(exc).__name__}: {exc}"
            graphs.append(None)
            torch.cuda.synchronize()
    live = [i for i, g in enumerate(graphs) if g is not None]
    launches: list[int] = []

    def run(_: int) -> None:
        for _round in range(replays):
            for i in live:
                graphs[i].replay()  # type: ignore[union-attr]
                stream.synchronize()  # replays never overlap, in the trace or in time
                launches.append(i)

    try:
        with torch.cuda.stream(stream):
            for i in live:
                graphs[i].replay()  # type: ignore[union-attr]  (upload; never measured)
            stream.synchronize()
            events = _common.device_events_from_trace(_common._profile_trace(run, 0, 1, False))
            if not events:  # some builds only export device activity with CPU activity traced
                launches.clear()
                trace = _common._profile_trace(run, 0, 1, True)
                events = _common.device_events_from_trace(trace)
        groups = _groups_by_launch(events)
        if len(groups) != len(launches):
            logger.warning(
                "graph sweep: %d activity groups for %d replays; measuring one at a time",
                len(groups),
                len(launches),
            )
            groups = []
        for launch, group in zip(launches, groups, strict=False):
            n = calls[launch]
            if len(group) % n:
                results[launch]["error"] = f"{len(group)} activities for {n} calls"
                continue
            span = (max(e.end_us for e in group) - min(e.start_us for e in group)) / n
            results[launch]["samples_us"].append(span)
            results[launch]["kernels_per_call"] = len(group) // n
    finally:
        for graph in graphs:
            if graph is not None:
                graph.reset()
    for i in live:
        entry = results[i]
        if entry["error"] is None and len(entry["samples_us"]) == replays:
            entry["per_call_us"] = statistics.median(entry["samples_us"])
            continue
        try:  # the trace could not be split for this one: measure it alone
            single = _common.cupti_graph_time(
                fns[i], calls_per_graph=calls[i], replays=replays, warmup=warmup
            )
            entry.update(
                per_call_us=single.per_call_us,
                samples_us=single.samples_us,
                kernels_per_call=single.kernels_per_call,
                grouping="single",
                error=None,
            )
        except Exception as exc:  # reported, not fatal
            entry["error"] = f"{type(exc).__name__}: {exc}"
    return results
