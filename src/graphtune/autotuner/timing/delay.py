"""A GPU delay kernel that keeps the host ahead of the GPU while a timed region is enqueued.

Event timing measures from the moment the GPU reaches the start event. If the GPU is idle when the
host records that event, every microsecond the host then spends launching the timed calls is
counted as kernel time: a 9 µs GEMM reads as 18 µs. Putting a kernel that just spins in front of
the start event hides that cost, provided the spin lasts longer than the host needs to enqueue the
whole timed batch. A *fixed* spin does not: it under-covers slow launches and inflates small
kernels about 3x. So the delay is sized from the measured host enqueue time (see
:func:`delay_us_for_host_time`), and :class:`GpuDelay` converts microseconds into the cycles
``torch.cuda._sleep`` spins for, calibrated once per device against CUDA events.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading

import torch

logger = logging.getLogger(__name__)

# Sleep-kernel speed per device index, in spin cycles per microsecond. Calibrated once per
# process: the SM clock the spin counts does not change meaningfully between calls, and the
# calibration itself costs a few milliseconds of GPU time.
_CYCLES_PER_US: dict[int, float] = {}
_CALIBRATION_LOCK = threading.Lock()

# Plausible SM clocks (cycles per µs = MHz). A calibration outside this range means the events
# did not time the spin (for example a driver that ignores it), and a fallback is used instead.
_MIN_PLAUSIBLE_MHZ = 100.0
_MAX_PLAUSIBLE_MHZ = 10_000.0
# Used only when neither calibration nor the device's reported clock is usable. Deliberately on
# the high side of current parts: overestimating the clock makes delays longer than asked, which
# only costs GPU time, never accuracy.
_FALLBACK_MHZ = 2_500.0


def delay_us_for_host_time(
    host_us: float,
    *,
    margin: float = 1.5,
    floor_us: float = 20.0,
    cap_us: float = 100_000.0,
) -> float:
    """Returns a delay long enough to cover ``host_us`` of host enqueue work.

    The delay is ``host_us * margin + floor_us`` capped at ``cap_us``. The margin absorbs host
    jitter (an interrupt, a page fault) and clock changes between calibration and use; the floor
    covers recording the events themselves and the launch latency of the delay kernel.

    Args:
        host_us: Measured host time to enqueue the timed batch, in microseconds.
        margin: Multiplier on the measured time (>= 1).
        floor_us: Constant added on top, in microseconds (>= 0).
        cap_us: Upper bound, so a function that secretly synchronizes cannot ask for an unbounded
            spin.

    Returns:
        The delay in microseconds.

    Raises:
        ValueError: If an argument is negative, not finite, or ``margin < 1``.
    """
    if not math.isfinite(host_us) or host_us < 0:
        raise ValueError(f"host_us must be a finite number >= 0, got {host_us!r}")
    if margin < 1 or floor_us < 0 or cap_us <= 0:
        raise ValueError(
            f"need margin >= 1, floor_us >= 0, cap_us > 0; got {margin}, {floor_us}, {cap_us}"
        )
    return min(cap_us, host_us * margin + floor_us)


def host_lead_us(count: int, host_us_per_replay: float, replay_us: float | None) -> float:
    """How far the host must be ahead of the GPU before ``count`` timed replays are enqueued.

    The host enqueues replay ``k`` by ``k * host_us_per_replay``; behind a delay of ``D`` the GPU
    starts it at ``D + (k - 1) * replay_us``. No replay waits for its launch when
    ``D >= k * host_us_per_replay - (k - 1) * replay_us`` for every ``k``: the first replay's
    enqueue when a replay lasts longer than its launch (the usual case: a 100 µs replay and a
    launch of tens of microseconds), and the whole batch's enqueue when ``replay_us`` is unknown.
    """
    whole = count * host_us_per_replay
    if replay_us is None:
        return whole
    return max(host_us_per_replay, whole - (count - 1) * replay_us)


class GpuDelay:
    """Enqueues a kernel that keeps one CUDA device busy for about a requested time.

    Uses ``torch.cuda._sleep(cycles)`` (a one-thread kernel spinning on the SM clock; present in
    every torch 2.x CUDA build). The number of cycles per microsecond is calibrated once per
    device against CUDA events rather than taken from ``get_device_properties().clock_rate``: that
    attribute is missing in some torch versions and reports the maximum clock, not the one the
    spin runs at. Should ``_sleep`` be missing, a memory-bound filler kernel repeated enough times
    is used instead.

    Args:
        device: The CUDA device (default: the current one).
        calibration_cycles: Length of each calibration spin (about 0.5 ms at 2 GHz: long enough
            that event resolution and launch latency are below 1%).
    """

    def __init__(
        self, device: torch.device | int | None = None, *, calibration_cycles: int = 1_000_000
    ) -> None:
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else device
        self.index = self.device.index if self.device.index is not None else 0
        self._calibration_cycles = calibration_cycles
        self._filler: _FillerDelay | None = None

    @property
    def uses_sleep(self) -> bool:
        """Whether the spin kernel ``torch.cuda._sleep`` is available (else a filler is used)."""
        return hasattr(torch.cuda, "_sleep")

    def cycles_per_us(self) -> float:
        """Spin cycles per microsecond on this device (calibrated on first use, then cached)."""
        with _CALIBRATION_LOCK:
            rate = _CYCLES_PER_US.get(self.index)
            if rate is None:
                rate = self._calibrate()
                _CYCLES_PER_US[self.index] = rate
        return rate

    def enqueue(self, us: float) -> None:
        """Enqueues about ``us`` microseconds of GPU work on the current stream.

        Returns as soon as the work is enqueued (it does not wait for the GPU).
        """
        if us <= 0:
            return
        if self.uses_sleep:
            torch.cuda._sleep(max(1, int(math.ceil(us * self.cycles_per_us()))))
            return
        if self._filler is None:
            self._filler = _FillerDelay(self.device)
        self._filler.enqueue(us)

    def _calibrate(self) -> float:
        if not self.uses_sleep:
            return 0.0
        cycles = self._calibration_cycles
        rates: list[float] = []
        with torch.cuda.device(self.device):
            torch.cuda._sleep(1_000)  # first launch loads the kernel; keep it out of the timing
            for _ in range(3):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                # A short lead spin keeps the GPU busy while the host records the start event and
                # launches the timed spin, so launch latency is not mistaken for spin time.
                torch.cuda._sleep(cycles // 10)
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
                elapsed_us = start.elapsed_time(end) * 1000.0
                if elapsed_us > 0:
                    rates.append(cycles / elapsed_us)
        rate = statistics.median(rates) if rates else 0.0
        if _MIN_PLAUSIBLE_MHZ <= rate <= _MAX_PLAUSIBLE_MHZ:
            logger.debug("cuda:%d sleep kernel calibrated at %.0f cycles/us", self.index, rate)
            return rate
        fallback = _reported_clock_mhz(self.index) or _FALLBACK_MHZ
        logger.warning(
            "cuda:%d: calibrating torch.cuda._sleep gave %.1f cycles/us, outside %.0f..%.0f; "
            "using %.0f cycles/us instead (delays may be off; event timing of small kernels may "
            "read high)",
            self.index,
            rate,
            _MIN_PLAUSIBLE_MHZ,
            _MAX_PLAUSIBLE_MHZ,
            fallback,
        )
        return fallback


def _reported_clock_mhz(index: int) -> float | None:
    """The device's reported SM clock in MHz, where this torch version exposes it."""
    props = torch.cuda.get_device_properties(index)
    khz = getattr(props, "clock_rate", None)  # not present in every torch release
    if isinstance(khz, (int, float)) and khz > 0:
        return float(khz) / 1000.0
    return None


class _FillerDelay:
    """Fallback delay without ``_sleep``: repeats an in-place op on a buffer larger than L2.

    Each launch costs the host a few microseconds but keeps the GPU busy for tens, so a chain of
    them still runs ahead of the host.
    """

    _BYTES = 64 * 1024 * 1024

    def __init__(self, device: torch.device) -> None:
        self._buffer = torch.ones(self._BYTES // 4, dtype=torch.float32, device=device)
        self._us_per_op = self._calibrate()

    def _calibrate(self) -> float:
        for _ in range(3):
            self._buffer.mul_(1.0)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            self._buffer.mul_(1.0)
        end.record()
        end.synchronize()
        return max(1.0, start.elapsed_time(end) * 1000.0 / 20)

    def enqueue(self, us: float) -> None:
        for _ in range(max(1, math.ceil(us / self._us_per_op))):
            self._buffer.mul_(1.0)
