"""Triton compiles in worker processes, so that the GIL-bound part of compiling runs in parallel.

Compiling a Triton kernel first runs Triton's code generator, Python code that turns the kernel's
AST into Triton IR while holding the GIL; only the later LLVM passes and ``ptxas`` release it.
Compile threads (:mod:`graphtune.ops._triton_runner`) therefore overlap the back end but not the
front end, which is most of a small kernel's compile. This module moves the whole compile into
worker processes and leaves the tuning process only loading the results:

1. :func:`capturing`: the caller runs its launches (``launch(..., warmup=True)``) with Triton's
   ``knobs.runtime.jit_cache_hook`` answering for this thread: every launch that would compile
   records what Triton would compile (:class:`CompileJob`: the JIT function by module and name,
   its signature, constants, attributes and options, and the target), and compiles nothing.
2. :func:`compile_in_workers`: each distinct job goes to a pool of spawned processes, which call
   ``triton.compile`` with exactly those arguments (:mod:`graphtune._compile_worker`: a worker
   imports neither torch nor ``graphtune.ops``). Triton writes every binary to its on-disk
   cache (``triton.knobs.cache.dir``; the workers are given the tuning process's folder).
3. The caller then compiles in its own process as before. Triton computes the same cache key
   there (same source, specialisation, options, target and environment), finds the binary on
   disk and loads it instead of generating code. The first job of each kernel signature also
   builds the host launcher that Triton up to 3.6 compiles with the C compiler at a kernel's
   first load (``CompileJob.launcher``), so that load reads it from the cache too.

Nothing depends on the workers for correctness: a job a worker fails, or one whose binary is not
found afterwards, is compiled in the tuning process with the error it raises there, exactly as
without workers. Used when Triton compiles for a GPU (never under ``TRITON_INTERPRET=1``), its
runtime has ``knobs.runtime.jit_cache_hook`` (Triton 3.4 and later), and
``GRAPHTUNE_COMPILE_PROCESSES`` is not ``0`` (default ``min(16, cpu_count)`` processes). The
pool starts for a batch of at least :data:`MIN_JOBS_TO_START` jobs, or earlier through
:func:`start_compile_workers` (each worker imports Triton and hashes its installation once, which
takes a second or two, so ``tune_step`` starts them before it records the step when the tuner's
cache is empty, else before it plans the step when an op has no pick yet), and stays until
:func:`close_compile_workers` (``tune_step`` calls it when it is done) or the end of the
process. Workers never touch the GPU: the target is passed in, so compiling needs no CUDA
context.

No wait on a worker is unbounded (:mod:`graphtune.ops._pool_stop`). A batch waits until its
jobs are done or the pool made no progress for :func:`compile_timeout` seconds
(``GRAPHTUNE_COMPILE_TIMEOUT``, default :data:`COMPILE_TIMEOUT_S`): no job of the pool (its
own, one handed over ahead, a warm-up) finished since the later of the batch's start, the
pool's start and the last job that finished, so that a batch queued behind a busy pool's
:func:`compile_ahead` work is not taken for a hung one. A worker that hangs (a
deadlock, a stuck code generator) then has its pool killed, with one warning, and the pool is
marked broken for the rest of the process (:func:`enabled` is ``False``): the jobs that timed
out, like every later compile, are compiled in-process, as without workers. Closing the pool,
at :func:`close_compile_workers` or at interpreter exit, gives running jobs
:data:`CLOSE_GRACE_S` seconds and kills the workers still busy then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import pickle
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from graphtune import env
from graphtune._compile_worker import (
    CompileJob,
    JobResult,
    compile_job,
    init_worker,
    triton_knobs,
    warm_up,
)
from graphtune.ops._pool_stop import before_thread_joins_at_exit, stop_pool, wait_for_progress

logger = logging.getLogger(__name__)

#: Fewest jobs worth starting the worker processes for (a running pool takes any batch of 2+).
MIN_JOBS_TO_START = 4
#: Default of :func:`compile_timeout`: one compile takes seconds, a large kernel a minute or so.
COMPILE_TIMEOUT_S = 300.0
#: Seconds :func:`close_compile_workers` lets running jobs end before it kills their workers.
CLOSE_GRACE_S = 5.0


@dataclass
class WorkerReport:
    """What one :func:`compile_in_workers` call did."""

    jobs: int = 0
    compiled: int = 0
    failed: int = 0
    timed_out: int = 0
    seconds: float = 0.0


def compile_processes() -> int:
    """Worker processes to use: ``GRAPHTUNE_COMPILE_PROCESSES``, else ``min(16, cpu_count)``."""
    chosen = env.compile_processes()
    return chosen if chosen is not None else min(16, os.cpu_count() or 1)


def compile_timeout() -> float:
    """Seconds a batch waits without any of its jobs finishing: ``GRAPHTUNE_COMPILE_TIMEOUT``,
    else :data:`COMPILE_TIMEOUT_S`."""
    chosen = env.compile_timeout()
    return chosen if chosen is not None else COMPILE_TIMEOUT_S


def _knobs() -> Any:
    """``triton.knobs`` when its runtime has the ``jit_cache_hook`` capturing needs."""
    knobs = triton_knobs()
    runtime = getattr(knobs, "runtime", None)
    return knobs if runtime is not None and hasattr(runtime, "jit_cache_hook") else None


def _has_target() -> bool:
    """Whether Triton has a GPU to compile for (an active driver that names its target)."""
    try:
        _current_target()
    except Exception:  # no active driver (a machine without a GPU): nothing compiles at all
        return False
    return True


def enabled() -> bool:
    """Whether compiles can go to worker processes here (see the module docstring): never
    again in this process once a batch timed out (:func:`broken`)."""
    return _BROKEN is None and _usable_here()


def broken() -> str | None:
    """Why the workers are off for the rest of this process (a batch timed out), else ``None``."""
    return _BROKEN


def _usable_here() -> bool:
    from graphtune.ops._triton import kernels_interpreted, triton_available

    return (
        compile_processes() > 0
        and triton_available()
        and not kernels_interpreted()
        and _knobs() is not None
        and _has_target()
    )


# -- capture ------------------------------------------------------------------------------------

_LOCAL = threading.local()
_HOOK_LOCK = threading.Lock()
_HOOK_USERS = 0
_PREVIOUS_HOOK: Any = None


def _current_target() -> Any:
    from triton.runtime.driver import driver

    return driver.active.get_current_target()


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples Triton's options hold (their text is part of the key)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _job_of(fn: Any, compile: dict[str, Any]) -> CompileJob | None:
    """The job for one compile the JIT is about to do; ``None`` when a worker cannot import
    the function (defined inside another function)."""
    function = getattr(getattr(fn, "jit_function", None), "fn", None)
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", "")
    if not module or not qualname or "<locals>" in qualname:
        return None
    data = json.loads(compile["specialization_data"])
    options = {k: _tuples(v) for k, v in data["options"].items()}
    if isinstance(data.get("target"), dict):  # Triton 3.9 records it; older versions do not
        from triton.backends.compiler import GPUTarget

        target = GPUTarget(**data["target"])
    else:
        target = _current_target()
    ident = repr((module, qualname, compile["key"], repr(target)))
    # The worker runs the module from its file, without the packages above it (see
    # graphtune._compile_worker): the source, and so the cache key, is the one used here.
    path = getattr(sys.modules.get(module), "__file__", None)
    return CompileJob(
        module,
        qualname,
        dict(compile["signature"]),
        dict(compile["constants"] or {}),
        dict(compile["configs"][0]) if compile.get("configs") else {},
        options,
        target,
        ident,
        path,
    )


def _hook(*, fn: Any, compile: dict[str, Any], **kwargs: Any) -> Any:
    jobs = getattr(_LOCAL, "jobs", None)
    if jobs is None:  # another thread's compile: not ours to capture
        previous = _PREVIOUS_HOOK
        return previous(fn=fn, compile=compile, **kwargs) if previous is not None else None
    try:
        job = _job_of(fn, compile)
    except Exception as exc:  # a form this Triton serialises differently: compiled in-process
        logger.debug("cannot hand %r to a compile worker: %s", fn, exc)
        job = None
    if job is not None:
        jobs.append(job)
    return True  # compile nothing now; the caller compiles (or loads) it afterwards


@contextlib.contextmanager
def capturing() -> Iterator[list[CompileJob]]:
    """Within the block (this thread), every Triton launch that would compile appends its
    :class:`CompileJob` to the yielded list and compiles nothing (``warmup`` returns ``None``).
    Other threads compile as usual."""
    global _HOOK_USERS, _PREVIOUS_HOOK
    knobs = _knobs()
    if knobs is None:
        raise RuntimeError("capturing() needs Triton's knobs.runtime.jit_cache_hook")
    with _HOOK_LOCK:
        if _HOOK_USERS == 0:
            _PREVIOUS_HOOK = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = _hook
        _HOOK_USERS += 1
    jobs: list[CompileJob] = []
    _LOCAL.jobs = jobs
    try:
        yield jobs
    finally:
        _LOCAL.jobs = None
        with _HOOK_LOCK:
            _HOOK_USERS -= 1
            if _HOOK_USERS == 0:
                if knobs.runtime.jit_cache_hook is _hook:  # nobody replaced it meanwhile
                    knobs.runtime.jit_cache_hook = _PREVIOUS_HOOK
                _PREVIOUS_HOOK = None


# -- workers ------------------------------------------------------------------------------------


_POOL_LOCK = threading.Lock()
_POOL: ProcessPoolExecutor | None = None
#: Set (under the lock) when a batch timed out: see :func:`broken`.
_BROKEN: str | None = None
#: Jobs handed to the workers by :func:`compile_ahead`, by ``CompileJob.ident`` (under the lock).
_AHEAD: dict[str, Future[JobResult]] = {}
#: Kernel signatures whose host launcher a job was asked to build (under the lock): Triton's
#: launcher source depends only on the argument types, so one build serves every such kernel.
_LAUNCHERS: set[tuple[Any, ...]] = set()
#: ``time.monotonic()`` when the pool last made progress: it started, or any job it was handed
#: finished (:func:`_record`); what a batch's timeout is measured from (:func:`_last_progress`).
_PROGRESS: float = 0.0


def _pool(start: bool) -> ProcessPoolExecutor | None:
    global _POOL, _PROGRESS
    with _POOL_LOCK:
        if _POOL is None and start and _BROKEN is None:
            _PROGRESS = time.monotonic()
            knobs = _knobs()
            cache_dir = getattr(getattr(knobs, "cache", None), "dir", None)
            _POOL = ProcessPoolExecutor(
                max_workers=compile_processes(),
                mp_context=multiprocessing.get_context("spawn"),
                initializer=init_worker,
                initargs=(cache_dir,),
            )
            logger.debug("started %d Triton compile workers", compile_processes())
        return _POOL


_LOG: list[JobResult] = []
_LOG_LOCK = threading.Lock()


def _last_progress() -> float:
    """When the pool last made progress (see :data:`_PROGRESS`)."""
    return _PROGRESS


def _record(future: Future[JobResult]) -> None:
    """Done-callback of every job handed to the pool: stamps the pool's progress (any job that
    finished, failed ones included) and keeps its :class:`JobResult`."""
    global _PROGRESS
    _PROGRESS = time.monotonic()
    if future.cancelled() or future.exception() is not None:
        return
    with _LOG_LOCK:
        _LOG.append(future.result())


def _submit(pool: ProcessPoolExecutor, fn: Any, *args: Any) -> Future[JobResult]:
    future: Future[JobResult] = pool.submit(fn, *args)
    future.add_done_callback(_record)
    return future


def _hand_over(pool: ProcessPoolExecutor, job: CompileJob) -> Future[JobResult] | None:
    """Submits ``job`` to ``pool`` (the first of its signature also builds the host launcher);
    ``None`` when it cannot travel to a worker or the pool takes no more work (the job is then
    compiled in-process)."""
    signature = tuple(job.signature.values())
    with _POOL_LOCK:
        first = signature not in _LAUNCHERS
        _LAUNCHERS.add(signature)
    if first:
        job = dataclasses.replace(job, launcher=True)
    try:
        pickle.dumps(job)
        return _submit(pool, compile_job, job)
    except BrokenProcessPool as exc:  # a worker died earlier (warm-up, a job compiled ahead)
        logger.warning("compile workers stopped (%s); compiling in-process, new workers next", exc)
        close_compile_workers()
        return None
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as exc:
        logger.debug("compile job %s not handed to the workers: %s", job.qualname, exc)
        return None


def job_log() -> list[JobResult]:
    """What the workers of this process did so far (warm-ups and compiles, in the order they
    finished), each with its wall-clock span: when the workers were ready, how busy they were,
    and what each kernel cost to compile (``benchmarks/tuning_time.py`` reports it)."""
    with _LOG_LOCK:
        return list(_LOG)


def start_compile_workers() -> bool:
    """Starts the worker processes now, without waiting for them (their imports then overlap
    whatever the caller does before its first batch); returns whether they are used here."""
    if not enabled():
        return False
    pool = _pool(start=True)
    if pool is not None:
        for _ in range(compile_processes()):
            _submit(pool, warm_up)
    return pool is not None


def close_compile_workers(grace_s: float = CLOSE_GRACE_S) -> None:
    """Stops the worker processes (a later batch starts them again, unless :func:`broken`):
    jobs not started are cancelled, running ones get ``grace_s`` seconds, then their workers
    are killed. Also run at interpreter exit, before anything there joins the pool."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
        _AHEAD.clear()
        _LAUNCHERS.clear()
    if pool is not None:
        killed = stop_pool(pool, grace_s)
        if killed:
            logger.debug("killed %d Triton compile workers that were still busy", killed)


before_thread_joins_at_exit(close_compile_workers)


def _give_up(timed_out: int, batch: int, timeout_s: float) -> None:
    """A batch timed out: marks the pool broken for the rest of the process and kills it."""
    global _BROKEN
    with _POOL_LOCK:
        first = _BROKEN is None
        _BROKEN = f"{timed_out} compile job(s) got no result within {timeout_s:g} s"
    if first:
        logger.warning(
            "%d of %d Triton compile jobs did not finish in the worker processes, no job of "
            "the workers finishing for %g s (GRAPHTUNE_COMPILE_TIMEOUT); killing the workers: "
            "those jobs and every later compile of this process are compiled in-process",
            timed_out,
            batch,
            timeout_s,
        )
    close_compile_workers(grace_s=0.0)


def compile_in_workers(jobs: Sequence[CompileJob]) -> WorkerReport:
    """Compiles each distinct job in the worker processes (into Triton's on-disk cache) and
    waits for them, until no job of the pool finished for :func:`compile_timeout` seconds,
    ahead-of-time jobs it waits behind included (the pool is then
    killed and marked broken: :func:`broken`); returns what happened. Does nothing when the
    pool is off or the batch too small to start it; a broken pool is dropped (the caller
    compiles in-process either way, the jobs that failed or timed out included)."""
    distinct = list({job.ident: job for job in jobs}.values())
    report = WorkerReport(jobs=len(distinct))
    if len(distinct) < 2 or not enabled():
        return report
    timeout_s = compile_timeout()  # a bad value is refused before anything is handed over
    pool = _pool(start=len(distinct) >= MIN_JOBS_TO_START)
    if pool is None:
        return report
    started = time.perf_counter()
    futures: list[Future[JobResult]] = []
    for job in distinct:
        with _POOL_LOCK:
            future = _AHEAD.get(job.ident)  # handed over by compile_ahead: wait for it
        if future is None:
            future = _hand_over(pool, job)
        if future is None:  # the rest of the batch is compiled in-process
            break
        futures.append(future)
    pending = wait_for_progress(futures, timeout_s, _last_progress)
    if pending:
        _give_up(len(pending), len(futures), timeout_s)
    for future in futures:
        if future in pending:  # the caller compiles it in-process, as every job that failed
            report.timed_out += 1
            report.failed += 1
            continue
        try:
            error = future.result().error
        except BrokenProcessPool as exc:
            if _BROKEN is None:  # not the kill of a timed-out batch (of another thread)
                logger.warning("a Triton compile worker died (%s); compiling in-process", exc)
            close_compile_workers()
            report.failed += 1
            continue
        except CancelledError:  # the pool was closed meanwhile (another thread's timeout)
            report.failed += 1
            continue
        if error is None:
            report.compiled += 1
        else:
            report.failed += 1
            logger.debug("compile worker: %s", error)
    report.seconds = time.perf_counter() - started
    return report


def compile_ahead(jobs: Sequence[CompileJob]) -> int:
    """Hands each distinct job that was not handed over before to the worker processes and
    returns at once; returns how many were handed over (0 when the pool is off).

    The workers take jobs in the order they were handed over, so hand them over in the order
    they will be needed. A later :func:`compile_in_workers` of the same job waits for this one
    instead of compiling it again; until then the tuning process is free to do other work (to
    time the ops whose binaries are ready).
    """
    distinct = list({job.ident: job for job in jobs}.values())
    if not distinct or not enabled():
        return 0
    pool = _pool(start=True)
    if pool is None:
        return 0
    handed = 0
    for job in distinct:
        with _POOL_LOCK:
            if job.ident in _AHEAD:
                continue
        future = _hand_over(pool, job)
        if future is None:  # compiled in-process later
            continue
        with _POOL_LOCK:
            _AHEAD[job.ident] = future
        handed += 1
    return handed
