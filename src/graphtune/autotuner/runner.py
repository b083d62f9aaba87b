"""The TunableRunner interface: one implementation of an op, with several configs ("tactics")."""

from __future__ import annotations

import json
from typing import Any

FALLBACK_TACTIC = -1
"""The tactic every runner must accept on every shape; used when nothing was tuned."""


class TunableRunner:
    """One implementation of an op. Subclass it and override ``forward`` (and usually
    ``get_valid_tactics``).

    Tactics are JSON-serialisable values (ints, strings, lists, dicts of those) because the pick
    is stored in the cache file; a tuple tactic comes back from a file as a list. Tactic ``-1``
    (:data:`FALLBACK_TACTIC`) is the fallback and must work on every shape.
    """

    def get_valid_tactics(self, inputs: list[Any], profile: Any) -> list[Any]:
        """Tactics worth timing for these (synthetic) inputs.

        Args:
            inputs: Synthetic inputs shaped like the profile being tuned.
            profile: The :class:`~graphtune.autotuner.profiles.Profile` being tuned.

        Returns:
            Tactics to time; an empty list means the runner does not apply to this profile.
            The default offers only the fallback tactic.
        """
        return [FALLBACK_TACTIC]

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC) -> Any:
        """Runs the op on ``inputs`` with ``tactic`` and returns its output."""
        raise NotImplementedError(
            f"{type(self).__qualname__} must implement forward(inputs, tactic)"
        )

    def prepare(self, inputs: list[Any], tactic: Any) -> None:
        """Untimed one-off work before ``tactic`` is timed (e.g. JIT compilation). Optional."""
        return None

    def cache_key_extras(self) -> tuple[Any, ...]:
        """Extra identity for the cache key, e.g. a weight layout or a compile flag. Optional.

        Two runner objects of the same class with different extras never share cache entries.
        """
        return ()

    def __call__(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC) -> Any:
        return self.forward(inputs, tactic)


def preferred_first(tactics: list[Any], preferred: Any) -> list[Any]:
    """``tactics`` with ``preferred`` moved to the front (unchanged when it is not listed).

    The tuner gives a tie to the earliest-listed candidate, so a runner lists its prior (the
    tactic that is best or close to it on typical hardware) first: then near-ties, whose order
    changes from one tuning run to the next, resolve to the same good tactic every time.
    """
    return sorted(tactics, key=lambda tactic: tactic != preferred)


def runner_id(runner: TunableRunner) -> str:
    """Stable identity of a runner for cache keys: ``module.QualName`` plus its extras as JSON."""
    cls = type(runner)
    ident = f"{cls.__module__}.{cls.__qualname__}"
    extras = runner.cache_key_extras()
    if extras:
        # sort_keys so dict extras give the same id in every process; default=str keeps unusual
        # values (dtypes, enums) usable instead of failing the lookup.
        ident += json.dumps(list(extras), sort_keys=True, default=str, separators=(",", ":"))
    return ident


def short_runner_name(ident: str) -> str:
    """The class name part of a runner id, for tables."""
    base, bracket, rest = ident.partition("[")
    return base.rsplit(".", 1)[-1] + (bracket + rest if bracket else "")
