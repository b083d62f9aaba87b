"""How ``graphtune generate`` follows its requests while the engine runs them: the engine's
``on_tokens`` hook (:class:`~graphtune.engine.events.TokenEvent`) advances a progress task over
the tokens to generate, and keeps each finished request's tokens, which an interrupted run still
prints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from graphtune.reporting import ProgressTask

if TYPE_CHECKING:  # the engine imports torch, and the command's parser must not
    from graphtune.engine.events import TokenEvent


class RequestProgress:
    """``Engine.generate``'s ``on_tokens`` hook for the command.

    The progress runs over every request's ``max_new_tokens``: a request that finishes early (a
    stop token, a failure) advances it by the tokens it will not generate too, so the bar ends
    full.

    Args:
        requests: Requests in the ``generate`` call.
        max_new_tokens: Each request's limit.

    Attributes:
        task: Where progress goes (:func:`graphtune.reporting.progress`); ``None``: nowhere.
        finished: Each finished request's tokens, by its index in the call.
        generated: Tokens generated so far, by finished and unfinished requests alike.
    """

    def __init__(self, requests: int, max_new_tokens: int) -> None:
        self.requests = requests
        self.max_new_tokens = max_new_tokens
        self.task: ProgressTask | None = None
        self.finished: dict[int, list[int]] = {}
        self.generated = 0

    @property
    def total(self) -> int:
        """Units of the progress: tokens, if every request ran to its limit."""
        return self.requests * self.max_new_tokens

    def label(self) -> str:
        """The progress's description: how many requests finished."""
        return f"generating ({len(self.finished)} of {self.requests} requests finished)"

    def __call__(self, events: Sequence[TokenEvent]) -> None:
        """Takes one step's events."""
        units = 0
        for event in events:
            if event.token is not None:
                units += 1
                self.generated += 1
            if event.finish_reason is not None:
                self.finished[event.index] = list(event.output or ())
                units += self.max_new_tokens - event.generated
        if self.task is not None:
            self.task.advance(self.label(), steps=units)
