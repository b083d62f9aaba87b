"""Where tactics run while they are timed: in this process, or in a disposable worker process.

A tactic is user code, and some tactics are broken in ways a ``try`` cannot contain: a kernel
that reads out of bounds raises a *sticky* CUDA error (illegal address, device-side assert) that
poisons the whole CUDA context of the process, a deadlocked kernel never returns, a bad extension
segfaults. Principle 5 says a failing tactic is data; these executors make that true for them too.

* :class:`InProcessExecutor` (``isolation="inprocess"``, the default) times in this process. After
  a failure it synchronizes the device to surface asynchronous errors and empties the allocator
  cache. If the context turned out to be corrupted, nothing in this process can use CUDA again,
  so the tactic is blocklisted and tuning stops with a :class:`~graphtune.errors.TuningError`
  (``autotune()`` still saves the cache, so the next run skips that tactic).
* :class:`~graphtune.autotuner.worker.SubprocessExecutor` (``isolation="subprocess"``) times in a
  worker started with the
  ``spawn`` method of ``torch.multiprocessing`` (``fork`` cannot be used once CUDA is initialised).
  The worker is reused for every tactic until one kills it (exit, signal), corrupts its context or
  exceeds ``timeout_s``; that tactic is recorded as failed and blocklisted, and the next tactic
  gets a fresh worker. Runners, synthetic inputs and a user-supplied timer are sent with
  ``pickle``, so they must be picklable (module-level classes, no lambdas, open files or locks in
  their attributes); a clear :class:`~graphtune.errors.ConfigError` says which one is not.

Both implement :class:`Executor`, the one protocol the tuner times through. See
``docs/reliability.md`` for what each mode can and cannot recover from.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from graphtune.autotuner.entries import tactic_text
from graphtune.autotuner.timing.base import SessionTimer, TimerSession
from graphtune.autotuner.timing.graph import sizes_its_samples
from graphtune.cuda_memory import reserved_bytes
from graphtune.errors import ConfigError

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("inprocess", "subprocess")

# Reasons (keys of TunerStats.tactic_failures) for failures that are not a Python exception type.
TIMEOUT = "timeout"
CRASH = "crash"
CONTEXT_CORRUPTED = "context corrupted"
INVALID_TIME = "invalid time"


@dataclass(frozen=True)
class Isolation:
    """How tactics are isolated while they are timed.

    Attributes:
        mode: ``"inprocess"`` (default) or ``"subprocess"``.
        timeout_s: Subprocess mode: the longest one ``prepare`` or one measurement of a tactic
            may take before the worker is killed and the tactic recorded as failed (``timeout``).
            Generous by default because ``prepare`` may JIT-compile.
        start_timeout_s: Subprocess mode: the longest a fresh worker may take to start (import
            torch, initialise CUDA, receive the runners and inputs).
    """

    mode: str = "inprocess"
    timeout_s: float = 60.0
    start_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if self.mode not in ISOLATION_MODES:
            raise ConfigError(
                f"isolation mode {self.mode!r} is not one of {', '.join(ISOLATION_MODES)}; use "
                "'subprocess' to survive tactics that crash or corrupt the CUDA context."
            )
        for name in ("timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            bad = isinstance(value, bool) or not isinstance(value, (int, float))
            if bad or not math.isfinite(value) or value <= 0:
                raise ConfigError(
                    f"Isolation.{name} must be a finite number of seconds > 0, got {value!r}."
                )

    @classmethod
    def resolve(cls, value: str | Isolation | None) -> Isolation:
        """Accepts a mode string, an :class:`Isolation`, or ``None`` (in-process)."""
        if value is None:
            return cls()
        if isinstance(value, Isolation):
            return value
        if isinstance(value, str):
            return cls(mode=value)
        raise ConfigError(
            f"isolation={value!r}: pass 'inprocess', 'subprocess' or an Isolation(...) object."
        )


class TacticFailure(Exception):
    """One (runner, tactic) failed; raised by executors, turned into data by the tuner.

    Attributes:
        reason: Counted in ``TunerStats.tactic_failures``: an exception type name, or one of
            ``timeout``, ``crash``, ``context corrupted``, ``invalid time``.
        detail: Human-readable detail.
        block: Whether the tactic belongs on the blocklist (it crashed, hung or broke the context,
            as opposed to e.g. refusing a shape, which is harmless and shape-specific).
        fatal: The current process cannot time anything else (in-process context corruption).
    """

    def __init__(self, reason: str, detail: str, *, block: bool = False, fatal: bool = False):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.block = block
        self.fatal = fatal


def check_time(value: Any) -> float:
    """Returns a usable per-call time, or raises :class:`TacticFailure` (``invalid time``).

    NaN, infinities, negative numbers and zero are rejected: a zero or negative time would win
    every comparison, and a NaN would make the ordering of candidates meaningless.
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TacticFailure(INVALID_TIME, f"timer returned {value!r}, not a number") from None
    if not math.isfinite(number) or number <= 0.0:
        raise TacticFailure(INVALID_TIME, f"timer returned {number} us (must be finite and > 0)")
    return number


def _median_us(result: Any) -> float:
    try:
        return check_time(result.median_us)
    except AttributeError:
        raise TacticFailure(
            INVALID_TIME, f"timer returned {type(result).__name__}, not a Measurement"
        ) from None


def context_error(device: torch.device) -> str | None:
    """Synchronizes ``device`` and returns the error text if its CUDA context is unusable.

    Asynchronous CUDA errors surface at the next synchronisation; a sticky one (illegal address,
    device-side assert, misaligned address) then fails every later CUDA call of this process.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        torch.cuda.synchronize(device)
    except RuntimeError as exc:  # torch.AcceleratorError derives from RuntimeError
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if "capturing" in text:
            # A capture left open (not a sticky error): the capture is invalidated, the
            # context is fine. The timers end their captures on errors, so this is rare.
            logger.debug("synchronize after a failed tactic met an open capture: %s", text)
            return None
        return f"{type(exc).__name__}: {text}"
    return None


def recover_in_process(device: torch.device) -> str | None:
    """Clears what can be cleared after a failed tactic; returns the error if the context broke.

    Drops cycles that pin the failed call's tensors (``gc.collect``) and returns cached blocks to
    the driver (``torch.cuda.empty_cache``). Cannot undo a sticky CUDA error.
    """
    broken = context_error(device)
    gc.collect()
    if broken is None and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return broken


class Executor(Protocol):
    """Where the tuner's ``prepare`` and timer calls run (in-process or in a worker process).

    Every method that runs a tactic raises :class:`TacticFailure` for the tactic's own failure;
    the tuner turns that into data. A profile is timed between :meth:`begin` and :meth:`end`.

    Attributes:
        starts: Worker processes started so far (0 in-process).
        sizes_samples: Its timer chooses the calls of a sample itself
            (:func:`~graphtune.autotuner.timing.sizes_its_samples`), so ``repeat`` is a floor.
    """

    starts: int
    sizes_samples: bool

    def begin(
        self,
        runners: list[Any],
        sets: list[list[Any]],
        *,
        rotate_in_call: bool = True,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Sets the runners, input sets and ``forward`` keyword arguments of the next profile.

        Args:
            runners: The op's runners.
            sets: Input sets (lists of ``forward`` inputs).
            rotate_in_call: Every measurement walks through all sets, call by call (cold-L2
                copies); otherwise measurement ``sample`` times set ``sample % len(sets)`` only.
            kwargs: Keyword arguments of every ``forward`` call (``choose_one``'s).
        """
        ...

    def prepare_all(self, runner: Any, work: Sequence[tuple[list[Any], Sequence[Any]]]) -> None:
        """Runs ``runner.prepare_all(work)`` where the tactics will be timed (untimed)."""
        ...

    def prepare(self, runner_index: int, runner: Any, tactic: Any) -> None:
        """Runs ``runner.prepare`` on the first input set (untimed)."""
        ...

    def measure(
        self,
        runner_index: int,
        runner: Any,
        tactic: Any,
        *,
        warmup: int,
        repeat: int,
        sample: int = 0,
        tactic_index: int | None = None,
    ) -> float:
        """Times one tactic (its ``sample``-th measurement); returns microseconds per call.
        ``tactic_index``: the candidate's position among its runner's tactics (the tuner passes
        it), which tells apart tactics whose texts are alike (``(64, 2)`` and ``[64, 2]``)."""
        ...

    def end(self) -> None:
        """The profile is done: releases what its measurements held (timer sessions)."""
        ...

    def close(self) -> None:
        """Releases everything (a worker process)."""
        ...


def _reserved_bytes(device: torch.device) -> Callable[[], int]:
    if device.type == "cuda" and torch.cuda.is_available():
        return lambda: reserved_bytes(device)  # read around every measurement: the cheap way
    return lambda: 0


class InProcessExecutor:
    """Runs ``prepare`` and the timer in this process.

    With a :class:`~graphtune.autotuner.timing.base.SessionTimer` (the graph timer) each
    candidate's session (its captured graph) is opened on its first measurement and reused by
    the later ones until :meth:`end`, while the sessions' device memory stays within
    ``session_bytes``.

    Args:
        timer: The timer to measure with.
        device: Device of the inputs (what to synchronize after a failure).
        session_bytes: Device memory open sessions may hold together (``TuningPolicy``'s); 0
            closes every session after its measurement.
        reserved_bytes: Returns the device memory the allocator holds (a seam for tests); the
            default reads ``torch.cuda.memory_reserved`` (0 on the CPU).
    """

    def __init__(
        self,
        timer: Any,
        device: torch.device,
        *,
        session_bytes: int = 8 << 30,
        reserved_bytes: Callable[[], int] | None = None,
    ) -> None:
        self.timer = timer
        self.device = device
        self.sizes_samples = sizes_its_samples(timer)
        self.session_bytes = session_bytes
        self._reserved = reserved_bytes or _reserved_bytes(device)
        self._sets: list[list[Any]] = []
        self._rotate_in_call = True
        self._kwargs: dict[str, Any] = {}
        self._sessions: dict[tuple[int, int | str, int], TimerSession] = {}
        self._held = 0
        # The fastest time per call measured in this profile: the timer's guess for sizing the
        # next candidate's first capture (candidates of one bucket take similar times).
        self._fastest_us: float | None = None
        self.starts = 0
        #: Sessions opened and measurements made through them (how much set-up was saved).
        self.sessions_opened = 0
        self.session_measurements = 0

    def begin(
        self,
        runners: list[Any],
        sets: list[list[Any]],
        *,
        rotate_in_call: bool = True,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        """See :meth:`Executor.begin`."""
        self.end()
        self._fastest_us = None
        self._sets = sets
        self._rotate_in_call = rotate_in_call
        self._kwargs = dict(kwargs or {})

    def prepare_all(self, runner: Any, work: Sequence[tuple[list[Any], Sequence[Any]]]) -> None:
        """Runs ``runner.prepare_all``; raises :class:`TacticFailure`."""
        try:
            runner.prepare_all(work)
        except Exception as exc:  # the runner's own error: data, after cleaning up
            raise self._failure(exc) from None

    def prepare(self, runner_index: int, runner: Any, tactic: Any) -> None:
        """Runs ``runner.prepare`` (untimed); raises :class:`TacticFailure`."""
        try:
            runner.prepare(self._sets[0], tactic)
        except Exception as exc:  # the tactic's own error: data, after cleaning up
            raise self._failure(exc) from None

    def measure(
        self,
        runner_index: int,
        runner: Any,
        tactic: Any,
        *,
        warmup: int,
        repeat: int,
        sample: int = 0,
        tactic_index: int | None = None,
    ) -> float:
        """Times one tactic (its ``sample``-th measurement); returns microseconds per call or
        raises :class:`TacticFailure`. A timer session is kept per candidate: per
        ``(runner_index, tactic_index)`` (per tactic text when no ``tactic_index`` is given)."""
        sets = sets_for_sample(self._sets, self._rotate_in_call, sample)
        n = len(sets)
        kwargs = self._kwargs

        def call(i: int) -> object:
            return runner.forward(sets[i % n], tactic=tactic, **kwargs)

        distinct = not self._rotate_in_call and len(self._sets) > 1
        which: int | str = tactic_text(tactic) if tactic_index is None else tactic_index
        slot = (runner_index, which, sample % len(self._sets) if distinct else 0)
        try:
            if not isinstance(self.timer, SessionTimer):
                result = self.timer.measure(call, warmup=warmup, repeat=repeat)
                return _median_us(result)
            session = self._sessions.get(slot)
            if session is None:
                session = self._open(slot, call, warmup, repeat)
            else:
                self.session_measurements += 1
            try:
                result = session.measure()
            finally:
                if slot not in self._sessions:  # over the memory budget: not kept
                    session.close()
        except TacticFailure:
            self._drop(slot)
            raise
        except Exception as exc:  # the tactic's (or timer's) error: data, after cleaning up
            self._drop(slot)
            raise self._failure(exc) from None
        us = _median_us(result)
        if self._fastest_us is None or us < self._fastest_us:
            self._fastest_us = us
        return us

    def _open(
        self,
        slot: tuple[int, int | str, int],
        call: Callable[[int], object],
        warmup: int,
        repeat: int,
    ) -> TimerSession:
        before = self._reserved()
        session = self.timer.open(call, warmup=warmup, repeat=repeat, hint_us=self._fastest_us)
        self.sessions_opened += 1
        grown = max(0, self._reserved() - before)
        if self.session_bytes > 0 and self._held + grown <= self.session_bytes:
            self._sessions[slot] = session
            self._held += grown
        return session

    def _drop(self, slot: tuple[int, int | str, int]) -> None:
        session = self._sessions.pop(slot, None)
        if session is not None:
            session.close()

    def end(self) -> None:
        """Closes every open session (their graphs and pools)."""
        sessions, self._sessions = self._sessions, {}
        self._held = 0
        for session in sessions.values():
            session.close()

    def _failure(self, exc: Exception) -> TacticFailure:
        text = f"{type(exc).__name__}: {exc}"
        broken = recover_in_process(self.device)
        if broken is None:
            return TacticFailure(type(exc).__name__, str(exc))
        return TacticFailure(
            CONTEXT_CORRUPTED,
            f"{text}; afterwards the CUDA context reports {broken}",
            block=True,
            fatal=True,
        )

    def close(self) -> None:
        """Closes the open sessions."""
        self.end()


def sets_for_sample(sets: list[list[Any]], rotate_in_call: bool, sample: int) -> list[list[Any]]:
    """The input sets measurement number ``sample`` walks through: all of them (cold-L2 copies,
    rotated call by call) or set ``sample % len(sets)`` alone (distinct sets, one per sample)."""
    if rotate_in_call or len(sets) < 2:
        return sets
    return [sets[sample % len(sets)]]
