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
   :mod:`graphtune.autotuner.selection`) again, round-robin, until none is undecided;
4. :func:`retime_raced_out`: when the race's premise broke (the fastest racing candidate's final
   median ended more than the race margin above a raced-out candidate's one sample), the
   raced-out candidates that beat that median get the full sample count, and :func:`settle`
   runs again (:func:`conclude` runs steps 3 and 4).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from graphtune.autotuner.identity import short_runner_name
from graphtune.autotuner.policy import TuningPolicy
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
            and loses to any candidate still racing, unless :func:`retime_raced_out` gives it
            the full sample count (then it races again, and this is ``False``).
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


def race_width(margin: float, rule: TieRule, best: float) -> float:
    """The race margin :func:`race` applies against ``best`` µs: ``margin`` widened to every
    fixed part of ``rule``'s tie band (its tolerance, and its floor in µs over ``best``)."""
    return max(margin, rule.floor, rule.floor_us / best if best > 0 else math.inf)


def race(candidates: list[Candidate], margin: float, rule: TieRule) -> list[Candidate]:
    """The working, timed candidates whose score is at most ``(1 + margin)`` times the fastest
    score, in their given order (every working one when ``margin`` is 0 or none was timed).

    A candidate left out keeps its one sample and is marked ``raced_out``: :func:`select`
    leaves it out of the pick while any candidate still racing works, since the fastest one's
    median may rise past its first sample in later rounds and would then tie it on one sample.
    Where that median rises more than the margin above its sample, the race's premise broke:
    :func:`retime_raced_out` then times it again rather than picking either on a stale time.
    The margin is widened to every fixed part of ``rule``'s tie band (:func:`race_width`: its
    tolerance, and its floor in µs over the fastest time: below 0.2 µs the floor is wider than
    15%) and is at least the noise band's cap, so a candidate left out could not have tied the
    first round.
    """
    alive = [c for c in candidates if c.failed is None and c.samples]
    if margin <= 0 or not alive:
        return [c for c in candidates if c.failed is None]
    best = min(c.score for c in alive)
    widest = race_width(margin, rule, best)
    racing = [c for c in alive if c.score <= best * (1.0 + widest)]
    kept = {id(c) for c in racing}  # by identity: candidates with equal fields are distinct
    for cand in alive:
        cand.raced_out = id(cand) not in kept
    return racing


def retime_raced_out(
    candidates: list[Candidate], measure: Measure, margin: float, rule: TieRule, rounds: int
) -> list[Candidate]:
    """Gives raced-out candidates the full sample count when the race's premise broke; returns
    those re-timed (none in the usual case, where nothing is measured).

    The race dropped them for being more than ``margin`` behind the leader's *first* sample.
    When the *final* median of the fastest candidate still racing is more than that margin
    (:func:`race_width`, taken over the raced-out sample) above a raced-out candidate's one
    sample (the leader's later samples rose: noise, contention), neither its median nor that
    stale sample can be trusted against the other. Then every raced-out candidate whose one
    sample beats that median (only those: the others stay out, on one sample) is measured
    again, round-robin together with the leader so that both see the same conditions, until it
    has as many samples as the leader had (at least ``rounds``); it then races again
    (``raced_out`` is cleared) and the pick compares medians over full samples. When every
    racing candidate failed, the leader's median counts as infinite: every raced-out one is
    re-timed (``rounds`` samples) instead of being picked on its one sample.
    """
    out = [c for c in candidates if c.raced_out and c.failed is None and c.samples]
    racing = [c for c in candidates if not c.raced_out and c.failed is None and c.samples]
    lead = min(racing, key=lambda c: (c.score, c.order), default=None)
    final = lead.score if lead is not None else math.inf
    again = [c for c in out if c.score < final]
    if not again:
        return []
    best = min(c.score for c in again)
    if final <= best * (1.0 + race_width(margin, rule, best)):
        return []  # within the margin: the race's premise holds, the raced-out stay out
    full = max(rounds, len(lead.samples) if lead is not None else 0)
    for cand in again:
        cand.raced_out = False
    group = sorted([*again, *([lead] if lead is not None else [])], key=lambda c: c.order)
    interleave(group, measure, full - 1, lambda: None)
    return again


def remeasure_top(candidates: list[Candidate], measure: Measure, top: int, rounds: int) -> None:
    """The ``top`` fastest working candidates again, round-robin, for ``rounds`` rounds (nothing
    when fewer than two would be measured)."""
    alive = sorted((c for c in candidates if c.failed is None), key=lambda c: (c.score, c.order))
    chosen = alive[:top]
    if len(chosen) > 1:
        interleave(chosen, measure, rounds, lambda: None)


def select(candidates: list[Candidate], rule: TieRule) -> tuple[list[Candidate], Selection]:
    """The candidates in tie-break order, and what ``rule`` decides about them. Raced-out ones
    take no part while a candidate still racing works (they lost the race: see :func:`race`;
    one whose sample beat the leader's final median by more than the race margin was re-timed
    by :func:`retime_raced_out` and races again)."""
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


def conclude(
    candidates: list[Candidate], measure: Measure, policy: TuningPolicy
) -> tuple[int, int]:
    """The adaptive end of a profile's schedule: :func:`settle`, then :func:`retime_raced_out`
    and, where it re-timed any, :func:`settle` again; returns (extra rounds, re-timed)."""
    rule, limit = policy.tie_rule, policy.max_extra_rounds
    extra = settle(candidates, measure, rule, limit)
    again = retime_raced_out(candidates, measure, policy.race_margin, rule, policy.rounds)
    if again:
        extra += settle(candidates, measure, rule, limit)
    return extra, len(again)


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
