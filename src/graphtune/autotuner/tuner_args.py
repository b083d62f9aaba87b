"""Checks of what :class:`~graphtune.autotuner.tuner.AutoTuner` is given (its timer, a pin),
made up front: each value here ends up in a cache file, where a bad one costs more than the call
that brought it (a load rejects the whole file, or a save drops the pick)."""

from __future__ import annotations

import json
import math
from typing import Any

from graphtune.autotuner.calls import OpCall
from graphtune.autotuner.entries import COLD_L2_SUFFIX
from graphtune.autotuner.timing.base import Timer
from graphtune.autotuner.values import encode_value
from graphtune.errors import ConfigError


def check_timer(timer: Any) -> None:
    """Raises :class:`ConfigError` unless ``timer`` is ``None`` or a :class:`Timer` whose
    ``name`` is a non-empty str not ending in ``+cold_l2``: the name is the ``timing`` field of
    every key it tunes (``+cold_l2`` added for cold-L2 tuning), and a key whose ``timing`` is not
    a string makes a load reject the whole file holding it."""
    if timer is None:
        return
    if not isinstance(timer, Timer):
        raise ConfigError(
            f"AutoTuner(timer={timer!r}): a timer needs a `name` and "
            "`measure(fn, *, warmup, repeat) -> Measurement` (see graphtune.autotuner.timing)."
        )
    name = timer.name
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"AutoTuner(timer={timer!r}): the timer's name is {name!r}, not a non-empty str; it "
            "is stored as the cache keys' 'timing' text, so give the timer class a name such as "
            "name = 'mytimer'."
        )
    if name.endswith(COLD_L2_SUFFIX):
        raise ConfigError(
            f"AutoTuner(timer={timer!r}): the timer's name {name!r} ends in {COLD_L2_SUFFIX!r}, "
            "which the cache keys' 'timing' text adds for cold-L2 tuning (TuningConfig.cold_l2), "
            "so its warm-L2 picks would read as cold-L2 picks of another timer; rename it."
        )


def check_pin(call: OpCall, runner_index: Any, tactic: Any, time_us: Any) -> None:
    """Raises :class:`ConfigError` unless ``AutoTuner.pin(call, runner_index, tactic,
    time_us=...)`` makes a pick a cache file keeps: an int index of one of ``call.runners``, a
    tactic :func:`~graphtune.autotuner.values.encode_value` stores, and ``time_us`` ``None`` or
    a finite number > 0 (a load drops any other time, so the pick would be served only until
    the file is read again)."""
    count = len(call.runners)
    if isinstance(runner_index, bool) or not isinstance(runner_index, int):
        raise ConfigError(
            f"pin: runner_index {runner_index!r} of op {call.op!r} is not an int; pass an index "
            f"into call.runners (0 to {count - 1})"
        )
    if not 0 <= runner_index < count:
        raise ConfigError(
            f"pin: runner_index {runner_index} is not one of the {count} runners of op "
            f"{call.op!r}; pass an index into call.runners"
        )
    if time_us is not None and (
        isinstance(time_us, bool)
        or not isinstance(time_us, (int, float))
        or not (math.isfinite(time_us) and time_us > 0)
    ):
        raise ConfigError(
            f"pin: time_us {time_us!r} for op {call.op!r} is not a finite number > 0; pass the "
            "measured time in microseconds, or None when it was not timed"
        )
    try:
        json.dumps(encode_value(tactic), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConfigError(
            f"pin: tactic {tactic!r} of op {call.op!r} cannot be stored in a cache file ({exc})"
        ) from None
