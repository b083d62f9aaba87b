"""Event timer: CUDA events around back-to-back calls issued behind a sized GPU delay kernel.

Why the delay: events time from when the *GPU* reaches the start event. With an idle GPU that
is the moment the host records it, and every microsecond the host then spends launching the calls
is read as kernel time (on an H200, a 9 µs GEMM reads 18 µs). A spin kernel in front of the start
event keeps the GPU busy while the host enqueues the whole batch, so the GPU then runs the calls
back to back. The spin must outlast the host's enqueue of that batch, so its length is sized from
the measured host enqueue time of the same batch (a fixed spin under-covers slow launches).

Each sample is checked: the host time from enqueuing the delay to enqueuing the end event must be
shorter than the delay the GPU actually spent (measured by an extra event in front of it). The
delay kernel cannot start before the host enqueued it, so if that holds the whole batch was
queued before the GPU reached the start event. A sample that fails the check is discarded and the
delay doubled (a bounded number of times); see :class:`EventTimer`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator

import torch

from graphtune.autotuner.timing._checks import (
    check_counts,
    check_int,
    check_number,
    require_cuda,
)
from graphtune.autotuner.timing.base import Measurement, TimedFn
from graphtune.autotuner.timing.delay import GpuDelay, delay_us_for_host_time

logger = logging.getLogger(__name__)


class EventTimer:
    """Times ``repeat`` back-to-back calls between two CUDA events, behind a sized delay kernel.

    Procedure of :meth:`measure`, on the current stream of the device:

    1. ``max(1, warmup)`` untimed calls, then synchronize.
    2. Host enqueue time of one batch of ``repeat`` calls is measured on the host clock while the
       GPU is idle; the delay is ``host * margin + floor_us`` (see
       :func:`~graphtune.autotuner.timing.delay.delay_us_for_host_time`).
    3. ``samples`` times: event, delay kernel, start event, ``repeat`` calls, end event,
       synchronize. Per call = (end - start) / repeat. A sample whose host enqueue outlasted the
       delay the GPU spent is discarded and the delay doubled, up to ``max_retries`` times per
       measurement; after that such samples are kept and one warning is logged (this happens
       when ``fn`` synchronizes with the host, which no delay can hide).

    With ``delay=False`` the timer is the naive reference: each sample starts from an idle GPU and
    includes host launch cost (useful to show what the delay buys; not for tuning).

    Keep ``repeat`` times the kernels per call well below the driver's launch-queue depth (about a
    thousand): a host blocked on a full queue cannot run ahead of the GPU.

    Args:
        samples: Number of timed batches; the median is reported.
        delay: Put a sized delay kernel in front of each sample (the point of this timer).
        margin: Multiplier on the measured host enqueue time.
        floor_us: Microseconds added to every delay.
        max_delay_us: Upper bound of one delay.
        max_retries: Times per measurement that an uncovered sample is re-run with a doubled delay.
        device: CUDA device (default: the current device).
        host_clock: Host clock in seconds (injectable for tests).
    """

    name = "events"

    def __init__(
        self,
        *,
        samples: int = 10,
        delay: bool = True,
        margin: float = 1.5,
        floor_us: float = 20.0,
        max_delay_us: float = 100_000.0,
        max_retries: int = 3,
        device: torch.device | str | int | None = None,
        host_clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        check_int("EventTimer", "samples", samples, minimum=1, default=10)
        check_int("EventTimer", "max_retries", max_retries, minimum=0, default=3)
        # nan passes every comparison and would size a nan delay kernel at the first sample.
        check_number("EventTimer", "margin", margin, above=1, inclusive=True, default=1.5)
        check_number("EventTimer", "floor_us", floor_us, above=0, inclusive=True, default=20.0)
        check_number("EventTimer", "max_delay_us", max_delay_us, above=0, default=100_000.0)
        self.samples = samples
        self.delay = delay
        self.margin = margin
        self.floor_us = floor_us
        self.max_delay_us = max_delay_us
        self.max_retries = max_retries
        self.device = device
        self.host_clock = host_clock
        #: Statistics of the last measurement (delay used, samples discarded, uncovered kept).
        self.last_info: dict[str, float] = {}

    def measure(self, fn: TimedFn, *, warmup: int, repeat: int) -> Measurement:
        """Times ``fn``; see the class docstring for the procedure.

        Raises:
            ConfigError: Without CUDA, or for invalid ``warmup``/``repeat``.
        """
        check_counts("EventTimer", warmup=warmup, repeat=repeat)
        device = require_cuda("EventTimer", self.device)
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            counter = itertools.count()
            for _ in range(max(1, warmup)):
                fn(next(counter))
            stream.synchronize()
            if self.delay:
                per_call = self._measure_delayed(fn, counter, repeat, stream, device)
            else:
                per_call = [
                    self._plain_sample(fn, counter, repeat, stream) for _ in range(self.samples)
                ]
        return Measurement.from_samples(per_call, calls_per_sample=repeat, timer=self.name)

    def _plain_sample(
        self, fn: TimedFn, counter: Iterator[int], repeat: int, stream: torch.cuda.Stream
    ) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(repeat):
            fn(next(counter))
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) * 1000.0 / repeat

    def _measure_delayed(
        self,
        fn: TimedFn,
        counter: Iterator[int],
        repeat: int,
        stream: torch.cuda.Stream,
        device: torch.device,
    ) -> list[float]:
        gpu_delay = GpuDelay(device)
        gpu_delay.cycles_per_us()  # calibrate now, outside any timed region
        # Host enqueue cost of one batch, measured with an idle GPU (nothing to wait for).
        begin = self.host_clock()
        for _ in range(repeat):
            fn(next(counter))
        host_us = (self.host_clock() - begin) * 1e6
        stream.synchronize()
        delay_us = self._delay_for(host_us)

        per_call: list[float] = []
        retries = 0
        discarded = 0
        uncovered_kept = 0
        while len(per_call) < self.samples:
            value, sample_host_us, spent_delay_us = self._delayed_sample(
                fn, counter, repeat, stream, gpu_delay, delay_us
            )
            if sample_host_us <= spent_delay_us:
                per_call.append(value)
                continue
            if retries < self.max_retries and delay_us < self.max_delay_us:
                retries += 1
                discarded += 1
                wanted_us = max(2 * delay_us, self._delay_for(sample_host_us))
                delay_us = min(self.max_delay_us, wanted_us)
                logger.debug(
                    "EventTimer: host enqueue %.1f us outlasted the %.1f us delay; retrying with "
                    "%.1f us",
                    sample_host_us,
                    spent_delay_us,
                    delay_us,
                )
                continue
            uncovered_kept += 1
            per_call.append(value)
        if uncovered_kept:
            logger.warning(
                "EventTimer: %d of %d samples were not covered by the delay kernel even at %.0f "
                "us (does the timed function synchronize with the host?); those samples include "
                "host launch time",
                uncovered_kept,
                self.samples,
                delay_us,
            )
        self.last_info = {
            "initial_host_us": host_us,
            "delay_us": delay_us,
            "discarded": float(discarded),
            "uncovered_kept": float(uncovered_kept),
        }
        return per_call

    def _delay_for(self, host_us: float) -> float:
        return delay_us_for_host_time(
            host_us, margin=self.margin, floor_us=self.floor_us, cap_us=self.max_delay_us
        )

    def _delayed_sample(
        self,
        fn: TimedFn,
        counter: Iterator[int],
        repeat: int,
        stream: torch.cuda.Stream,
        gpu_delay: GpuDelay,
        delay_us: float,
    ) -> tuple[float, float, float]:
        """One sample from an idle GPU: returns (per-call µs, host enqueue µs, delay spent µs)."""
        before = torch.cuda.Event(enable_timing=True)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin = self.host_clock()
        before.record(stream)
        gpu_delay.enqueue(delay_us)
        start.record(stream)
        for _ in range(repeat):
            fn(next(counter))
        end.record(stream)
        host_us = (self.host_clock() - begin) * 1e6
        end.synchronize()
        spent_delay_us = before.elapsed_time(start) * 1000.0
        return start.elapsed_time(end) * 1000.0 / repeat, host_us, spent_delay_us
