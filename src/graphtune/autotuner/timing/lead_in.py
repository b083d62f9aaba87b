"""A lead-in for the graph timer: time each call right after a small, different kernel.

Why: :class:`~graphtune.autotuner.timing.graph.GraphTimer` times a candidate as a chain of
back-to-back calls of itself. With programmatic dependent launch (PDL) a call's start overlaps
the tail of the kernel before it, and how much depends on what that kernel is. In a chain the
predecessor is the candidate itself; in the decode step it is another kernel (an RMSNorm, say).
On an H100 a tiled split-K GEMM read 2% faster than split-K 1 in such a chain but cost 23% more
after a different PDL kernel (6.66 vs 5.42 us; ``benchmarks/results/README.md``, "Session 56"),
so the tuner could pick a tactic that is slower in the step.

With ``GraphTimer(lead_in=launch)`` every call the timer runs or captures (warm-up included) is
``launch(); fn(i)``, and the lead-in's own per-call time is subtracted from every per-call
sample. That time is measured once per device and cached on the timer: the same procedure on a
chain of ``launch()`` calls alone, at least ``MIN_LEAD_IN_REPLAY_US`` per replay.

Caveat: the subtraction assumes the lead-in costs the same beside the candidate as in its own
chain. Under PDL the two overlap, so the difference is "the candidate's cost after this kernel",
not its kernel time. A sample the subtraction would leave at or below zero is clamped to
``FLOOR_US`` (and logged at debug): it can only come from noise or an overlap the assumption does
not hold for, and a positive floor keeps every :class:`Measurement` valid for the tuner.

Experimental and off by default: not yet measured against in-step truths on a GPU.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch

from graphtune.autotuner.timing.base import TimedFn
from graphtune.errors import ConfigError

logger = logging.getLogger(__name__)

#: A :class:`~graphtune.autotuner.timing.graph.GraphTimer` (not imported: graph.py imports this).
GraphTimer = Any

#: Shortest replay the lead-in's own chain is timed with (event resolution, launch cost).
MIN_LEAD_IN_REPLAY_US = 100.0
#: Smallest per-call sample left after the subtraction, in microseconds.
FLOOR_US = 0.01


class LeadIn:
    """A zero-argument ``launch`` that enqueues a small kernel, and its per-device own time.

    Raises:
        ConfigError: ``launch`` is not callable.
    """

    def __init__(self, launch: Callable[[], object]) -> None:
        if not callable(launch):
            raise ConfigError(
                f"GraphTimer: lead_in must be a zero-argument callable that launches a small "
                f"kernel on the current stream, got {type(launch).__name__}"
            )
        self.launch = launch
        self._us: dict[int, float] = {}

    def wrap(self, fn: TimedFn) -> TimedFn:
        """``fn`` with the lead-in launched before every call."""
        launch = self.launch

        def call(i: int) -> object:
            launch()
            return fn(i)

        return call

    def own_us(self, timer: GraphTimer, device: torch.device, warmup: int) -> float:
        """The lead-in's per-call time on ``device``, measured once by a copy of ``timer``
        without a lead-in (so it never recurses), sized to at least
        :data:`MIN_LEAD_IN_REPLAY_US` per replay."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        found = self._us.get(index)
        if found is None:
            bare = copy.copy(timer)
            bare.lead_in, bare.lead_in_state = None, None
            bare.auto_repeat = True  # a 1-call replay would be shorter than the events resolve
            bare.min_replay_us = max(timer.min_replay_us, MIN_LEAD_IN_REPLAY_US)
            launch = self.launch
            found = bare.measure(lambda i: launch(), warmup=warmup, repeat=1).median_us
            self._us[index] = found
            logger.debug("GraphTimer: lead-in %.3f us per call on device %d", found, index)
        return found


def prepare(
    timer: GraphTimer, fn: TimedFn, device: torch.device, warmup: int, hint_us: float | None
) -> tuple[TimedFn, float | None]:
    """``fn`` and ``hint_us`` as ``timer`` captures them: unchanged without a lead-in, else
    ``fn`` wrapped (:meth:`LeadIn.wrap`) and the hint of one call grown by the lead-in's time
    (the hint is a corrected time; the wrapped call lasts about that much longer)."""
    lead = timer.lead_in_state
    if lead is None:
        return fn, hint_us
    lead_us = lead.own_us(timer, device, max(1, warmup))
    return lead.wrap(fn), None if hint_us is None else hint_us + lead_us


def corrected(timer: GraphTimer, device: torch.device, per_call_us: list[float]) -> list[float]:
    """``per_call_us`` less the lead-in's per-call time on ``device`` (cached by the session's
    :func:`prepare`), each clamped to :data:`FLOOR_US`; unchanged without a lead-in."""
    lead = timer.lead_in_state
    if lead is None:
        return per_call_us
    lead_us = lead.own_us(timer, device, 1)
    out = [max(us - lead_us, FLOOR_US) for us in per_call_us]
    clamped = sum(us - lead_us < FLOOR_US for us in per_call_us)
    if clamped:
        logger.debug(
            "GraphTimer: %d of %d samples at or below the lead-in's %.3f us; clamped to %s us",
            clamped,
            len(out),
            lead_us,
            FLOOR_US,
        )
    return out
