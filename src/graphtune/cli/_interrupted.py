"""What an interrupted tuning command (``tune``, ``demo``) kept, for the message
:func:`graphtune.cli.main.main` prints after ``error: interrupted (Ctrl-C)``: the command catches
the ``KeyboardInterrupt`` and raises a new one whose only argument says it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def interrupted_picks(tuner: Any, cache: Path | None) -> str:
    """What an interrupted tuning command kept, for the ``KeyboardInterrupt``'s message.

    Counts only the picks this run made (``tuner.stats``), not those the cache file held before;
    ``autotune()`` tried to save them before the interrupt reached the command, and a failed save
    logged a warning naming where they went instead.
    """
    made = tuner.stats.profiles_tuned + tuner.stats.untimed_picks
    if not made:
        return "nothing was tuned yet"
    if cache is None:
        # Without a cache file the picks lived in memory only: say they are gone, not kept.
        return f"{made} finished picks not kept: no --cache file (nor GRAPHTUNE_CACHE) was given"
    unsaved = tuner.cache.unsaved(cache)
    if unsaved:
        return (
            f"{unsaved} finished picks could not be saved to {cache} (the warning above says "
            "where they are)"
        )
    return f"{made} finished picks kept in {cache}"
