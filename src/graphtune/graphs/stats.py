"""Counters of a graph runner (or an eager runner), readable by programs and by people."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from graphtune.graphs.capture import CaptureRecord
from graphtune.graphs.policy import FallbackReason, padding_waste
from graphtune.reporting import render_table

_MIB = 1024 * 1024
_PHASES = ("record", "finish", "break", "account")


@dataclass
class RunnerStats:
    """Counters kept by :class:`CUDAGraphRunner` and :class:`EagerRunner`.

    Call counters are cumulative over the runner's life; ``records`` and ``pool_bytes`` describe
    the graphs alive now (``release()`` clears them).

    Attributes:
        calls: Calls of the runner.
        replays: Calls answered by a graph replay.
        eager_calls: Calls that ran ``fn`` eagerly (all of an EagerRunner's calls).
        fallbacks: Eager calls by reason (an EagerRunner counts each call as ``disabled``).
        real_rows: Real batch rows of replayed calls.
        padded_rows: Rows the replayed graphs computed (real rows plus padding).
        warmup_seconds: Wall time spent in eager warm-up runs before captures.
        break_runs: Graph breaks run eagerly during replays (a call that captured lazily counts
            as a replay, and its capture's breaks count here).
        break_seconds: Host wall time spent in those breaks (their own launches and copies; the
            GPU work they queue is not waited for; for a lazily capturing call, the capture's
            ``break_seconds``).
        buffer_bytes: Bytes of static buffers alive now (inputs, and graph-break outputs).
        records: Capture records (successes and failures) of the graphs alive now.
        releases: Number of ``release()`` calls that dropped something.
    """

    calls: int = 0
    replays: int = 0
    eager_calls: int = 0
    fallbacks: dict[FallbackReason, int] = field(default_factory=dict)
    real_rows: int = 0
    padded_rows: int = 0
    warmup_seconds: float = 0.0
    break_runs: int = 0
    break_seconds: float = 0.0
    buffer_bytes: int = 0
    records: list[CaptureRecord] = field(default_factory=list)
    releases: int = 0

    def count_fallback(self, reason: FallbackReason) -> None:
        """Counts one eager call for ``reason``."""
        self.eager_calls += 1
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    @property
    def padding_waste(self) -> float:
        """Fraction of replayed rows that were padding (0..1)."""
        return padding_waste(self.real_rows, self.padded_rows)

    @property
    def graphs(self) -> int:
        """Graphs captured successfully and alive."""
        return sum(1 for r in self.records if r.ok)

    @property
    def failed_captures(self) -> list[CaptureRecord]:
        """Records of captures that failed (their keys run eagerly)."""
        return [r for r in self.records if not r.ok]

    @property
    def capture_seconds(self) -> float:
        """Total capture wall time of the graphs alive (failed attempts included)."""
        return sum(r.seconds for r in self.records)

    @property
    def pool_bytes(self) -> int:
        """Graph memory: reserved bytes the live graphs' captures added (the shared pool)."""
        return sum(r.pool_bytes for r in self.records if r.ok)

    @property
    def largest_graph_pool_bytes(self) -> int:
        """Pool bytes the capture of the largest live size added (0 without graphs).

        Sizes are captured largest first, so this is that size's own need: the pool it would
        have alone. (With ``lazy=True`` a smaller size may have been captured first, and this is
        then only what the largest size added on top.)
        """
        ok = [r for r in self.records if r.ok]
        if not ok:
            return 0
        return max(ok, key=lambda r: (r.size, r.pool_bytes)).pool_bytes

    @property
    def pool_vs_largest(self) -> float | None:
        """``pool_bytes / largest_graph_pool_bytes`` (None when the largest added nothing)."""
        largest = self.largest_graph_pool_bytes
        return self.pool_bytes / largest if largest else None

    def fallback_count(self, reason: FallbackReason) -> int:
        """Eager calls counted for ``reason`` (0 if none)."""
        return self.fallbacks.get(reason, 0)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (records included)."""
        return {
            "calls": self.calls,
            "replays": self.replays,
            "eager_calls": self.eager_calls,
            "fallbacks": {reason.value: count for reason, count in self.fallbacks.items()},
            "real_rows": self.real_rows,
            "padded_rows": self.padded_rows,
            "padding_waste": self.padding_waste,
            "graphs": self.graphs,
            "capture_seconds": self.capture_seconds,
            "capture_phases": self.capture_phases(),
            "warmup_seconds": self.warmup_seconds,
            "break_runs": self.break_runs,
            "break_seconds": self.break_seconds,
            "pool_bytes": self.pool_bytes,
            "largest_graph_pool_bytes": self.largest_graph_pool_bytes,
            "pool_vs_largest": self.pool_vs_largest,
            "buffer_bytes": self.buffer_bytes,
            "records": [_record_dict(r) for r in self.records],
        }

    def capture_phases(self) -> dict[str, float]:
        """Capture seconds of the live graphs by phase (see :class:`CaptureRecord`)."""
        return {
            phase: sum(getattr(r, f"{phase}_seconds") for r in self.records) for phase in _PHASES
        }

    def table(self, *, per_graph: bool = True) -> str:
        """Renders the counters (and one row per graph) as text tables."""
        rows: list[tuple[str, Any]] = [
            ("calls", self.calls),
            ("replays", self.replays),
            ("eager calls", self.eager_calls),
        ]
        for reason, count in sorted(self.fallbacks.items(), key=lambda kv: kv[0].value):
            rows.append((f"  eager: {reason.value}", count))
        rows += [
            ("real rows / padded rows", f"{self.real_rows} / {self.padded_rows}"),
            ("padding waste %", 100.0 * self.padding_waste),
            ("graphs (failed)", f"{self.graphs} ({len(self.failed_captures)})"),
            ("capture s", self.capture_seconds),
        ]
        phases = self.capture_phases()
        rows += [(f"  {phase} s", seconds) for phase, seconds in phases.items()]
        ratio = self.pool_vs_largest
        rows += [
            ("warm-up s", self.warmup_seconds),
            ("graph breaks run (host s)", f"{self.break_runs} ({self.break_seconds:.4f})"),
            ("graph pool MiB", self.pool_bytes / _MIB),
            ("  largest size alone MiB", self.largest_graph_pool_bytes / _MIB),
            ("  pool / largest size", "-" if ratio is None else f"{ratio:.3f}"),
            ("static buffers MiB", self.buffer_bytes / _MIB),
        ]
        text = render_table("graph runner", ["metric", "value"], rows)
        if per_graph and self.records:
            graph_rows = [
                (
                    "-" if r.extra_key is None else repr(r.extra_key),
                    r.size,
                    1000.0 * r.warmup_seconds,
                    1000.0 * r.seconds,
                    1000.0 * r.record_seconds,
                    1000.0 * r.finish_seconds,
                    r.breaks,
                    r.pool_bytes / _MIB,
                    "ok" if r.ok else (r.error or "failed")[:60],
                )
                for r in sorted(self.records, key=lambda r: (repr(r.extra_key), -r.size))
            ]
            text += "\n" + render_table(
                "graphs",
                [
                    "extra key",
                    "size",
                    "warm-up ms",
                    "capture ms",
                    "record ms",
                    "finish ms",
                    "breaks",
                    "pool MiB",
                    "status",
                ],
                graph_rows,
            )
        return text


def _record_dict(record: CaptureRecord) -> dict[str, Any]:
    data = {f.name: getattr(record, f.name) for f in fields(record)}
    data["extra_key"] = repr(record.extra_key)
    return data


GraphRunnerStats = RunnerStats
"""Alias: the same stats class serves both runners."""
