"""In-graph CUPTI truth for many candidates at once: one profiler session, interleaved replays.

``graphtune.bench.cupti_graph_time`` opens a profiler session per candidate, and a session has a
fixed cost (CUPTI set-up, trace export and parse) that is large next to a few graph replays; an
exhaustive sweep of a tactic space over several buckets would pay it hundreds of times.
:func:`cupti_graph_sweep` captures one CUDA graph per candidate first (each with ``calls``
back-to-back calls, its own memory pool), then replays them round-robin (``replays`` rounds:
candidate 0, 1, ..., then again, so a drift of clocks or temperature hits all alike) inside a
single ``torch.profiler`` session, and splits the trace by the correlation id of each replay's
launch (:func:`split_by_launch`). Per replay the span ``(end of its last activity - start of its
first) / calls`` is what a call costs inside a graph (kernels plus the gaps between them, host
launch excluded), as in ``graphtune.bench.cupti_graph_time``; the median over replays is the
candidate's truth.

If the trace cannot be split exactly (a replay's activities missing, or a count that is not a
whole number of calls), the affected candidates are measured again one at a time with
``graphtune.bench.cupti_graph_time`` and marked ``"grouping": "single"``.
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphtune.bench import graphs as _graphs
from graphtune.bench.cupti import (
    DeviceEvent,
    correlation_id,
    device_events_from_trace,
    profile_trace,
)
from graphtune.bench.cupti_graph import cupti_graph_time

logger = logging.getLogger(__name__)


def _launch_ids(trace: dict[str, Any]) -> list[int]:
    """Correlation ids of the trace's graph launches (runtime or driver API), in time order."""
    found = []
    for event in trace.get("traceEvents", []):
        if isinstance(event, dict) and "GraphLaunch" in str(event.get("name", "")):
            corr = correlation_id(event)
            if corr is not None:
                found.append((float(event.get("ts", 0.0)), corr))
    return [corr for _, corr in sorted(found)]


def split_by_launch(trace: dict[str, Any], calls: Sequence[int]) -> list[list[DeviceEvent]] | None:
    """The device activities of each graph replay, in launch order (``calls[j]``: calls the j-th
    replayed graph holds), or ``None`` when the trace cannot be split that way.

    By the correlation id of each ``cudaGraphLaunch`` when the trace has one per replay.
    Otherwise only when there are exactly as many activity groups (by correlation id) as
    replays, taken in time order: a trace with other groups as well (work the host issued
    outside the graphs, such as the RNG-offset fill some torch versions run before a replay)
    cannot be matched to the replays safely, and the caller measures one candidate at a time.
    """
    events = device_events_from_trace(trace)
    by_id: dict[int, list[DeviceEvent]] = {}
    for event in events:
        if event.correlation is None:
            return None
        by_id.setdefault(int(event.correlation), []).append(event)
    launch_ids = _launch_ids(trace)
    if len(launch_ids) == len(calls) and all(cid in by_id for cid in launch_ids):
        return [sorted(by_id[cid], key=lambda e: e.start_us) for cid in launch_ids]
    if len(by_id) != len(calls):
        return None
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
    stream = _graphs.capture_stream()
    graphs: list[torch.cuda.CUDAGraph | None] = []
    gc.collect()
    for i, (fn, n) in enumerate(zip(fns, calls, strict=True)):
        try:
            graphs.append(_graphs.capture_calls(fn, n, warmup=warmup, stream=stream))
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
            trace = profile_trace(run, 0, 1, False)
            if not device_events_from_trace(trace):
                # Some builds only export device activity when CPU activity is traced too.
                launches.clear()
                trace = profile_trace(run, 0, 1, True)
        groups = split_by_launch(trace, [calls[i] for i in launches])
        if groups is None:
            logger.warning(
                "graph sweep: the trace does not split into %d replays; measuring one at a time",
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
            single = cupti_graph_time(
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
