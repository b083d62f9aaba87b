"""The timers and the tactic worker process a tuner keeps between its tuning runs, and the
executor each run times its candidates with (:mod:`graphtune.autotuner.isolation`)."""

from __future__ import annotations

import torch

from graphtune.autotuner import timing
from graphtune.autotuner.config import TuningConfig
from graphtune.autotuner.isolation import Executor, InProcessExecutor, Isolation
from graphtune.autotuner.timing.base import Timer
from graphtune.autotuner.worker import SubprocessExecutor


class TuningExecutors:
    """One timer per (timing mode, device) and at most one tactic worker, reused across runs.

    Attributes:
        worker: The worker process of subprocess isolation, or ``None`` (none started, or
            :meth:`close` stopped it).
    """

    def __init__(self) -> None:
        self._timers: dict[tuple[str, str], Timer] = {}
        self.worker: SubprocessExecutor | None = None

    def timer_for(self, timer: Timer | None, config: TuningConfig, device: torch.device) -> Timer:
        """``timer`` when given, else the one ``config.timing`` names for ``device``."""
        if timer is not None:
            return timer
        slot = (config.timing, str(device))
        if slot not in self._timers:
            self._timers[slot] = timing.resolve_timer(config.timing, device)
        return self._timers[slot]

    def executor(
        self,
        timer: Timer | None,
        isolation: Isolation,
        session_bytes: int,
        config: TuningConfig,
        device: torch.device,
    ) -> Executor:
        """In-process timing with :meth:`timer_for`, or the worker for ``config.timing`` on
        ``device`` (the previous worker is stopped when it was started for another)."""
        if isolation.mode == "inprocess":
            chosen = self.timer_for(timer, config, device)
            return InProcessExecutor(chosen, device, session_bytes=session_bytes)
        worker = self.worker
        if worker is None or worker.key != (config.timing, str(device)):
            self.close()
            worker = SubprocessExecutor(isolation, timer, config.timing, device)
            self.worker = worker
        return worker

    def close(self) -> None:
        """Stops the worker process, if any."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
