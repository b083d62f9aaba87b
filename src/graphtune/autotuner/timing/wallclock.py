"""Wall-clock timer: host clock around windows of back-to-back calls.

The timer for CPU tensors. It also works for CUDA work when given a ``sync`` callable (for example
``torch.cuda.synchronize``): the clock is then read after the device has drained, so a window
covers launch plus execution of its calls. That includes host launch overhead, which is why the
graph timer is the default on CUDA.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from graphtune.autotuner.timing._checks import check_counts
from graphtune.autotuner.timing.base import Measurement, TimedFn
from graphtune.errors import ConfigError

logger = logging.getLogger(__name__)


class WallClockTimer:
    """Times windows of ``repeat`` back-to-back calls with a host clock.

    Each sample is one window: ``sync(); t0 = clock(); fn(i) ... fn(i + repeat - 1); sync();
    t1 = clock()``, giving ``(t1 - t0) / repeat`` per call. Call indices keep counting across
    warm-up and windows, so cold-L2 rotation (``i % copies``) walks through every copy.

    Args:
        samples: Number of windows; the median is reported.
        clock: Returns seconds as a float (injectable so tests can drive exact numbers).
        sync: Called before starting and before stopping the clock of each window; pass
            ``torch.cuda.synchronize`` to time CUDA work. ``None`` for CPU work.
    """

    name = "wallclock"

    def __init__(
        self,
        *,
        samples: int = 5,
        clock: Callable[[], float] = time.perf_counter,
        sync: Callable[[], object] | None = None,
    ) -> None:
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ConfigError(f"WallClockTimer: samples must be an integer >= 1, got {samples!r}")
        self.samples = samples
        self.clock = clock
        self.sync = sync

    def measure(self, fn: TimedFn, *, warmup: int, repeat: int) -> Measurement:
        """Times ``fn`` over ``samples`` windows of ``repeat`` calls after ``warmup`` calls.

        At least one warm-up call is made even when ``warmup`` is 0 (the Timer contract).

        Returns:
            The per-call summary, ``calls_per_sample == repeat``.
        """
        check_counts("WallClockTimer", warmup=warmup, repeat=repeat)
        index = 0
        for _ in range(max(1, warmup)):
            fn(index)
            index += 1
        per_call_us: list[float] = []
        for _ in range(self.samples):
            self._sync()
            start = self.clock()
            for _ in range(repeat):
                fn(index)
                index += 1
            self._sync()
            stop = self.clock()
            per_call_us.append((stop - start) * 1e6 / repeat)
        return Measurement.from_samples(per_call_us, calls_per_sample=repeat, timer=self.name)

    def _sync(self) -> None:
        if self.sync is not None:
            self.sync()
