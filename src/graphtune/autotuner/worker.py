"""The subprocess executor: times tactics in a disposable worker (``isolation="subprocess"``).

The worker is started with the ``spawn`` method of ``torch.multiprocessing`` (``fork`` cannot be
used once CUDA is initialised) and reused for every tactic until one kills it (exit, signal),
corrupts its context or exceeds ``timeout_s``; that tactic is recorded as failed and blocklisted,
and the next tactic gets a fresh worker. Runners, synthetic inputs, ``forward`` keyword arguments
and a user-supplied timer are sent with ``pickle``, so they must be picklable (module-level
classes, no lambdas, open files or locks in their attributes); a clear
:class:`~graphtune.errors.ConfigError` says which one is not. It implements
:class:`~graphtune.autotuner.isolation.Executor`.
"""

from __future__ import annotations

import ctypes
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch

from graphtune.autotuner.isolation import (
    CONTEXT_CORRUPTED,
    CRASH,
    TIMEOUT,
    Isolation,
    TacticFailure,
    check_time,
    context_error,
    sets_for_sample,
)
from graphtune.autotuner.timing import resolve_timer, sizes_its_samples
from graphtune.errors import ConfigError, TuningError

logger = logging.getLogger(__name__)


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
        self.sizes_samples = _sizes_samples(timer, timing, device)
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
        self,
        runners: list[Any],
        sets: list[list[Any]],
        *,
        rotate_in_call: bool = True,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Pickles the runners, inputs and keyword arguments of the next profile (sent to the
        worker on first use); see :meth:`~graphtune.autotuner.isolation.Executor.begin`.

        Raises:
            ConfigError: A runner, input or keyword argument is not picklable (names which).
        """
        self._rotate_in_call = rotate_in_call
        for index, runner in enumerate(runners):
            _pickle_or_explain(f"runner {index} ({type(runner).__qualname__})", runner)
        payload = (runners, sets, dict(kwargs or {}))
        self._payload = _pickle_or_explain("the synthetic inputs or keyword arguments", payload)
        self._payload_id += 1

    def prepare_all(self, runner: Any, work: Sequence[tuple[list[Any], Sequence[Any]]]) -> None:
        """Nothing: the worker prepares each tactic on its own, where it is timed."""
        return None

    def end(self) -> None:
        """Nothing to release per profile (the worker keeps nothing between measurements)."""
        return None

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
        tactic_index: int | None = None,
    ) -> float:
        """Times one tactic in the worker (its ``sample``-th measurement); raises
        :class:`TacticFailure`. (``tactic_index`` is not needed: the worker keeps no sessions.)"""
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
        # daemon only covers a normal exit (it acts through the exit handlers); the worker
        # follows this process on its own (_follow_parent), so a kill leaves no orphan either.
        # The kernel's parent-death signal watches the starting *thread*: it is asked for only
        # from the main thread, or a tuning thread that ends would kill a worker still in use.
        main_thread = threading.current_thread() is threading.main_thread()
        proc = ctx.Process(
            target=worker_main,
            args=(child, self._timer_blob, self._timing, self._device, main_thread),
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


def _sizes_samples(timer: Any, timing: str, device: torch.device) -> bool:
    """Whether the worker's timer (``timer``, else the one ``timing`` resolves to) sizes its
    samples; ``False`` where ``timing`` cannot be resolved here (the worker reports why)."""
    if timer is not None:
        return sizes_its_samples(timer)
    try:
        return sizes_its_samples(resolve_timer(timing, device))
    except ConfigError:
        return False


# -- worker side ------------------------------------------------------------------------------

#: ``prctl`` option: the kernel sends a signal when the thread that started this process ends.
_PR_SET_PDEATHSIG = 1
#: Exit code of a worker whose tuning process is gone (nobody reads it; ps and tests may).
_ORPHAN_EXIT = 4


def _follow_parent(kernel_signal: bool) -> None:
    """Makes this worker die with the tuning process, even while a tactic runs.

    An idle worker ends on EOF from its pipe, but one inside a hung or long tactic never reads
    it, and ``daemon=True`` acts only through the parent's exit handlers, which SIGKILL and
    SIGTERM skip. On Linux, with ``kernel_signal`` (the worker was started from the parent's
    main thread), the kernel SIGKILLs the worker when the parent dies (``PR_SET_PDEATHSIG``);
    everywhere, a daemon thread waits on the parent's sentinel (a pipe the parent's death
    closes) and exits the process. The thread needs the GIL, which a tactic stuck in C code may
    hold, so it is the backstop, not the first line.
    """
    parent = multiprocessing.parent_process()
    if parent is None:  # not started by multiprocessing: there is no parent to follow
        return
    if kernel_signal and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no usable libc: the sentinel thread still acts
            pass
    if os.getppid() != parent.pid:  # the parent died before the signal was armed
        os._exit(_ORPHAN_EXIT)
    sentinel = parent.sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(_ORPHAN_EXIT)

    threading.Thread(target=watch, name="graphtune-parent-watch", daemon=True).start()


def worker_main(
    conn: Any,
    timer_blob: bytes | None,
    timing: str,
    device_name: str,
    parent_main_thread: bool = False,
) -> None:
    """Entry point of the worker process: serve setup/prepare/measure requests until told to stop.

    Replies are ``("ok", value)`` or ``("error", exception type, message, context_corrupted)``.
    After a context-corrupting error the worker replies and exits at once (``os._exit``): a
    process with a broken CUDA context can hang in its own shutdown. The worker dies with the
    process that started it, even in the middle of a tactic (``parent_main_thread``: it was
    started from that process's main thread, so the kernel may watch that thread).
    """
    _follow_parent(parent_main_thread)
    device = torch.device(device_name)
    try:
        if timer_blob is not None:
            timer = pickle.loads(timer_blob)
        else:
            timer = resolve_timer(timing, device)
    except Exception as exc:  # reported to the parent, which raises TuningError
        conn.send(("error", type(exc).__name__, str(exc), False))
        return
    conn.send(("ready", os.getpid()))
    runners: list[Any] = []
    sets: list[list[Any]] = []
    kwargs: dict[str, Any] = {}
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
                runners, sets, kwargs = pickle.loads(message[1])
                reply: tuple = ("ok", None)
            elif kind == "prepare":
                runners[message[1]].prepare(sets[0], message[2])
                reply = ("ok", None)
            elif kind == "measure":
                _, index, tactic, warmup, repeat, rotate_in_call, sample = message
                chosen = sets_for_sample(sets, rotate_in_call, sample)
                value = _raw_measure(timer, runners[index], tactic, chosen, warmup, repeat, kwargs)
                reply = ("ok", value)
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


def _raw_measure(
    timer: Any,
    runner: Any,
    tactic: Any,
    sets: list[list[Any]],
    warmup: int,
    repeat: int,
    kwargs: dict[str, Any],
) -> float:
    n = len(sets)

    def call(i: int) -> object:
        return runner.forward(sets[i % n], tactic=tactic, **kwargs)

    result = timer.measure(call, warmup=warmup, repeat=repeat)
    # A value the parent will reject is still sent as a number so the parent counts it.
    value = getattr(result, "median_us", math.nan)
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
