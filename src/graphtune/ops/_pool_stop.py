"""Waiting for the Triton compile workers, and stopping them, without ever hanging on one.

:mod:`graphtune.ops._compile_pool` hands compile jobs to a ``ProcessPoolExecutor``. A worker
whose job never ends (a deadlock, a stuck code generator) would block three waits for good:
the tuning process's wait for its batch, ``shutdown(wait=True)``, which joins every worker, and
the interpreter's exit, where ``concurrent.futures`` joins each pool's manager thread, which
waits for every job handed over. Here :func:`wait_for_progress` bounds the first, and
:func:`stop_pool` (also run at exit, before ``concurrent.futures`` joins anything:
:func:`before_thread_joins_at_exit`) kills what does not end of itself. This module imports
nothing of graphtune.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

#: Seconds to wait for a killed worker process to be reaped (it cannot refuse SIGKILL).
REAP_S = 5.0


def wait_for_progress(
    futures: Iterable[Future[Any]],
    timeout_s: float,
    last_progress: Callable[[], float] | None = None,
) -> set[Future[Any]]:
    """Waits until every future is done, or until ``timeout_s`` seconds passed without
    progress; returns those not done (empty when all are). Progress is one of ``futures``
    finishing, or, with ``last_progress`` (a ``time.monotonic()`` stamp, read again on each
    turn), any other progress it reports: a pool shared with other waiters passes the time its
    last job of any kind finished, so that a batch queued behind other work of a busy pool is
    not taken for a hung one. A long wait that keeps making progress is never cut short; a
    job that hangs costs at most ``timeout_s`` after the last progress."""
    pending = set(futures)
    since = time.monotonic()  # the wait's start counts as progress
    while pending:
        if last_progress is not None:
            since = max(since, last_progress())
        left = since + timeout_s - time.monotonic()
        if left <= 0:
            break
        done, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
        if done:
            since = time.monotonic()
    return pending


def stop_pool(pool: ProcessPoolExecutor, grace_s: float) -> int:
    """Shuts ``pool`` down without joining it: jobs not started are cancelled, running jobs
    get ``grace_s`` seconds to end, and every worker process still alive then is killed (its
    jobs' futures then fail with ``BrokenProcessPool``); returns how many were killed."""
    # The executor drops both references in shutdown(); the manager thread is the one that
    # concurrent.futures joins at exit.
    processes = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + max(0.0, grace_s)
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    alive = [process for process in processes if process.is_alive()]
    for process in alive:
        process.kill()
    for process in alive:
        process.join(REAP_S)
    if isinstance(manager, threading.Thread) and manager.is_alive():
        manager.join(REAP_S)  # it sees the workers gone, fails their jobs and ends
    return len(alive)


def before_thread_joins_at_exit(function: Callable[[], None]) -> None:
    """Runs ``function`` at interpreter exit before ``concurrent.futures`` joins the pools'
    manager threads (which wait for every job handed over, a hung one included): callbacks of
    ``threading._register_atexit`` run last-registered first and before ``atexit``'s; the
    caller must have imported ``concurrent.futures.process``, which registers its join. Where
    that hook is missing, ``atexit`` (later than the join, but still at exit)."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(function)
    else:
        register(function)
