"""What ``Engine.generate`` tells its ``on_tokens`` hook while it runs: after every prefill round
and decode step, one :class:`TokenEvent` per request that took a token (or failed) in it.

A caller can stream each request's tokens as they come, show progress, and keep the requests that
finished even when the call does not return (an interrupt, an error in a later step): the
finishing event carries the request's whole output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from graphtune.engine.requests import FinishReason, LiveRequest, finish_reason
from graphtune.errors import ConfigError


@dataclass(frozen=True)
class TokenEvent:
    """One request's news from one prefill round or decode step of ``Engine.generate``.

    Attributes:
        index: The request's prompt's position in the ``generate`` call.
        token: The token it took, or ``None`` when its logits were not finite (it failed).
        generated: Tokens in its output so far (``token`` included).
        finish_reason: ``None`` while it goes on; else why it finished: ``"stop"`` (a stop
            token, included in its output), ``"length"`` (its ``max_new_tokens``) or
            ``"failed"`` (logits that were not finite; listed in ``Engine.failures``). A
            request's last event is the one with a reason; every request gets one unless the
            call ends early (an exception, ``strict_numerics``).
        output: Its whole output, on its finishing event (``generate`` returns the same); ``None``
            before.
    """

    index: int
    token: int | None
    generated: int
    finish_reason: FinishReason | None
    output: tuple[int, ...] | None


#: The type of ``Engine.generate``'s ``on_tokens`` hook.
TokenHook = Callable[[Sequence[TokenEvent]], None]


def token_events(rows: Sequence[LiveRequest], stops: set[int]) -> list[TokenEvent]:
    """The events of ``rows``, the requests that just took a token (or failed), in their order
    (the live batch's rows: not prompt order)."""
    events = []
    for request in rows:
        reason = finish_reason(request, stops)
        events.append(
            TokenEvent(
                index=request.index,
                token=None if request.failed else request.output[-1],
                generated=len(request.output),
                finish_reason=reason,
                output=None if reason is None else tuple(request.output),
            )
        )
    return events


def check_hook(hook: object) -> None:
    """Refuses an ``on_tokens`` that cannot be called, before ``generate`` takes any KV slot.

    Raises:
        ConfigError: ``hook`` is neither ``None`` nor callable.
    """
    if hook is not None and not callable(hook):
        raise ConfigError(f"on_tokens must be callable or None, got {type(hook).__name__}")


def notify(hook: TokenHook | None, rows: Sequence[LiveRequest], stops: set[int]) -> None:
    """Calls ``hook`` (``None``: nothing to do) with the events of ``rows``
    (:func:`token_events`)."""
    if hook is not None:
        hook(token_events(rows, stops))
