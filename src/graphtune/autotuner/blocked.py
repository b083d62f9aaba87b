"""Dropping the candidates a cache's blocklist names (docs/reliability.md, "The blocklist").

A tuning run checks the blocklist twice: while planning (before ``prepare_all``), and again just
before each profile is prepared and timed, since a tactic that crashed or hung in one profile of
the run is blocklisted then and must not cost another worker or timeout in the next profile.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from graphtune.autotuner.cache import TuningCache
from graphtune.autotuner.entries import tactic_text
from graphtune.autotuner.identity import short_runner_name
from graphtune.autotuner.schedule import Candidate
from graphtune.autotuner.stats import TunerStats

logger = logging.getLogger(__name__)

C = TypeVar("C", bound=Candidate)


def drop_blocked(
    op: str,
    cache: TuningCache,
    ids: tuple[str, ...],
    candidates: list[C],
    stats: TunerStats | None,
) -> list[C]:
    """The ``candidates`` the blocklist of ``cache`` does not name. Each one it names is counted
    in ``stats.tactics_blocked`` and logged, unless ``stats`` is ``None``: a look-ahead (such as
    ``AutoTuner.prepare``) whose tuning run counts it later."""
    kept = []
    for cand in candidates:
        blocked = cache.blocked(ids[cand.runner_index], cand.tactic)
        if blocked is None:
            kept.append(cand)
            continue
        if stats is not None:  # crashed or hung before: never run it again
            stats.tactics_blocked += 1
            logger.info(
                "op %r: skipping blocklisted %s tactic %s (%s); clear it with "
                "`graphtune cache unblock FILE` to retry",
                op,
                short_runner_name(ids[cand.runner_index]),
                tactic_text(cand.tactic),
                blocked.reason,
            )
    return kept
