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
* :class:`SubprocessExecutor` (``isolation="subprocess"``) times in a worker started with the
  ``spawn`` method of ``torch.multiprocessing`` (``fork`` cannot be used once CUDA is initialised).
  The worker is reused for every tactic until one kills it (exit, signal), corrupts its context or
  exceeds ``timeout_s``; that tactic is recorded as failed and blocklisted, and the next tactic
  gets a fresh worker. Runners, synthetic inputs and a user-supplied timer are sent with
  ``pickle``, so they must be picklable (module-level classes, no lambdas, open files or locks in
  their attributes); a clear :class:`~graphtune.errors.ConfigError` says which one is not.

See ``docs/reliability.md`` for what each mode can and cannot recover from.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import pickle
import signal
from dataclasses import dataclass
from typing import Any

import torch

from graphtune.errors import ConfigError, TuningError

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


class InProcessExecutor:
    """Runs ``prepare`` and the timer in this process.

    Args:
        timer: The timer to measure with.
        device: Device of the inputs (what to synchronize after a failure).
    """

    def __init__(self, timer: Any, device: torch.device) -> None:
        self.timer = timer
        self.device = device
        self._sets: list[list[Any]] = []
        self._rotate_in_call = True
        self.starts = 0

    def begin(
        self, runners: list[Any], sets: list[list[Any]], *, rotate_in_call: bool = True
    ) -> None:
        """Sets the runners and input sets of the profile about to be timed.

        Args:
            runners: The op's runners.
            sets: Input sets (lists of ``forward`` inputs).
            rotate_in_call: Every measurement walks through all sets, call by call (cold-L2
                copies); otherwise measurement ``sample`` times set ``sample % len(sets)`` only.
        """
        self._sets = sets
        self._rotate_in_call = rotate_in_call

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
    ) -> float:
        """Times one tactic (its ``sample``-th measurement); returns microseconds per call or
        raises :class:`TacticFailure`."""
        sets = sets_for_sample(self._sets, self._rotate_in_call, sample)
        n = len(sets)

        def call(i: int) -> object:
            return runner.forward(sets[i % n], tactic)

        try:
            result = self.timer.measure(call, warmup=warmup, repeat=repeat)
        except Exception as exc:  # the tactic's (or timer's) error: data, after cleaning up
            raise self._failure(exc) from None
        return _median_us(result)

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
        """Nothing to release."""
        return None


def describe_exit(exitcode: int | None) -> str:
    """``"exit code 3"``, ``"killed by SIGSEGV"`` or ``"still running"``."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _pickle_or_explain(what: str, value: Any) -> bytes:
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"isolation='subprocess' sends {what} to a worker process with pickle, but it cannot "
            f"be pickled ({type(exc).__name__}: {exc}). Define runner (and timer) classes at "
            "module top level, not inside a function; keep lambdas, open files, locks and "
            "streams out of their attributes (or implement __getstate__); or use "
            "isolation='inprocess'."
        ) from None


class SubprocessExecutor:
    """Times tactics in a reusable worker process that is replaced when a tactic kills it.

    Args:
        isolation: Timeouts.
        timer: A timer object to send to the worker (must be picklable), or ``None`` to have the
            worker resolve ``timing`` for ``device`` itself.
        timing: ``TuningConfig.timing`` (used when ``timer`` is ``None``).
        device: Device of the inputs.
    """

    def __init__(self, isolation: Isolation, timer: Any, timing: str, device: torch.device) -> None:
        self.isolation = isolation
        self._timer_blob = _pickle_or_explain("the timer", timer) if timer is not None else None
        self._timing = timing
        self._device = str(device)
        self.key = (timing, str(device))
        self._proc: Any = None
        self._conn: Any = None
        self._payload: bytes | None = None
        self._payload_id = 0
        self._worker_payload_id = -1
        self._rotate_in_call = True
        self.starts = 0

    # -- profile ------------------------------------------------------------------------------

    def begin(
        self, runners: list[Any], sets: list[list[Any]], *, rotate_in_call: bool = True
    ) -> None:
        """Pickles the runners and inputs of the next profile (sent to the worker on first use).

        ``rotate_in_call`` as for :meth:`InProcessExecutor.begin`.

        Raises:
            ConfigError: A runner or input is not picklable (names which).
        """
        self._rotate_in_call = rotate_in_call
        for index, runner in enumerate(runners):
            _pickle_or_explain(f"runner {index} ({type(runner).__qualname__})", runner)
        self._payload = _pickle_or_explain("the synthetic inputs", (runners, sets))
        self._payload_id += 1

    def prepare(self, runner_index: int, runner: Any, tactic: Any) -> None:
        """Runs ``prepare`` in the worker; raises :class:`TacticFailure`."""
        self._request(("prepare", runner_index, tactic), f"prepare of tactic {tactic!r}")

    def measure(
        self,
        runner_index: int,
        runner: Any,
        tactic: Any,
        *,
        warmup: int,
        repeat: int,
        sample: int = 0,
    ) -> float:
        """Times one tactic in the worker (its ``sample``-th measurement); raises
        :class:`TacticFailure`."""
        request = ("measure", runner_index, tactic, warmup, repeat, self._rotate_in_call, sample)
        value = self._request(request, f"timing of tactic {tactic!r}")
        return check_time(value)

    def close(self) -> None:
        """Stops the worker (politely, then by force)."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self._worker_payload_id = -1
        if proc is None:
            return
        try:
            conn.send(("stop",))
        except (OSError, ValueError):  # the worker is already gone
            pass
        proc.join(timeout=5.0)
        _kill(proc)
        conn.close()

    # -- worker management ---------------------------------------------------------------------

    def _start(self) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        # daemon: a worker never outlives the tuning process, even if that one is killed.
        proc = ctx.Process(
            target=worker_main,
            args=(child, self._timer_blob, self._timing, self._device),
            name="graphtune-tactic-worker",
            daemon=True,
        )
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        self.starts += 1
        reply = self._receive(self.isolation.start_timeout_s, "start")
        if reply[0] != "ready":
            self.close()
            raise TuningError(
                f"the tactic worker could not start: {reply[1]}: {reply[2]}. Check that "
                "graphtune imports in a fresh process, or use isolation='inprocess'."
            )
        logger.debug("started tactic worker pid %d", proc.pid)

    def _ensure_ready(self) -> None:
        if self._proc is not None and not self._proc.is_alive():
            self.close()
        if self._proc is None:
            self._start()
        if self._worker_payload_id != self._payload_id:
            if self._payload is None:
                raise TuningError("SubprocessExecutor.begin() must be called before timing.")
            self._conn.send(("setup", self._payload))
            reply = self._receive(self.isolation.start_timeout_s, "setup")
            if reply[0] != "ok":
                self.close()
                raise ConfigError(
                    "isolation='subprocess': the worker could not unpickle the runners or inputs "
                    f"({reply[1]}: {reply[2]}). Runner classes must be importable by their module "
                    "path in a fresh process (not defined in an interactive session or inside a "
                    "function), or use isolation='inprocess'."
                )
            self._worker_payload_id = self._payload_id

    def _receive(self, timeout: float, what: str) -> tuple:
        """Next reply of the worker; kills it and raises TacticFailure on timeout or death."""
        conn, proc = self._conn, self._proc
        if not conn.poll(timeout):
            self._abandon()
            raise TacticFailure(
                TIMEOUT, f"no result within {timeout:g} s; the worker was killed", block=True
            )
        try:
            return conn.recv()
        except (EOFError, OSError):
            proc.join(timeout=5.0)
            code = proc.exitcode
            self._abandon()
            raise TacticFailure(
                CRASH, f"the worker died during {what} ({describe_exit(code)})", block=True
            ) from None

    def _request(self, message: tuple, what: str) -> Any:
        try:
            self._ensure_ready()
            self._conn.send(message)
        except TacticFailure as failure:
            # The worker died or hung before the tactic ran: not the tactic's fault.
            raise TuningError(f"the tactic worker failed before {what}: {failure}") from None
        except (BrokenPipeError, EOFError, OSError) as exc:
            self._abandon()
            raise TuningError(f"the tactic worker failed before {what}: {exc}") from None
        reply = self._receive(self.isolation.timeout_s, what)
        if reply[0] == "ok":
            return reply[1]
        _, kind, text, corrupted = reply
        if corrupted:
            self._abandon()  # it exits on its own; make sure, and start fresh next time
            raise TacticFailure(
                CONTEXT_CORRUPTED,
                f"{kind}: {text} (the worker's CUDA context is unusable)",
                block=True,
            )
        raise TacticFailure(kind, text)

    def _abandon(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self._worker_payload_id = -1
        if proc is not None:
            _kill(proc)
        if conn is not None:
            conn.close()


def _kill(proc: Any) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5.0)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5.0)


# -- worker side ------------------------------------------------------------------------------


def worker_main(conn: Any, timer_blob: bytes | None, timing: str, device_name: str) -> None:
    """Entry point of the worker process: serve setup/prepare/measure requests until told to stop.

    Replies are ``("ok", value)`` or ``("error", exception type, message, context_corrupted)``.
    After a context-corrupting error the worker replies and exits at once (``os._exit``): a
    process with a broken CUDA context can hang in its own shutdown.
    """
    device = torch.device(device_name)
    try:
        if timer_blob is not None:
            timer = pickle.loads(timer_blob)
        else:
            from graphtune.autotuner.timing import resolve_timer

            timer = resolve_timer(timing, device)
    except Exception as exc:  # reported to the parent, which raises TuningError
        conn.send(("error", type(exc).__name__, str(exc), False))
        return
    conn.send(("ready", os.getpid()))
    runners: list[Any] = []
    sets: list[list[Any]] = []
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        kind = message[0]
        if kind == "stop":
            return
        try:
            if kind == "setup":
                runners, sets = pickle.loads(message[1])
                reply: tuple = ("ok", None)
            elif kind == "prepare":
                runners[message[1]].prepare(sets[0], message[2])
                reply = ("ok", None)
            elif kind == "measure":
                _, index, tactic, warmup, repeat, rotate_in_call, sample = message
                chosen = sets_for_sample(sets, rotate_in_call, sample)
                reply = ("ok", _raw_measure(timer, runners[index], tactic, chosen, warmup, repeat))
                broken = context_error(device)
                if broken is not None:
                    # An asynchronous error of this tactic: report it now, or the next tactic
                    # would be blamed for it.
                    raise RuntimeError(f"after timing, the device reports {broken}")
            else:
                reply = ("error", "ValueError", f"unknown request {kind!r}", False)
        except Exception as exc:  # the tactic's error: report it, check the context
            broken = context_error(device)
            text = str(exc).strip()[:4000]
            conn.send(("error", type(exc).__name__, text, broken is not None))
            if broken is not None:
                conn.close()
                os._exit(3)
            continue
        conn.send(reply)


def sets_for_sample(sets: list[list[Any]], rotate_in_call: bool, sample: int) -> list[list[Any]]:
    """The input sets measurement number ``sample`` walks through: all of them (cold-L2 copies,
    rotated call by call) or set ``sample % len(sets)`` alone (distinct sets, one per sample)."""
    if rotate_in_call or len(sets) < 2:
        return sets
    return [sets[sample % len(sets)]]


def _raw_measure(
    timer: Any, runner: Any, tactic: Any, sets: list[list[Any]], warmup: int, repeat: int
) -> float:
    n = len(sets)

    def call(i: int) -> object:
        return runner.forward(sets[i % n], tactic)

    result = timer.measure(call, warmup=warmup, repeat=repeat)
    # A value the parent will reject is still sent as a number so the parent counts it.
    value = getattr(result, "median_us", math.nan)
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
