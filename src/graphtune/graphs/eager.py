"""EagerRunner: the graph runner's call interface without graphs, for engines that pick one."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from graphtune.errors import ConfigError
from graphtune.graphs.keys import named_inputs_error
from graphtune.graphs.policy import FallbackReason
from graphtune.graphs.runner import RunnerState
from graphtune.graphs.stats import RunnerStats


class EagerRunner:
    """Runs ``fn`` eagerly with the graph runner's interface (``capture``/``release`` do nothing).

    It has the graph runner's calls, ``capture``, ``release``, ``freeze``/``unfreeze``,
    ``stats`` (each call counted as ``disabled``) and ``state``, and its read-only ``frozen``,
    ``max_batch_size``, ``capture_sizes`` (empty), ``captured_keys`` (empty) and ``fallback_reason``
    (``DISABLED``: graphs are off by choice); not ``padded_inputs`` or ``policy``.

    Args:
        fn: The step callable.
        max_batch_size: What ``max_batch_size`` reports (the runner never refuses a batch).
    """

    def __init__(self, fn: Callable[..., Any], *, max_batch_size: int | None = None) -> None:
        if not callable(fn):
            raise ConfigError(f"fn must be callable, got {type(fn).__name__}; pass the step")
        if max_batch_size is not None and (
            not isinstance(max_batch_size, int)
            or isinstance(max_batch_size, bool)
            or max_batch_size < 1
        ):
            raise ConfigError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        self.fn = fn
        self._max_batch_size = max_batch_size
        self.stats = RunnerStats()
        self.state = RunnerState.NEW
        self._frozen = False

    @property
    def max_batch_size(self) -> int | None:
        """The ``max_batch_size`` given at construction, or None (read-only)."""
        return self._max_batch_size

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        """The captured batch sizes: none."""
        return ()

    @property
    def frozen(self) -> bool:
        """Whether :meth:`freeze` was called (and :meth:`unfreeze` not since)."""
        return self._frozen

    @property
    def fallback_reason(self) -> FallbackReason:
        """Why every call runs eagerly: ``DISABLED`` (an eager runner has no graphs)."""
        return FallbackReason.DISABLED

    @property
    def captured_keys(self) -> list[tuple[Hashable, int]]:
        """``(extra_key, size)`` of every live graph: none."""
        return []

    def capture(self, *example_inputs: Any) -> None:
        """Does nothing (there is nothing to capture)."""
        return None

    def __call__(self, *inputs: Any, **named: Any) -> Any:
        self.stats.calls += 1
        if named:
            raise named_inputs_error(named)
        # Counted as the graph runner counts its enabled=False calls, so stats compare alike.
        self.stats.count_fallback(FallbackReason.DISABLED)
        return self.fn(*inputs)

    def freeze(self) -> None:
        """Records the freeze (an eager runner never captures anyway)."""
        self._frozen = True

    def unfreeze(self) -> None:
        """Clears the freeze."""
        self._frozen = False

    def release(self) -> None:
        """Does nothing (nothing is held)."""
        self.state = RunnerState.RELEASED

    def __repr__(self) -> str:
        return f"EagerRunner({getattr(self.fn, '__name__', self.fn)!r})"
