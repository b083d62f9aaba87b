"""How the graph timer sizes one replay: how many calls it captures, and how many copies it runs.

Pure decisions (no torch, no clocks), driven by the timer's probe replays, so the rules can be
tested on the CPU. A replay should last ``min_replay_us`` (event resolution and the replay's own
launch cost are small against it); within that:

* while one call is shorter than ``min_replay_us``, a replay holds at least ``min_calls``
  back-to-back calls, so the overlap between consecutive kernels (programmatic dependent launch)
  is in every sample;
* a call that alone lasts ``min_replay_us`` is replayed with the caller's ``repeat`` calls (the
  cold-L2 walk, or one call): more calls would only spend GPU time;
* with pieces, the calls are captured once as a piece of at least ``min_piece_us`` and the replay
  runs ``copies`` of it (:mod:`graphtune.autotuner.timing.repeated`), instead of capturing every
  call of a long replay;
* every capture, piece or not, holds a whole multiple of ``repeat`` calls (``max_repeat`` is
  rounded down to one), so a cold-L2 walk through the input copies stays in rotation within and
  across replays;
* a guess of one call's time (``hint_us``, e.g. the fastest candidate timed so far in the same
  bucket) sizes the first capture, which saves the capture and probe of ``min_calls`` calls
  that only served to estimate it. A guess above the call's time gives a short first capture,
  which grows once as without a guess; a guess below it gives a longer one (the first piece
  lasts ``min_piece_us`` times the ratio), never a wrong time. Without a timed estimate (one
  warm-up call), a guess of ``2 * min_replay_us`` or more starts at ``repeat`` calls as a long
  estimate does, so a caller that knows a call is long (a whole decode step timed before) skips
  the second warm-up call; the probe still decides, and a shorter call grows the capture.
"""

from __future__ import annotations

import math
from enum import Enum


def auto_repeat_calls(
    calls: int, replay_us: float, *, min_replay_us: float, max_repeat: int, headroom: float = 1.1
) -> int:
    """Returns how many calls one graph should hold so that a replay lasts ``min_replay_us``.

    Args:
        calls: Calls in the probed graph.
        replay_us: Measured duration of one replay of that graph.
        min_replay_us: Target replay duration.
        max_repeat: Upper bound on the result.
        headroom: Factor over the proportional estimate, so the new replay clears the target.

    Returns:
        ``calls`` when the replay is already long enough (or the cap is reached), otherwise a
        larger count, never above ``max(calls, max_repeat)``.
    """
    if replay_us >= min_replay_us or calls >= max_repeat:
        return calls
    per_call_us = max(replay_us / calls, 1e-3)  # a replay faster than 1 ns per call is noise
    wanted = math.ceil(min_replay_us / per_call_us * headroom - 1e-9)  # 110.000...01 -> 110
    return max(calls, min(max_repeat, wanted))


class Step(Enum):
    """What the timer does after a probe."""

    CAPTURE = "capture"  # capture ``plan.calls`` calls anew (``plan.copies`` is 1)
    REPEAT = "repeat"  # build ``plan.copies`` copies of the captured piece


class ReplayPlan:
    """The calls and copies of one replay, revised after each probe (see the module docstring).

    Args:
        repeat: The caller's fewest calls per replay (the cold-L2 walk, or 1).
        min_replay_us: Target duration of one replay.
        max_repeat: Cap on the calls per replay.
        min_calls: Fewest calls while one call is shorter than ``min_replay_us``.
        min_piece_us: Shortest piece to repeat.
        pieces: Build long replays from repeated pieces.
        estimate_us: A rough upper bound on one call's time (for example from timed warm-up
            calls), or ``None``. A call estimated at ``2 * min_replay_us`` or more starts at
            ``repeat`` calls instead of ``min_calls``.
        hint_us: A guess of one call's time, or ``None``: the first capture holds the calls
            that would last ``min_piece_us`` (with pieces) or ``min_replay_us`` (without) at the
            smaller of this guess and ``estimate_us``. With no ``estimate_us``, a guess of
            ``2 * min_replay_us`` or more starts at ``repeat`` calls, as such an estimate does.
    """

    def __init__(
        self,
        repeat: int,
        *,
        min_replay_us: float,
        max_repeat: int,
        min_calls: int,
        min_piece_us: float,
        pieces: bool,
        estimate_us: float | None = None,
        hint_us: float | None = None,
    ) -> None:
        self.repeat = repeat
        self.min_replay_us = min_replay_us
        # Every count of calls is a whole number of ``repeat`` calls (a cold-L2 walk through the
        # input copies stays in rotation across replays), the cap included.
        self.max_repeat = max(repeat, max_repeat // repeat * repeat)
        self.min_calls = min_calls
        self.min_piece_us = min_piece_us
        self.pieces = pieces
        known_us = estimate_us if estimate_us is not None else hint_us
        long_call = known_us is not None and known_us >= 2.0 * min_replay_us
        #: Calls in the captured graph (the piece, with pieces).
        self.calls = repeat if long_call else self._whole(min_calls)
        if hint_us is not None and hint_us > 0 and not long_call:
            guess = hint_us if estimate_us is None else min(hint_us, estimate_us)
            target = min_piece_us if pieces else min_replay_us
            wanted = auto_repeat_calls(
                self.calls, self.calls * guess, min_replay_us=target, max_repeat=self.max_repeat
            )
            self.calls = self._whole(wanted)
        #: Copies of the piece per replay (1: the captured graph alone).
        self.copies = 1
        #: One call's time by the last probe, in µs (``None`` before the first probe).
        self.per_call_us: float | None = None
        self._piece_grown = False

    def _whole(self, calls: int) -> int:
        """``calls`` rounded up to whole ``repeat`` calls, at least one and at most the cap."""
        return min(self.max_repeat, max(1, -(-calls // self.repeat)) * self.repeat)

    @property
    def total(self) -> int:
        """Calls per replay."""
        return self.calls * self.copies

    @property
    def expected_replay_us(self) -> float | None:
        """A replay's time as the last probe predicts it for the current plan, or ``None``. A
        probe over fewer calls spreads the replay's fixed cost over them, so this is a little
        high for a plan that grew since."""
        return None if self.per_call_us is None else self.per_call_us * self.total

    def next(self, probe_us: float) -> Step | None:
        """Revises the plan after a probe replay of the current graph lasted ``probe_us``;
        returns what to build next, or ``None`` to keep the current graph."""
        per_call_us = self.per_call_us = probe_us / self.total
        if per_call_us >= self.min_replay_us:  # one call alone is a long enough replay
            if self.copies == 1 and self.calls > self.repeat:
                self.calls = self.repeat
                return Step.CAPTURE
            return None
        if probe_us >= self.min_replay_us or self.total >= self.max_repeat:
            return None
        if self.pieces and self.copies == 1 and not self._piece_grown:
            short = probe_us < self.min_piece_us or self.calls < self.min_calls
            if short:
                self._piece_grown = True  # once: a second estimate would gain little
                wanted = auto_repeat_calls(
                    self.calls,
                    probe_us,
                    min_replay_us=self.min_piece_us,
                    max_repeat=self.max_repeat,
                )
                wanted = self._whole(max(wanted, self.min_calls))
                if wanted > self.calls:
                    self.calls = wanted
                    return Step.CAPTURE
        if self.pieces:
            wanted = auto_repeat_calls(
                self.copies,
                probe_us,
                min_replay_us=self.min_replay_us,
                max_repeat=max(1, self.max_repeat // self.calls),
            )
            if wanted <= self.copies:
                return None
            self.copies = wanted
            return Step.REPEAT
        wanted = self._whole(
            max(
                self.min_calls,
                auto_repeat_calls(
                    self.total,
                    probe_us,
                    min_replay_us=self.min_replay_us,
                    max_repeat=self.max_repeat,
                ),
            )
        )
        if wanted <= self.total:
            return None
        self.calls, self.copies = wanted, 1
        return Step.CAPTURE

    def without_pieces(self) -> Step:
        """The copies of the last :attr:`Step.REPEAT` could not be built: capture that many calls
        instead (and no pieces from now on)."""
        self.pieces = False
        self.calls, self.copies = min(self.max_repeat, self.total), 1
        return Step.CAPTURE
