"""Failures of runners while tuning: counted by reason, each (op, reason) warned about once."""

from __future__ import annotations

import logging

from graphtune.autotuner.isolation import TacticFailure
from graphtune.autotuner.runner import TunableRunner
from graphtune.autotuner.stats import TunerStats

logger = logging.getLogger(__name__)


class FailureLog:
    """Counts failures in ``stats.tactic_failures`` and warns once per (op, reason)."""

    def __init__(self, stats: TunerStats) -> None:
        self.stats = stats
        self.logged: set[tuple[str, str]] = set()

    def add(self, op: str, runner: TunableRunner, what: str, exc: Exception) -> None:
        """Counts one failure of ``runner``'s ``what`` (e.g. ``"timing of tactic 3"``)."""
        if isinstance(exc, TacticFailure):
            reason, detail = exc.reason, exc.detail
        else:
            reason, detail = type(exc).__name__, str(exc)
        failures = self.stats.tactic_failures
        failures[reason] = failures.get(reason, 0) + 1
        name = type(runner).__qualname__
        if (op, reason) in self.logged:
            logger.debug("op %r: %s %s failed: %s: %s", op, name, what, reason, detail)
            return
        self.logged.add((op, reason))
        logger.warning(
            "op %r: %s %s failed (%s: %s); it counts as infinitely slow and tuning goes on. "
            "Further %s failures of this op are counted in stats.tactic_failures only.",
            op,
            name,
            what,
            reason,
            detail,
            reason,
        )
