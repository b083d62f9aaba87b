"""EagerRunner: the graph runner's call interface without graphs, for engines that pick one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphtune.errors import ConfigError
from graphtune.graphs.runner import RunnerState
from graphtune.graphs.stats import RunnerStats


class EagerRunner:
    """Runs ``fn`` eagerly with the graph runner's interface (``capture``/``release`` do nothing).

    Args:
        fn: The step callable.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        if not callable(fn):
            raise ConfigError(f"fn must be callable, got {type(fn).__name__}; pass the step")
        self.fn = fn
        self.stats = RunnerStats()
        self.state = RunnerState.NEW
        self.frozen = False

    def capture(self, *example_inputs: Any) -> None:
        """Does nothing (there is nothing to capture)."""
        return None

    def __call__(self, *inputs: Any) -> Any:
        self.stats.calls += 1
        self.stats.eager_calls += 1
        return self.fn(*inputs)

    def freeze(self) -> None:
        """Records the freeze (an eager runner never captures anyway)."""
        self.frozen = True

    def unfreeze(self) -> None:
        """Clears the freeze."""
        self.frozen = False

    def release(self) -> None:
        """Does nothing (nothing is held)."""
        self.state = RunnerState.RELEASED

    def __repr__(self) -> str:
        return f"EagerRunner({getattr(self.fn, '__name__', self.fn)!r})"
