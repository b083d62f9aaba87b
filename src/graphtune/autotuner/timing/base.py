"""The Timer protocol and the Measurement every timer returns.

A timer is given ``fn(i)``, which performs the ``i``-th back-to-back call of the thing being
timed (the index lets cold-L2 mode rotate input copies, ``i % n_copies``), and returns the time
of one call. Timers are passed in to the tuner, so CPU tests drive the real tuning logic with a
fake timer.

A timer may also offer :class:`SessionTimer`'s ``open``: set up once for ``fn`` (warm-up,
capture) and then measure it many times. The tuner measures each candidate several times
(interleaved rounds, the top few again, the undecided again), so a session saves the set-up of
every measurement after the first; the graph timer captures one graph per candidate and replays
it for every measurement instead of capturing again.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, runtime_checkable

TimedFn = Callable[[int], object]


@dataclass(frozen=True)
class Measurement:
    """Time of one call, summarised over ``n`` samples.

    Attributes:
        median_us: Median per-call time in microseconds (the number the tuner compares).
        min_us: Fastest per-call sample in microseconds.
        spread: Relative spread of the samples, ``(p75 - p25) / median`` (0 for one sample).
        n: Number of samples (replays, event pairs or wall-clock windows).
        calls_per_sample: Back-to-back calls inside one sample; per-call times are divided by it.
        timer: Name of the timer that produced it (``"graph"``, ``"events"``, ``"wallclock"``...).
    """

    median_us: float
    min_us: float
    spread: float
    n: int
    calls_per_sample: int
    timer: str

    @classmethod
    def from_samples(
        cls, per_call_us: Sequence[float], *, calls_per_sample: int, timer: str
    ) -> Measurement:
        """Summarises per-call samples (already divided by ``calls_per_sample``)."""
        if not per_call_us:
            raise ValueError("Measurement.from_samples needs at least one sample")
        ordered = sorted(per_call_us)
        median = statistics.median(ordered)
        if len(ordered) >= 4:
            q1, _, q3 = statistics.quantiles(ordered, n=4)
            spread = (q3 - q1) / median if median > 0 else 0.0
        else:
            spread = (ordered[-1] - ordered[0]) / median if median > 0 and len(ordered) > 1 else 0.0
        return cls(
            median_us=median,
            min_us=ordered[0],
            spread=spread,
            n=len(ordered),
            calls_per_sample=calls_per_sample,
            timer=timer,
        )


@runtime_checkable
class Timer(Protocol):
    """Measures the per-call time of ``fn``.

    Implementations must run ``fn`` at least once untimed before timing (warm-up) and must not
    rely on ``fn`` returning anything.
    """

    name: str

    def measure(self, fn: TimedFn, *, warmup: int, repeat: int) -> Measurement:
        """Times ``fn``.

        Args:
            fn: Performs the ``i``-th back-to-back call; must be safe to call many times.
            warmup: Untimed calls before timing.
            repeat: Back-to-back calls per sample (graph timer: calls captured in one graph).

        Returns:
            The per-call time summary.
        """
        ...


@runtime_checkable
class TimerSession(Protocol):
    """One ``fn`` set up for timing (see :class:`SessionTimer`); also a context manager."""

    def measure(self) -> Measurement:
        """One measurement of ``fn`` (the timer's samples); may be called many times."""
        ...

    def close(self) -> None:
        """Releases what the session holds (a captured graph, its memory pool)."""
        ...

    def __enter__(self) -> TimerSession: ...

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class SessionTimer(Protocol):
    """A :class:`Timer` that can set ``fn`` up once and measure it many times."""

    name: str

    def measure(self, fn: TimedFn, *, warmup: int, repeat: int) -> Measurement:
        """As :meth:`Timer.measure` (one session, one measurement)."""
        ...

    def open(
        self, fn: TimedFn, *, warmup: int, repeat: int, hint_us: float | None = None
    ) -> TimerSession:
        """Warms ``fn`` up and prepares it for timing (graph timer: captures it).

        ``hint_us`` is a guess of one call's time (or ``None``) that a timer may use to size
        its set-up; it must never change what is measured.

        Raises:
            Whatever :meth:`measure` raises for the same set-up.
        """
        ...
