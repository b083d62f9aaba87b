"""The base class of every Triton runner: valid-tactic bookkeeping and ahead-of-time compilation.

:class:`TritonRunner` adds compilation to :class:`~graphtune.autotuner.runner.TunableRunner`, so
the timed rounds never include it:

* ``prepare_all`` (called by the tuner once per op, before any timing) compiles every tactic of
  every profile of the op at once. Pairs whose launches would run the same binaries (equal
  :func:`~graphtune.ops._launch_key.launch_key` of every kernel they launch, found by a dry run of
  ``launch`` inside :func:`~graphtune.ops._triton.collect_launches`) are compiled once. The
  distinct ones are compiled first by worker processes (:mod:`graphtune.ops._compile_pool`:
  Triton's code generator holds the GIL, so threads cannot run it in parallel), then "compiled"
  again in parallel threads of this process, which finds each binary in Triton's on-disk cache
  and loads it (and compiles itself whatever the workers could not). Triton keeps the binaries
  in its in-process cache and in its on-disk cache (``TRITON_CACHE_DIR``, by default
  ``~/.triton/cache``), so a later process loads them instead of compiling.
* ``prepare`` (per tactic) finds its binary compiled and re-raises its compile error, if any, so
  the tuner records the tactic as failed; on a profile ``prepare_all`` did not cover, the first
  ``prepare`` compiles all of that profile's planned tactics at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import torch

from graphtune.autotuner.entries import tactic_text
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.errors import ConfigError
from graphtune.ops import _compile_pool as compile_pool
from graphtune.ops._pdl import tensor_device
from graphtune.ops._triton import (
    collect_launches,
    input_signature,
    start_cache_key_warmup,
    triton_available,
)

logger = logging.getLogger(__name__)


def default_compile_workers() -> int:
    """Threads used to compile candidate tactics in parallel (``min(16, cpu_count)``)."""
    return max(1, min(16, os.cpu_count() or 1))


def triton_runners() -> list[TritonRunner]:
    """Every :class:`TritonRunner` alive in this process (reports sum their compile time)."""
    return list(_LIVE_RUNNERS)


#: Compiles running at once in this process, over all runners: ``AutoTuner.prepare`` runs the
#: runners' ``prepare_all`` side by side, and each has its own threads.
_COMPILE_SLOTS = threading.BoundedSemaphore(default_compile_workers())


class TritonRunner(TunableRunner):
    """Base of the Triton runners (see the module docstring).

    Subclasses implement :meth:`tactics_for` (the pruned tactic list, fallback excluded) and
    :meth:`launch` (``warmup=True`` compiles without running or loading, through
    ``graphtune.ops._triton.run_kernel``). Tactic ``-1`` runs the op's torch path, so the
    runner honours the "fallback works on every shape" contract without Triton.

    Args:
        compile_workers: Threads for ahead-of-time compilation; ``None`` picks
            :func:`default_compile_workers`; ``1`` compiles sequentially.

    Attributes:
        compile_seconds: Wall time spent compiling ahead of time, summed.
        compiled: Number of distinct binaries (sets of launches) compiled ahead of time.
        compile_shared: (profile, tactic) pairs that needed no compile of their own, because
            another pair's launches (of this call or an earlier one) run the same binaries.
        compiled_in_workers: Kernels compiled by worker processes for this runner
            (:mod:`graphtune.ops._compile_pool`); the runner then loaded them from Triton's
            on-disk cache.
    """

    # Neither changes what the runner computes or offers: not part of its cache identity.
    identity_excludes: ClassVar[frozenset[str]] = frozenset(
        {"compile_workers", "compile_seconds", "compiled", "compile_shared", "compiled_in_workers"}
    )

    def __init__(self, *, compile_workers: int | None = None) -> None:
        if compile_workers is not None and (
            isinstance(compile_workers, bool)
            or not isinstance(compile_workers, int)
            or compile_workers < 1
        ):
            raise ConfigError(
                f"compile_workers must be an int >= 1 or None, got {compile_workers!r}."
            )
        self.compile_workers = compile_workers or default_compile_workers()
        self.compile_seconds = 0.0
        self.compiled = 0
        self.compile_shared = 0
        self.compiled_in_workers = 0
        self._planned: dict[tuple[Any, ...], list[Any]] = {}
        self._compile_errors: dict[tuple[tuple[Any, ...], str], Exception] = {}
        self._prepared: set[tuple[Any, ...]] = set()
        # Binaries compiled so far (their launch keys) and each one's error, so that a later
        # profile, op or tuning run whose pairs run the same binaries compiles nothing again.
        self._binaries: dict[tuple[Any, ...], Exception | None] = {}
        self._lock = threading.Lock()
        _LIVE_RUNNERS.add(self)
        start_cache_key_warmup()

    def __getstate__(self) -> dict[str, Any]:
        # Picklable for AutoTuner(isolation="subprocess"): the worker compiles on its own.
        state = dict(self.__dict__)
        state.update(_lock=None, _planned={}, _compile_errors={}, _prepared=set(), _binaries={})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        _LIVE_RUNNERS.add(self)

    # -- subclass hooks ---------------------------------------------------------------------

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """Triton tactics valid for these inputs (the fallback ``-1`` is the torch path)."""
        raise NotImplementedError

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> Any:
        """Runs (or with ``warmup`` only compiles) the Triton kernel(s) for ``tactic``."""
        raise NotImplementedError

    def torch_forward(self, inputs: list[Any]) -> Any:
        """The op's unfused torch path, run for tactic ``-1``."""
        raise NotImplementedError

    def supports(self, inputs: list[Any]) -> bool:
        """Whether Triton kernels can run on these inputs at all (device, dtypes)."""
        return True

    # -- TunableRunner ------------------------------------------------------------------------

    def get_valid_tactics(self, inputs: list[Any], profile: Any, **kwargs: Any) -> list[Any]:
        """The pruned Triton tactics for this profile (empty without Triton)."""
        if not triton_available() or not self.supports(inputs):
            return []
        tactics = list(self.tactics_for(inputs))
        with self._lock:
            self._planned[input_signature(inputs)] = tactics
        return tactics

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC, **kwargs: Any) -> Any:
        """Runs tactic ``-1`` with torch, any other tactic with Triton, unless the kernels cannot
        take these inputs (:meth:`supports`): then torch.

        A pick is tuned on contiguous synthetic inputs and looked up by shape, dtype and device,
        so it is served to live inputs of any layout (a transposed weight view, a strided bias);
        a kernel that assumes unit strides would read them wrongly.
        """
        if tactic == FALLBACK_TACTIC or not self.supports(inputs):
            return self.torch_forward(inputs)
        return self.launch(inputs, tactic)

    def prepare_all(self, work: Sequence[tuple[list[Any], Sequence[Any]]]) -> None:
        """Compiles every (inputs, tactic) pair of ``work`` once per distinct binary, in
        parallel; the profiles' ``prepare`` then only report compile errors. Profiles prepared
        before (``AutoTuner.prepare`` ahead of the tuning runs) are skipped."""
        fresh, items = self._unprepared(work)
        self._compile(items)
        with self._lock:
            self._prepared.update(input_signature(inputs) for inputs, _ in fresh)

    def prepare(self, inputs: list[Any], tactic: Any) -> None:
        """Compiles every planned tactic of this profile on first use; re-raises its error."""
        if tactic == FALLBACK_TACTIC:
            return
        sig = input_signature(inputs)
        if sig not in self._prepared:
            planned = self._planned.get(sig) or [tactic]
            self.precompile(inputs, planned)
            self._prepared.add(sig)
        error = self._compile_errors.get((sig, tactic_text(tactic)))
        if error is not None:
            raise error

    def precompile(
        self, inputs: list[Any], tactics: list[Any], workers: int | None = None
    ) -> dict[str, str | None]:
        """Compiles ``tactics`` for ``inputs`` ahead of timing, in parallel threads.

        Args:
            inputs: Inputs of the profile (their shapes, dtypes and strides pick the binary).
            tactics: Tactics to compile (``-1`` is skipped: it is torch).
            workers: Threads; default ``compile_workers``.

        Returns:
            For each tactic (as canonical JSON), ``None`` when it compiled, else the error text.
            Errors are also kept and re-raised by :meth:`prepare` so the tuner records the
            tactic as failed.
        """
        todo = [t for t in tactics if t != FALLBACK_TACTIC]
        errors = self._compile([(inputs, t) for t in todo], workers)
        return {
            tactic_text(t): None if e is None else f"{type(e).__name__}: {e}"
            for t, e in zip(todo, errors, strict=True)
        }

    # -- compilation --------------------------------------------------------------------------

    def _unprepared(
        self, work: Sequence[tuple[list[Any], Sequence[Any]]]
    ) -> tuple[list[tuple[list[Any], Sequence[Any]]], list[tuple[list[Any], Any]]]:
        """The profiles of ``work`` not prepared before, and their (inputs, Triton tactic)
        pairs (tactic ``-1`` is torch: nothing to compile)."""
        with self._lock:
            fresh = [
                (x, tactics) for x, tactics in work if input_signature(x) not in self._prepared
            ]
        pairs = [(inputs, t) for inputs, tactics in fresh for t in tactics if t != FALLBACK_TACTIC]
        return fresh, pairs

    def _binary_key(self, inputs: list[Any], tactic: Any) -> tuple[Any, ...]:
        """What decides the binaries of one pair: the keys of the launches a dry run makes."""
        try:
            with collect_launches() as keys:
                self.launch(inputs, tactic, warmup=True)
        except Exception:  # an invalid tactic: compile it alone, and its error is reported
            return ("alone", input_signature(inputs), tactic_text(tactic))
        return tuple(keys) if keys else ("alone", input_signature(inputs), tactic_text(tactic))

    def prepare_ahead(self, work: Sequence[tuple[list[Any], Sequence[Any]]]) -> bool:
        """Hands the binaries of ``work`` to the compile worker processes and returns at once
        (:func:`graphtune.ops._compile_pool.compile_ahead`); :meth:`prepare_all` then waits for
        those it needs and loads them. ``False`` when the workers are off here (nothing
        started)."""
        if not compile_pool.enabled():
            return False
        _, pairs = self._unprepared(work)
        compile_pool.compile_ahead(self._compile_jobs(pairs))
        return True

    def _compile_jobs(self, pairs: list[tuple[list[Any], Any]]) -> list[Any]:
        """What Triton would compile for ``pairs`` (their launches, captured, compile nothing)."""
        with compile_pool.capturing() as jobs:
            for inputs, tactic in pairs:
                device = tensor_device(inputs)
                on_gpu = device is not None and device.type == "cuda"
                try:
                    with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
                        self.launch(inputs, tactic, warmup=True)
                except Exception:  # an invalid tactic: the in-process compile reports it
                    continue
        return jobs

    def _compile_in_workers(self, pairs: list[tuple[list[Any], Any]]) -> None:
        """Has worker processes compile the binaries of ``pairs`` into Triton's on-disk cache
        first (:mod:`graphtune.ops._compile_pool`), so the in-process compile only loads them."""
        if not compile_pool.enabled():
            return
        report = compile_pool.compile_in_workers(self._compile_jobs(pairs))
        with self._lock:
            self.compiled_in_workers += report.compiled

    def _compile(
        self, items: list[tuple[list[Any], Any]], workers: int | None = None
    ) -> list[Exception | None]:
        """Compiles each distinct binary of ``items`` once; returns each item's error."""
        if not items:
            return []
        start = time.perf_counter()
        groups: dict[tuple[Any, ...], list[int]] = {}
        for index, (inputs, tactic) in enumerate(items):
            groups.setdefault(self._binary_key(inputs, tactic), []).append(index)
        with self._lock:
            done = {key: self._binaries[key] for key in groups if key in self._binaries}
        todo = [key for key in groups if key not in done]
        leaders = [groups[key][0] for key in todo]
        if len(leaders) > 1:
            self._compile_in_workers([items[i] for i in leaders])
        threads = max(1, min(workers or self.compile_workers, len(leaders)))

        def compile_one(index: int) -> Exception | None:
            inputs, tactic = items[index]
            device = tensor_device(inputs)
            with _COMPILE_SLOTS:
                return compile_launch(inputs, tactic, device)

        def compile_launch(inputs: list[Any], tactic: Any, device: Any) -> Exception | None:
            try:
                if device is not None and device.type == "cuda":
                    # A worker thread starts on device 0; compile for the inputs' device.
                    with torch.cuda.device(device):
                        self.launch(inputs, tactic, warmup=True)
                else:
                    self.launch(inputs, tactic, warmup=True)
            except Exception as exc:  # a config that fails to compile is a failed tactic
                return exc
            return None

        if threads == 1:
            leader_errors = [compile_one(i) for i in leaders]
        else:
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="graphtune-jit") as ex:
                leader_errors = list(ex.map(compile_one, leaders))
        results = {**done, **dict(zip(todo, leader_errors, strict=True))}
        errors: list[Exception | None] = [None] * len(items)
        for key, members in groups.items():
            for index in members:
                errors[index] = results[key]
        elapsed = time.perf_counter() - start
        with self._lock:
            self._binaries.update(zip(todo, leader_errors, strict=True))
            self.compile_seconds += elapsed
            self.compiled += sum(1 for e in leader_errors if e is None)
            self.compile_shared += len(items) - len(leaders)
            for (inputs, tactic), error in zip(items, errors, strict=True):
                slot = (input_signature(inputs), tactic_text(tactic))
                if error is None:
                    self._compile_errors.pop(slot, None)
                else:
                    self._compile_errors[slot] = error
        logger.debug(
            "%s: compiled %d binaries for %d (profile, tactic) pairs in %.2f s with %d threads "
            "(%d failed)",
            type(self).__name__,
            len(leaders),
            len(items),
            elapsed,
            threads,
            sum(1 for e in leader_errors if e is not None),
        )
        return errors


# Weak: a runner that nothing else holds is gone from the list (the op modules keep theirs).
_LIVE_RUNNERS: weakref.WeakSet[TritonRunner] = weakref.WeakSet()
