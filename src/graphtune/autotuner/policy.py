"""How much the tuner measures and when a difference counts: one frozen :class:`TuningPolicy`.

The measurement schedule is :mod:`graphtune.autotuner.schedule`; the pick rule that the tie knobs
parameterise is :mod:`graphtune.autotuner.selection`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from graphtune.autotuner.selection import TieRule
from graphtune.errors import ConfigError


def _count(name: str, value: Any, low: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"TuningPolicy({name}={value!r}): must be an int >= {low}{hint}.")


@dataclass(frozen=True)
class TuningPolicy:
    """Measurement and tie knobs of an :class:`~graphtune.autotuner.AutoTuner`.

    Attributes:
        rounds: Interleaved measurement rounds (and again over the top few). The first round
            measures every candidate; the later ones only those still racing (``race_margin``).
        race_margin: After the first round, candidates slower than the fastest by more than this
            fraction (0.15 = 15%) are not measured again; they keep their one sample and lose.
            Kept above ``max_tie_tolerance`` so that a candidate left out could never have been
            tied; 0 turns racing off. Not applied by collective distributed strategies, whose
            ranks must all measure the same candidates.
        remeasure_top: How many of the fastest candidates are measured again (0 turns it off).
        tie_tolerance: Relative gap below which a difference never matters (0.005 = 0.5%): the
            floor of the tie threshold. Ties go to the lowest (runner index, tactic index).
        noise_z: Standard errors of the difference of two medians that count as noise (the
            noise band; see :mod:`graphtune.autotuner.selection`).
        max_tie_tolerance: Cap of the noise band (0.05 = 5%); ``tie_tolerance`` applies even
            above it.
        max_extra_rounds: Most adaptive rounds over the fastest and the undecided candidates
            (gap above the floor, inside the band); 0 turns them off.
        tie_floor_us: Absolute gap in microseconds per call below which a difference never
            matters (the floor is the larger of this and ``tie_tolerance``; 0.03 = 30 ns);
            0 turns it off.
        input_sets: Distinct synthetic input sets per profile (fresh allocations and values);
            the k-th measurement of every candidate uses set ``k % input_sets``, so a pick does
            not rest on one allocation's luck. Sets past the first are only made while all of
            them fit in ``INPUT_SET_BYTES``. Cold-L2 timing already rotates copies inside every
            measurement and ignores it.
        session_bytes: Device memory that reused timer sessions may hold together. With the
            graph timer a candidate's graph is captured on its first measurement and replayed
            for the later ones of the same bucket; past this many bytes of captured graphs a
            candidate is captured again for every measurement. 0 always captures again.
    """

    rounds: int = 3
    race_margin: float = 0.15
    remeasure_top: int = 3
    tie_tolerance: float = 0.005
    noise_z: float = 2.0
    max_tie_tolerance: float = 0.05
    max_extra_rounds: int = 6
    tie_floor_us: float = 0.03
    input_sets: int = 1
    session_bytes: int = 8 << 30

    def __post_init__(self) -> None:
        _count("rounds", self.rounds, 1, "")
        _count("remeasure_top", self.remeasure_top, 0, " (0 turns it off)")
        _count("max_extra_rounds", self.max_extra_rounds, 0, " (0 turns the adaptive rounds off)")
        _count("input_sets", self.input_sets, 1, " (1 times every candidate on one input set)")
        _count("session_bytes", self.session_bytes, 0, " (0 captures again for every measurement)")
        _ = self.tie_rule  # validates the tie knobs (TieRule names them)
        margin = self.race_margin
        if (
            isinstance(margin, bool)
            or not isinstance(margin, int | float)
            or not (margin == 0 or self.max_tie_tolerance <= margin < math.inf)
        ):
            raise ConfigError(
                f"TuningPolicy(race_margin={margin!r}): must be 0 (racing off) or a finite "
                f"number >= max_tie_tolerance ({self.max_tie_tolerance}), e.g. 0.15 for 15%, so "
                "that a candidate dropped from the race could never have been tied."
            )

    @property
    def tie_rule(self) -> TieRule:
        """The pick rule these knobs describe."""
        return TieRule(self.tie_tolerance, self.noise_z, self.max_tie_tolerance, self.tie_floor_us)
