"""The counters of an :class:`~graphtune.autotuner.AutoTuner` (``tuner.stats``)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Keys of ``TunerStats.phase_seconds``, in the order a tuning run spends them.
PHASES = ("inputs", "tactics", "prepare", "measure", "select")


@dataclass
class TunerStats:
    """Counters of one :class:`~graphtune.autotuner.AutoTuner` (``reset_stats()`` zeroes them).

    Attributes:
        hits: ``choose_one`` calls answered from the cache.
        misses: Calls whose shape was not in the cache (tuned, or answered with the fallback).
        fallbacks: Per op, calls answered with ``(runners[0], -1)`` because nothing was tuned
            (or the size has no bucket).
        profiles_tuned: (op, bucket) combinations tuned and cached.
        profiles_failed: Profiles where every candidate failed: not cached, retried by a later
            tuning run.
        untimed_picks: Profiles with a single candidate, picked without timing.
        tactics_timed: (runner, tactic) candidates timed successfully, summed over profiles.
        measurements: Timer calls made.
        extra_rounds: Adaptive rounds run to decide candidates inside the noise band.
        raced_out: Candidates measured once only, being too far behind the fastest after the
            first round (``TuningPolicy.race_margin``), summed over profiles (those re-timed
            are not counted).
        retimed: Raced-out candidates measured again to the full sample count because the
            fastest racing candidate's final median ended more than the race margin above their
            one sample (``graphtune.autotuner.schedule.retime_raced_out``).
        tactic_failures: Failed candidates by reason: an exception type name, or ``timeout``,
            ``crash``, ``context corrupted``, ``invalid time`` (NaN, inf or <= 0 from the timer).
        tactics_blocked: Candidates skipped because the blocklist names them.
        workers_started: Worker processes started (``isolation="subprocess"``).
        tuning_seconds: Wall time spent tuning.
        phase_seconds: Where that time went (keys of :data:`PHASES`): ``inputs`` (synthetic
            input sets), ``tactics`` (``get_valid_tactics``), ``prepare`` (``prepare_all`` and
            ``prepare``: compilation), ``measure`` (timer calls, graph capture included) and
            ``select`` (the pick rule and bookkeeping). The rest of ``tuning_seconds`` is
            scheduling overhead.
    """

    hits: int = 0
    misses: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    profiles_tuned: int = 0
    profiles_failed: int = 0
    untimed_picks: int = 0
    tactics_timed: int = 0
    measurements: int = 0
    extra_rounds: int = 0
    raced_out: int = 0
    retimed: int = 0
    tactic_failures: dict[str, int] = field(default_factory=dict)
    tactics_blocked: int = 0
    workers_started: int = 0
    tuning_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
