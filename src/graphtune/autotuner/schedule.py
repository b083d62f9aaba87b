"""Which candidates of one profile the tuner measures, in what order, and what it records.

The tuner owns the timer, the executor and the failure handling; this module owns the schedule,
given a ``measure(candidate)`` callback that appends one sample (or marks the candidate failed):

1. :func:`interleave`: ``rounds`` round-robin rounds over every candidate, so a slow drift of
   clocks or temperature hits every candidate alike; after the first round, :func:`race` keeps
   only the candidates within ``race_margin`` of the fastest for the later rounds (a candidate
   far behind after one sample cannot win, and each of its later samples costs as much as one of
   a contender's);
2. :func:`remeasure_top`: the ``top`` fastest again, round-robin, for ``rounds`` rounds;
3. :func:`settle`: the fastest and the undecided candidates (see
   :mod:`graphtune.autotuner.selection`) again, round-robin, until none is undecided.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from graphtune.autotuner.identity import short_runner_name
from graphtune.autotuner.runner import TunableRunner
from graphtune.autotuner.selection import ProfileRecord, Selection, TieRule, candidate_record


@dataclass
class Candidate:
    """One (runner, tactic) of a profile and its samples (the distributed ``Candidate``).

    Attributes:
        runner_index: Position of the runner in the ``runners`` given to ``choose_one``.
        runner: The runner.
        tactic_index: Position of the tactic (renumbered to rank 0's order when distributed).
        tactic: The tactic.
        samples: One per-call time in microseconds per measurement.
        failed: Why it failed, or ``None``.
        raced_out: Left the race after the first round (:func:`race`): it keeps its one sample
            and loses to any candidate still racing.
    """

    runner_index: int
    runner: TunableRunner
    tactic_index: int
    tactic: Any
    samples: list[float] = field(default_factory=list)
    failed: str | None = None
    raced_out: bool = False

    @property
    def order(self) -> tuple[int, int]:
        """The tie-break key: lower wins a tie."""
        return (self.runner_index, self.tactic_index)

    @property
    def score(self) -> float:
        """Median time, or ``inf`` when failed or not timed."""
        return statistics.median(self.samples) if self.samples and not self.failed else math.inf


Measure = Callable[[Candidate], None]


def interleave(
    candidates: list[Candidate], measure: Measure, rounds: int, after_each: Callable[[], None]
) -> None:
    """``rounds`` round-robin rounds over ``candidates`` (failed ones are skipped, but
    ``after_each`` still runs once per candidate and round, e.g. to advance a progress bar)."""
    for _ in range(rounds):
        for cand in candidates:
            if cand.failed is None:
                measure(cand)
            after_each()


def race(candidates: list[Candidate], margin: float, rule: TieRule) -> list[Candidate]:
    """The working, timed candidates whose score is at most ``(1 + margin)`` times the fastest
    score, in their given order (every working one when ``margin`` is 0 or none was timed).

    A candidate left out keeps its one sample and is marked ``raced_out``: :func:`select`
    leaves it out of the pick while any candidate still racing works, since the fastest one's
    median may rise past its first sample in later rounds and would then tie it on one sample.
    The margin is widened to every fixed part of ``rule``'s tie band (its tolerance, and its
    floor in µs over the fastest time: below 0.2 µs the floor is wider than 15%) and is at
    least the noise band's cap, so a candidate left out could not have tied the first round.
    """
    alive = [c for c in candidates if c.failed is None and c.samples]
    if margin <= 0 or not alive:
        return [c for c in candidates if c.failed is None]
    best = min(c.score for c in alive)
    widest = max(margin, rule.floor, rule.floor_us / best if best > 0 else math.inf)
    racing = [c for c in alive if c.score <= best * (1.0 + widest)]
    kept = {id(c) for c in racing}  # by identity: candidates with equal fields are distinct
    for cand in alive:
        cand.raced_out = id(cand) not in kept
    return racing


def remeasure_top(candidates: list[Candidate], measure: Measure, top: int, rounds: int) -> None:
    """The ``top`` fastest working candidates again, round-robin, for ``rounds`` rounds (nothing
    when fewer than two would be measured)."""
    alive = sorted((c for c in candidates if c.failed is None), key=lambda c: (c.score, c.order))
    chosen = alive[:top]
    if len(chosen) > 1:
        interleave(chosen, measure, rounds, lambda: None)


def select(candidates: list[Candidate], rule: TieRule) -> tuple[list[Candidate], Selection]:
    """The candidates in tie-break order, and what ``rule`` decides about them. Raced-out ones
    take no part while a candidate still racing works (they lost the race: see :func:`race`)."""
    ordered = sorted(candidates, key=lambda c: c.order)
    racing = any(c.failed is None and c.samples and not c.raced_out for c in ordered)
    return ordered, rule.select(
        [c.samples if c.failed is None and not (racing and c.raced_out) else [] for c in ordered]
    )


def settle(candidates: list[Candidate], measure: Measure, rule: TieRule, max_rounds: int) -> int:
    """Measures the fastest and the undecided candidates again, round-robin, until none is
    undecided or ``max_rounds`` rounds ran; returns the rounds run."""
    for done in range(max_rounds):
        ordered, chosen = select(candidates, rule)
        if not chosen.undecided or chosen.fastest is None:
            return done
        again = [ordered[i] for i in sorted({chosen.fastest, *chosen.undecided})]
        interleave(again, measure, 1, lambda: None)
    return max_rounds


def record(
    op: str,
    profile: str,
    ids: tuple[str, ...],
    ordered: list[Candidate],
    chosen: Selection,
    seconds: float = 0.0,
) -> ProfileRecord:
    """The :class:`ProfileRecord` of one profile, from :func:`select`'s output."""
    candidates = tuple(
        candidate_record(
            short_runner_name(ids[c.runner_index]),
            c.runner_index,
            c.tactic,
            c.samples,
            c.failed,
            chosen.tied[i],
        )
        for i, c in enumerate(ordered)
    )
    return ProfileRecord(op, profile, candidates, chosen.winner, chosen.tie_band, seconds)
