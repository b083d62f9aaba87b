"""Helpers shared by the benchmark scripts: provenance, CUPTI kernel time, JSON results.

Import from a script in ``benchmarks/`` with ``import _common`` (the scripts put their own
directory on ``sys.path``). Importing this module needs torch but no GPU and has no side effects.

* :func:`provenance` — where a result came from: GPU name, compute capability, L2 size, torch /
  CUDA / Triton / graphtune versions, git commit, command line, UTC time.
* :func:`cupti_kernel_time` — ground truth for a callable's GPU time: the device-side durations
  of its kernels recorded by CUPTI through ``torch.profiler``, summed per call, median over calls.
* :func:`cupti_graph_time` — the second ground truth: the per-call device span of the callable
  captured many times in one CUDA graph, from CUPTI (kernel durations plus the gaps between the
  graph's kernels, which the kernel sum leaves out; host launch cost excluded).
* :func:`write_json` — writes a result file atomically, with non-finite floats as ``null``
  (:func:`json_safe`, also for the final JSON line).
* :func:`gpu_slug`, :func:`require_cuda_or_exit`, :func:`median`.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Trace categories that are device work: kernels, and memset/memcpy the op itself issues.
DEVICE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
#: Environment variables that may carry the commit when the checkout has no ``.git``.
COMMIT_ENV_VARS = ("GRAPHTUNE_COMMIT", "GIT_COMMIT", "GITHUB_SHA")


# --- environment -------------------------------------------------------------------------------


def require_cuda_or_exit(script: str) -> torch.device:
    """Returns the current CUDA device, or prints why not and exits with status 2."""
    if not torch.cuda.is_available():
        print(
            f"{script}: needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). Run it on the GPU "
            "machine: PYTHONPATH=src python3 benchmarks/<script>.py --out DIR",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return torch.device("cuda", torch.cuda.current_device())


def gpu_slug(name: str) -> str:
    """File-name friendly GPU name: ``"NVIDIA H200"`` -> ``"h200"``."""
    text = re.sub(r"^\s*nvidia\s+", "", name, flags=re.IGNORECASE).lower()
    text = re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    return text or "unknown"


def git_commit(explicit: str | None = None) -> str:
    """The commit a result belongs to.

    Order: ``explicit`` (for example a ``--commit`` flag), then the environment variables in
    :data:`COMMIT_ENV_VARS` (the device copy of the tree may lack ``.git``), then
    ``git rev-parse HEAD`` in the repository (with ``-dirty`` when the tree has local changes),
    then ``"unknown"``.
    """
    if explicit:
        return explicit
    for name in COMMIT_ENV_VARS:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if head and dirty else (head or "unknown")


def _package_version(module: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8 only
        return None
    try:
        return version(module)
    except PackageNotFoundError:
        return None


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", None) or _package_version("triton")


def _graphtune_version() -> str:
    try:
        from graphtune._version import __version__
    except ImportError:
        return _package_version("graphtune") or "unknown"
    return __version__


def provenance(commit: str | None = None, device: torch.device | None = None) -> dict[str, Any]:
    """Describes the machine and software a result was measured with.

    Args:
        commit: Commit to record (see :func:`git_commit` for the fallbacks).
        device: CUDA device (default: the current one when CUDA is available).

    Returns:
        A JSON-serialisable dict. GPU fields are ``None`` without CUDA.
    """
    info: dict[str, Any] = {
        "gpu": None,
        "gpu_slug": None,
        "compute_capability": None,
        "sm_count": None,
        "l2_cache_bytes": None,
        "total_memory_bytes": None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "triton": _triton_version(),
        "graphtune": _graphtune_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": git_commit(commit),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        index = device.index if device is not None and device.index is not None else None
        index = torch.cuda.current_device() if index is None else index
        props = torch.cuda.get_device_properties(index)
        info.update(
            gpu=props.name,
            gpu_slug=gpu_slug(props.name),
            compute_capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            l2_cache_bytes=getattr(props, "L2_cache_size", None),
            total_memory_bytes=props.total_memory,
        )
    return info


# --- CUPTI kernel time -------------------------------------------------------------------------


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
            correlation=_correlation(event),
        )
        for event in trace.get("traceEvents", [])
        if isinstance(event, dict)
        and event.get("ph") == "X"
        and event.get("cat") in wanted
        and "dur" in event
    ]
    events.sort(key=lambda e: e.start_us)
    return events


def _correlation(event: dict[str, Any]) -> int | None:
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


def _profile_trace(fn: Callable[[int], object], first: int, calls: int, with_cpu: bool) -> dict:
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
    events = device_events_from_trace(_profile_trace(fn, warmup, calls, False), categories)
    if not events:
        # Some builds only export device activity when CPU activity is traced too.
        events = device_events_from_trace(_profile_trace(fn, warmup, calls, True), categories)
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


# --- CUPTI in-graph time ----------------------------------------------------------------------

#: A profiled graph replay should last at least this long (see :func:`graph_calls_for`).
GRAPH_MIN_REPLAY_US = 50.0
#: Fewest and most calls captured in one graph by :func:`cupti_graph_time`.
GRAPH_MIN_CALLS, GRAPH_MAX_CALLS = 20, 200

# One side stream per device for every capture: a fresh stream per measurement would make torch
# set up (and keep) a new cuBLAS workspace for each one.
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


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


def _capture_stream() -> torch.cuda.Stream:
    index = torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = torch.cuda.Stream(device=index)
        _CAPTURE_STREAMS[index] = stream
    return stream


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

    Why a second truth: :func:`cupti_kernel_time` sums kernel durations, so it leaves out the gap
    between consecutive kernels. Inside a graph (how a decode step runs) every kernel boundary
    still costs the GPU some hundreds of ns (drain of one grid, launch of the next), so a tactic
    with two kernels (a split-K GEMM and its reduction) or with a larger grid can read faster by
    kernel sum and run slower in the graph. This measures what the graph pays, host launch cost
    excluded.

    Procedure:

    1. ``calls_per_graph``: when ``None``, :func:`graph_calls_for` of ``estimate_us`` (or, when
       that is ``None`` too, of a short :func:`cupti_kernel_time`): at least 20 calls, enough for
       a replay of about 50 µs, at most 200.
    2. ``max(1, warmup)`` calls on a side stream (lazy initialisation such as cuBLAS workspaces
       must happen before capture, on the capturing stream; the torch.cuda.graphs recipe), then
       ``fn(warmup) .. fn(warmup + calls_per_graph - 1)`` captured back to back in one
       ``torch.cuda.CUDAGraph`` on that stream with a private memory pool.
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
            estimate_us = cupti_kernel_time(fn, calls=10, warmup=warmup, categories=categories)
            estimate_us = estimate_us.per_call_us
        calls_per_graph = graph_calls_for(estimate_us)
    if calls_per_graph < 1:
        raise ValueError(f"calls_per_graph must be >= 1, got {calls_per_graph}")
    caller = torch.cuda.current_stream()
    stream = _capture_stream()
    stream.wait_stream(caller)  # inputs may have been written on the caller's stream
    with torch.cuda.stream(stream):
        for i in range(max(1, warmup)):
            fn(i)
    caller.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), stream=stream):
            for i in range(calls_per_graph):
                fn(warmup + i)

        def replay(_: int) -> None:
            graph.replay()
            stream.synchronize()  # keeps replays apart in the trace (and in time)

        with torch.cuda.stream(stream):
            replay(0)  # uploads the graph; never measured
            events = device_events_from_trace(_profile_trace(replay, 0, replays, False), categories)
            if not events:
                # Some builds only export device activity when CPU activity is traced too.
                events = device_events_from_trace(
                    _profile_trace(replay, 0, replays, True), categories
                )
            if not events:
                raise RuntimeError(
                    "torch.profiler recorded no device activity for the graph replays; is CUPTI "
                    "available to this process?"
                )
            checked = (
                _event_replay_us(graph, stream, replays) / calls_per_graph if event_check else None
            )
    finally:
        try:
            graph.reset()  # frees the graph and its hold on the private pool
        except RuntimeError as exc:  # a graph whose capture failed may have nothing to reset
            logger.debug("cupti_graph_time: graph.reset() failed: %s", exc)
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


# --- results -----------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return statistics.median(values)


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` (strict JSON has no inf/nan), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


_sanitize = json_safe  # the old private name


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Writes ``payload`` as indented JSON atomically (temp file + rename); returns the path.

    Non-finite floats become ``null``; values JSON cannot represent are written with ``str``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(json_safe(payload), indent=2, sort_keys=False, default=str) + "\n"
    with tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False
    ) as handle:
        handle.write(text)
        temp = Path(handle.name)
    os.replace(temp, path)
    return path
