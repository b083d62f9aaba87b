"""The TunableRunner interface: one implementation of an op, with several configs ("tactics").

The interface is TensorRT-LLM's: the tuner calls ``runner.get_valid_tactics(inputs, profile,
**kwargs)`` and ``runner.forward(inputs, tactic=..., **kwargs)`` with the keyword arguments given
to ``choose_one``, so a runner declared ``forward(self, inputs, *, tactic=-1, **kwargs)`` (or with
``tactic`` positional-or-keyword) works unchanged. What identifies a runner in the cache is in
:mod:`graphtune.autotuner.identity`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from graphtune.autotuner.identity import runner_config

FALLBACK_TACTIC = -1
"""The tactic every runner must accept on every shape; used when nothing was tuned."""


class TunableRunner:
    """One implementation of an op. Subclass it and override ``forward`` (and usually
    ``get_valid_tactics``).

    Tactics are JSON values (ints, floats, strings, tuples, lists, dicts of those), because the
    pick is stored in the cache file; they come back from a file with their types. Tactic ``-1``
    (:data:`FALLBACK_TACTIC`) is the fallback and must work on every shape.

    Attributes:
        identity_excludes: Names of public instance attributes that are not part of the runner's
            identity (counters, thread counts: state that changes neither what the runner
            computes nor which tactics it offers). Private attributes (``_name``) never are.
        source_modules: Modules besides those of the runner's own class hierarchy whose source
            decides what it computes (e.g. its Triton kernels' module); a change to any of them
            invalidates the runner's cached picks.
        requires_tactic: Whether ``get_valid_tactics`` must offer at least one tactic on every
            profile; if its pruning leaves none, tuning raises a ``TuningError`` naming the
            runner instead of silently leaving it out.
    """

    identity_excludes: ClassVar[frozenset[str]] = frozenset()
    source_modules: ClassVar[tuple[str, ...]] = ()
    requires_tactic: ClassVar[bool] = False

    def get_valid_tactics(self, inputs: list[Any], profile: Any, **kwargs: Any) -> list[Any]:
        """Tactics worth timing for these (synthetic) inputs.

        Args:
            inputs: Synthetic inputs shaped like the profile being tuned.
            profile: The :class:`~graphtune.autotuner.profiles.Profile` being tuned.
            **kwargs: The keyword arguments given to ``choose_one``.

        Returns:
            Tactics to time, the fallback ``-1`` included only if it should be timed; an empty
            list means the runner does not apply to this profile. The default offers only the
            fallback tactic.
        """
        return [FALLBACK_TACTIC]

    def forward(self, inputs: list[Any], *, tactic: Any = FALLBACK_TACTIC, **kwargs: Any) -> Any:
        """Runs the op on ``inputs`` with ``tactic`` and returns its output."""
        raise NotImplementedError(
            f"{type(self).__qualname__} must implement forward(inputs, *, tactic=-1, **kwargs)"
        )

    def prepare(self, inputs: list[Any], tactic: Any) -> None:
        """Untimed one-off work before ``tactic`` is timed (e.g. JIT compilation). Optional."""
        return None

    def prepare_all(self, work: Sequence[tuple[list[Any], Sequence[Any]]]) -> None:
        """Untimed one-off work for many ``(inputs, tactics)`` pairs before any is timed, e.g.
        compiling every tactic of every profile of an op at once. Optional; :meth:`prepare` is
        still called for each tactic (and should then find its work done)."""
        return None

    def prepare_ahead(self, work: Sequence[tuple[list[Any], Sequence[Any]]]) -> bool:
        """Starts the one-off work of :meth:`prepare_all` for ``work`` in the background (e.g.
        compiling in worker processes) and returns at once, so other ops can be timed
        meanwhile; :meth:`prepare_all` later finishes it. Returns whether it started anything;
        the default starts nothing (``False``), and the tuner then runs :meth:`prepare_all`
        up front instead."""
        return False

    def cache_key_extras(self) -> tuple[Any, ...]:
        """Identity beyond the class for the cache key.

        The default is the runner's configuration: ``({name: value, ...},)`` of its public
        instance attributes (see :func:`~graphtune.autotuner.identity.runner_config`), or ``()``
        when it has none. Override it to state the key explicitly; two runner objects of one class
        with different extras never share cache entries.
        """
        config = runner_config(self)
        return (config,) if config else ()

    def __call__(self, inputs: list[Any], **kwargs: Any) -> Any:
        return self.forward(inputs, **kwargs)


def preferred_first(tactics: list[Any], preferred: Any) -> list[Any]:
    """``tactics`` with ``preferred`` moved to the front (unchanged when it is not listed).

    The tuner gives a tie to the earliest-listed candidate, so a runner lists its prior (the
    tactic that is best or close to it on typical hardware) first: then near-ties, whose order
    changes from one tuning run to the next, resolve to the same good tactic every time.
    """
    return sorted(tactics, key=lambda tactic: tactic != preferred)
