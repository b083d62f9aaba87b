"""Fake timers the CPU tests share, standing in for the GPU's timing so a known candidate wins."""

from __future__ import annotations

from graphtune.autotuner import AutoTuner, TuningPolicy
from graphtune.autotuner.timing.base import Measurement


class EveryCandidateEqual:
    """Fake timer: every candidate takes 1 us, so the first-listed wins (the torch fallback where
    it is listed first), and no candidate runs: nothing is interpreted."""

    name = "fake"

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        return Measurement.from_samples([1.0], calls_per_sample=1, timer=self.name)


class LastIsFastest:
    """Every measurement is faster than the one before: with one round, no re-measuring and no tie
    tolerance, the last-listed candidate of each profile wins.

    Args:
        run: Also run each candidate once on its synthetic inputs (a candidate that raises then
            fails as it would on the GPU).
    """

    name = "fake"

    def __init__(self, *, run: bool = False) -> None:
        self.calls = 0
        self.run = run

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        self.calls += 1
        if self.run:
            fn(0)
        return Measurement.from_samples([1000.0 / self.calls], calls_per_sample=1, timer=self.name)


def last_wins_tuner(*, run: bool = False) -> AutoTuner:
    """A tuner on :class:`LastIsFastest` whose picks are the last-listed candidates (``run``:
    see :class:`LastIsFastest`)."""
    return AutoTuner(
        timer=LastIsFastest(run=run),
        show_progress=False,
        policy=TuningPolicy(rounds=1, remeasure_top=0, tie_tolerance=0.0, tie_floor_us=0.0),
    )


class Clock:
    """A fake clock that runners advance by their cost per call (microseconds)."""

    def __init__(self) -> None:
        self.now_us = 0.0


class ClockTimer:
    """Fake timer: a sample's per-call time is how far ``repeat`` calls advanced ``clock``."""

    name = "fake"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        start = self.clock.now_us
        for i in range(repeat):
            fn(i)
        per_call = (self.clock.now_us - start) / repeat
        return Measurement.from_samples([per_call], calls_per_sample=repeat, timer=self.name)
