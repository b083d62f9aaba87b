"""One CUDA-graph replay of a step, kernel by kernel: what each kernel adds to the step.

With programmatic dependent launch consecutive kernels overlap, so a kernel's CUPTI duration is
not what it costs the step (a kernel launched early also counts the time it waits for its
predecessor). What it adds is its *end after the previous end*: its end minus the latest end
of the kernels before it (0 when it ends before that). Over a replay these add up to the span
from the first kernel's start to the last kernel's end, so they say where a step's time goes.

* :func:`last_replay`: the kernels of the last of several profiled graph replays;
* :func:`timeline`: one :class:`TimelineRow` per kernel, in start order;
* :func:`by_name`: the rows summed per kernel name, the largest share of the step first;
* :func:`repeating_block`: where a step's per-layer kernel sequence repeats (its start and
  period), so one layer can be shown apart from the head (embedding) and tail (LM head).

Importing this module needs no GPU; ``benchmarks/step_trace.py`` runs it on one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from graphtune.bench.cupti import DeviceEvent
from graphtune.bench.cupti_graph import split_replays


@dataclass(frozen=True)
class TimelineRow:
    """One kernel of a replay (times in microseconds).

    Attributes:
        index: Position in the replay, in start order.
        name: Kernel name as the profiler reports it.
        start_us: Start after the replay's first kernel started.
        duration_us: The kernel's CUPTI duration.
        adds_us: Its end after the latest end of the kernels before it (0 when earlier).
    """

    index: int
    name: str
    start_us: float
    duration_us: float
    adds_us: float


def last_replay(events: Sequence[DeviceEvent], replays: int) -> list[DeviceEvent]:
    """The device activities of the last of ``replays`` graph replays, by start time.

    A replay's kernels share its graph launch's correlation id, and a replay launches more
    activities than anything else in the trace (an input copy or fill has its own id and one
    activity), so the groups of the largest size are the replays. Without ids the trace is
    split at its widest gaps (``graphtune.bench.cupti_graph.split_replays``).

    Raises:
        ValueError: No device activity in ``events``.
    """
    if not events:
        raise ValueError("the trace holds no device activity: nothing to lay out")
    by_id: dict[int | None, list[DeviceEvent]] = {}
    for event in events:
        by_id.setdefault(event.correlation, []).append(event)
    if None in by_id:
        groups, _ = split_replays(events, replays=replays, calls_per_graph=1)
    else:
        largest = max(len(group) for group in by_id.values())
        groups = sorted(
            (group for group in by_id.values() if len(group) == largest),
            key=lambda group: min(e.start_us for e in group),
        )
    return sorted(groups[-1], key=lambda e: e.start_us)


def timeline(kernels: Sequence[DeviceEvent]) -> list[TimelineRow]:
    """One row per kernel of one replay (see the module docstring), in start order."""
    ordered = sorted(kernels, key=lambda e: e.start_us)
    if not ordered:
        return []
    first = ordered[0].start_us
    latest_end = first
    rows = []
    for index, event in enumerate(ordered):
        adds = max(0.0, event.end_us - latest_end)
        rows.append(TimelineRow(index, event.name, event.start_us - first, event.duration_us, adds))
        latest_end = max(latest_end, event.end_us)
    return rows


def by_name(rows: Sequence[TimelineRow]) -> list[dict[str, Any]]:
    """Per kernel name: ``calls``, summed ``adds_us`` and ``duration_us``, and ``share`` of the
    replay's span; the largest ``adds_us`` first."""
    span = sum(row.adds_us for row in rows)
    sums: dict[str, list[float]] = {}
    for row in rows:
        entry = sums.setdefault(row.name, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += row.adds_us
        entry[2] += row.duration_us
    table = [
        {
            "name": name,
            "calls": int(calls),
            "adds_us": adds,
            "duration_us": duration,
            "share": adds / span if span > 0 else 0.0,
        }
        for name, (calls, adds, duration) in sums.items()
    ]
    return sorted(table, key=lambda entry: -entry["adds_us"])


def repeating_block(names: Sequence[str], repeats: int) -> tuple[int, int] | None:
    """``(start, period)`` of the shortest kernel sequence that follows itself at least
    ``repeats - 1`` times from ``start`` (the earliest such start); ``None`` when none does.

    A decode step of ``L`` layers has one sequence per layer; the first or last layer may differ
    (a norm fused elsewhere), so ask for ``L - 1`` or fewer repeats to find the period. When the
    first layer differs, the block starts where the repetition does, which may be inside that
    layer (the block is then a rotation of the layer's sequence).
    """
    count = len(names)
    if repeats < 2:
        raise ValueError(f"repeats must be >= 2 (a block and one repetition), got {repeats}")
    for period in range(1, count // repeats + 1):
        needed = (repeats - 1) * period  # names that must equal the name one period later
        run = 0
        for i in range(count - period):
            run = run + 1 if names[i] == names[i + period] else 0
            if run == needed:
                return i - needed + 1, period
    return None
