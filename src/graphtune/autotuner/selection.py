"""The tuner's pick rule: the fastest candidate, and which others are tied with it given the noise.

Pure functions over each candidate's samples (per-call times in microseconds, one per timer
call), so the rule is unit-tested without a timer. Candidates are given in tie-break order: the
earliest-listed one wins a tie.

The rule, for the fastest candidate ``b`` (lowest median; on equal medians the earlier-listed)
and another candidate ``c`` with a usable median:

* ``gap = (median_c - median_b) / median_b``;
* ``se = 1.2533 * 1.4826 * MAD / sqrt(n)``: the standard error of a median, from the median
  absolute deviation of the candidate's ``n`` samples (robust to an outlier sample); 0 for fewer
  than two samples, so a candidate carrying one agreed time has no measured noise;
* ``band = z * sqrt(se_b**2 + se_c**2) / median_b``, capped at ``cap``;
* ``floor = max(floor, floor_us / median_b)``: a relative floor, and an absolute one for kernels
  of a microsecond or two, where a few nanoseconds are a large share but below what any clock
  here resolves (CUPTI timestamps step by 32 ns on an H200) and below what a decode step feels;
* ``c`` is **tied** with ``b`` when ``gap <= max(floor, band)``; the winner is the earliest-listed
  of ``b`` and the candidates tied with it;
* ``c`` is **undecided** when ``floor < gap <= band``: a real difference above the floor that the
  noise does not yet resolve. More samples of ``b`` and ``c`` shrink the band and decide it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from graphtune.errors import ConfigError

SE_OF_MEDIAN = math.sqrt(math.pi / 2.0)  # 1.2533: se(median) = 1.2533 sigma / sqrt(n), normal
MAD_TO_SIGMA = 1.4826  # sigma of a normal distribution = 1.4826 * MAD


def median_standard_error(samples: Sequence[float]) -> float:
    """Robust standard error of the median of ``samples`` (0 for fewer than two samples)."""
    n = len(samples)
    if n < 2:
        return 0.0
    center = statistics.median(samples)
    mad = statistics.median(abs(x - center) for x in samples)
    return SE_OF_MEDIAN * MAD_TO_SIGMA * mad / math.sqrt(n)


def relative_iqr(samples: Sequence[float]) -> float:
    """``(p75 - p25) / median`` of ``samples``, like ``Measurement.spread`` (range below 4)."""
    ordered = sorted(samples)
    if len(ordered) < 2:
        return 0.0
    median = statistics.median(ordered)
    if median <= 0:
        return 0.0
    if len(ordered) >= 4:
        q1, _, q3 = statistics.quantiles(ordered, n=4)
        return (q3 - q1) / median
    return (ordered[-1] - ordered[0]) / median


def noise_band(best: Sequence[float], other: Sequence[float], *, z: float, cap: float) -> float:
    """Relative gap to ``best``'s median that the two candidates' noise cannot resolve.

    Args:
        best: Samples of the fastest candidate (its median is the reference).
        other: Samples of the candidate compared with it.
        z: How many standard errors of the difference count as noise.
        cap: Upper bound of the band, so that a very noisy timer cannot tie everything.

    Returns:
        ``min(cap, z * sqrt(se_best**2 + se_other**2) / median(best))``: 0 when neither
        candidate has two samples or more (no noise was measured).
    """
    reference = statistics.median(best)
    if reference <= 0:
        return 0.0
    spread = math.hypot(median_standard_error(best), median_standard_error(other))
    return min(cap, z * spread / reference)


@dataclass(frozen=True)
class TieRule:
    """When a slower candidate counts as tied with the fastest (see the module docstring).

    Attributes:
        floor: Relative gap below which a difference never matters (``tie_tolerance``).
        z: Standard errors of the difference that count as noise (``noise_z``).
        cap: Largest noise band (``max_tie_tolerance``); the floor applies even above it.
        floor_us: Absolute gap in microseconds per call below which a difference never matters
            (``tie_floor_us``); 0 turns it off.
    """

    floor: float = 0.005
    z: float = 2.0
    cap: float = 0.05
    floor_us: float = 0.0

    def __post_init__(self) -> None:
        for name, value in (("tie_tolerance", self.floor), ("max_tie_tolerance", self.cap)):
            if not _real(value) or not 0.0 <= value < 1.0:
                raise ConfigError(
                    f"TuningPolicy({name}={value!r}): must be a number in [0, 1), e.g. 0.005 "
                    "for 0.5%."
                )
        if not _real(self.z) or not math.isfinite(self.z) or self.z <= 0:
            raise ConfigError(
                f"TuningPolicy(noise_z={self.z!r}): must be a finite number > 0 (standard errors "
                "of a difference that count as noise; 2.0 by default)."
            )
        if not _real(self.floor_us) or not 0.0 <= self.floor_us < math.inf:
            raise ConfigError(
                f"TuningPolicy(tie_floor_us={self.floor_us!r}): must be a finite number >= 0 "
                "(microseconds per call, e.g. 0.02 for 20 ns; 0 turns it off)."
            )

    def select(self, samples: Sequence[Sequence[float]]) -> Selection:
        """Applies the rule to candidates in tie-break order.

        Args:
            samples: Each candidate's samples; an empty sequence marks a failed or untimed
                candidate, which is never fastest, tied or picked. Medians must be > 0 to count.

        Returns:
            The fastest, the winner, which candidates are tied and which are undecided.
        """
        medians = [statistics.median(s) if s else math.inf for s in samples]
        alive = [i for i, m in enumerate(medians) if math.isfinite(m) and m > 0]
        if not alive:
            return Selection(None, None, (False,) * len(samples), (), self.floor)
        best = min(alive, key=lambda i: (medians[i], i))
        tied = [False] * len(samples)
        tied[best] = True
        undecided: list[int] = []
        floor = max(self.floor, self.floor_us / medians[best])
        widest = floor
        for i in alive:
            if i == best:
                continue
            gap = (medians[i] - medians[best]) / medians[best]
            band = noise_band(samples[best], samples[i], z=self.z, cap=self.cap)
            threshold = max(floor, band)
            widest = max(widest, threshold)
            tied[i] = gap <= threshold
            if floor < gap <= band:
                undecided.append(i)
        winner = min(i for i in alive if tied[i])
        return Selection(best, winner, tuple(tied), tuple(undecided), widest)


@dataclass(frozen=True)
class Selection:
    """What :meth:`TieRule.select` decided; indices refer to the candidates given.

    Attributes:
        fastest: The candidate with the lowest median, or ``None`` when none has a usable time.
        winner: The earliest-listed candidate tied with the fastest (the pick), or ``None``.
        tied: Per candidate, whether it is tied with the fastest (the fastest is).
        undecided: Candidates whose gap is above the floor but inside the noise band.
        tie_band: The widest tie threshold ``max(floor, band)`` applied to any candidate (the
            floor when there was nothing to compare).
    """

    fastest: int | None
    winner: int | None
    tied: tuple[bool, ...]
    undecided: tuple[int, ...]
    tie_band: float


@dataclass(frozen=True)
class CandidateRecord:
    """One (runner, tactic) as the tuner measured it for one profile.

    Attributes:
        runner: Short runner name (class name plus cache-key extras).
        runner_index: Position of the runner in the ``runners`` passed to ``choose_one``.
        tactic: The tactic (JSON-serialisable).
        median_us: Median per-call time in microseconds the pick used; ``inf`` when failed.
        spread: Relative spread of those samples, ``(p75 - p25) / median`` (0 for one sample).
        samples: How many samples the pick used (1 after a collective distributed agreement,
            which leaves one agreed time per candidate).
        failed: Why the candidate failed (an exception name, ``timeout``...), or ``None``.
        tied: Whether it was tied with the fastest (the winner was picked among the tied).
    """

    runner: str
    runner_index: int
    tactic: Any
    median_us: float
    spread: float
    samples: int
    failed: str | None
    tied: bool


@dataclass(frozen=True)
class ProfileRecord:
    """What the tuner measured and decided for one tuned profile (``AutoTuner.history``).

    Attributes:
        op: The op name.
        profile: The profile's ``describe()`` text (bucketed shapes).
        candidates: Every candidate, in tie-break order.
        winner_index: Index into ``candidates`` of the pick, or ``None`` when every candidate
            failed (nothing is cached; look-ups run the fallback).
        tie_band: The widest relative tie threshold applied (``Selection.tie_band``).
        seconds: Wall time the profile took, input synthesis and ``prepare`` included (its
            share of an op's ahead-of-time compilation is not).
    """

    op: str
    profile: str
    candidates: tuple[CandidateRecord, ...]
    winner_index: int | None
    tie_band: float
    seconds: float = 0.0


def candidate_record(
    runner: str,
    runner_index: int,
    tactic: Any,
    samples: Sequence[float],
    failed: str | None,
    tied: bool,
) -> CandidateRecord:
    """Builds the :class:`CandidateRecord` of one candidate from its samples."""
    usable = failed is None and len(samples) > 0
    return CandidateRecord(
        runner=runner,
        runner_index=runner_index,
        tactic=tactic,
        median_us=statistics.median(samples) if usable else math.inf,
        spread=relative_iqr(samples) if usable else 0.0,
        samples=len(samples),
        failed=failed,
        tied=tied,
    )


def _real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
