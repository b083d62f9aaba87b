"""AutoTuner.choose_one: look a pick up, or tune every profile of the op and cache the picks.

Outside tuning mode ``choose_one`` is a dictionary look-up (memoised per exact call signature).
Inside it, a miss tunes every missing profile of the op (bucket combination) at once: a
:class:`~graphtune.autotuner.tuning.TuningRun` times each (runner, tactic) on synthetic inputs
with the timer that was passed in (or the one ``TuningConfig.timing`` names), by the schedule of
:mod:`graphtune.autotuner.schedule` and the noise-aware rule of
:mod:`graphtune.autotuner.selection` (knobs: :class:`~graphtune.autotuner.policy.TuningPolicy`),
and the picks are cached. Under a collective distributed strategy the ranks reduce each candidate
to one agreed time first (:mod:`graphtune.autotuner.distributed`). Where a tactic runs while timed
is chosen by ``isolation`` (:mod:`graphtune.autotuner.isolation`). The guide is
``docs/autotuner.md``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from graphtune.autotuner import resolved as resolved_calls
from graphtune.autotuner.cache import TuningCache
from graphtune.autotuner.calls import CallRecord, MissLog, OpCall
from graphtune.autotuner.config import TuningConfig
from graphtune.autotuner.distributed import DistributedTuning, OpCoordinator
from graphtune.autotuner.entries import CacheEntry, CacheKey, key_timing, tactic_text
from graphtune.autotuner.executors import TuningExecutors
from graphtune.autotuner.failures import FailureLog
from graphtune.autotuner.identity import LocalClasses, runner_id, short_runner_name, sources_digest
from graphtune.autotuner.isolation import Isolation
from graphtune.autotuner.policy import TuningPolicy
from graphtune.autotuner.preparing import prepare_runs
from graphtune.autotuner.profiles import generate_profiles, profile_for
from graphtune.autotuner.resolved import HitMemo, ResolvedCall, device_of, memo_key
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.autotuner.selection import ProfileRecord
from graphtune.autotuner.stats import TunerStats
from graphtune.autotuner.timing.base import Timer
from graphtune.autotuner.tuner_args import check_pin, check_timer
from graphtune.autotuner.tuning import ProfileOutcome, TuningRun
from graphtune.autotuner.values import canonical_text, identity_value
from graphtune.errors import ConfigError
from graphtune.reporting import format_cell, render_table

logger = logging.getLogger(__name__)

SUMMARY_COLUMNS = ("op", "bucket", "winner", "time (us)", "fallback (us)", "speed-up")
#: Why a size the bucket mapper maps to 0 runs the fallback (logged at INFO: it is by design).
NO_BUCKET = "the bucket mapper gives this size no bucket"
UNTUNABLE = "it could not be tuned: every candidate failed, or its inputs do not fit the device"


class _RecordingState(threading.local):
    """The ``record_calls`` block the current thread is in (each thread starts outside one)."""

    recording: list[OpCall] | None = None
    dry_run: bool = False


def _default_is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class AutoTuner:
    """Picks the fastest (runner, tactic) per op and shape bucket, and remembers it.

    Args:
        timer: Times every candidate; ``None`` resolves one per call from ``TuningConfig.timing``
            and the inputs' device. A timer given here takes precedence over the config.
        policy: Measurement and tie knobs (:class:`~graphtune.autotuner.policy.TuningPolicy`).
        cache: The cache to use; a new empty one by default.
        isolation: ``"inprocess"`` (default), ``"subprocess"`` (time every tactic in a reusable
            worker process that is replaced when a tactic crashes, hangs or corrupts the CUDA
            context; runners, inputs and ``timer`` must be picklable), or an
            :class:`~graphtune.autotuner.isolation.Isolation` with timeouts.
        distributed: How the ranks of a process group share tuning: ``None`` (not distributed,
            the default), a strategy name or a :class:`~graphtune.autotuner.distributed.
            DistributedTuning` (see ``docs/distributed.md``).
        is_capturing: Returns whether a CUDA stream is capturing (then nothing is profiled); the
            default asks ``torch.cuda.is_current_stream_capturing()``. A seam for tests.
        show_progress: Force the progress bar on or off; ``None`` decides from the terminal.
        clock: Seconds for the time accounting in ``stats`` (not for timing candidates).

    Attributes:
        cache: The :class:`~graphtune.autotuner.cache.TuningCache` of picks.
        stats: The :class:`~graphtune.autotuner.stats.TunerStats` counters.
        history: One :class:`~graphtune.autotuner.selection.ProfileRecord` per tuned profile,
            in tuning order; it grows for the tuner's lifetime; clear it freely.
        misses: The :class:`~graphtune.autotuner.calls.MissLog` of calls that ran the fallback
            because their shape was not tuned (save it for ``graphtune tune --from-misses``).
        failed_profiles: Keys of profiles where every candidate failed in this process; they
            are not cached, and look-ups of them run the fallback without tuning again until
            this set is cleared.
        tuning_mode: Whether a miss tunes (``autotune()`` turns it on for its block).
    """

    def __init__(
        self,
        timer: Timer | None = None,
        *,
        policy: TuningPolicy | None = None,
        cache: TuningCache | None = None,
        isolation: str | Isolation | None = None,
        distributed: str | DistributedTuning | None = None,
        is_capturing: Callable[[], bool] | None = None,
        show_progress: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        check_timer(timer)
        if policy is not None and not isinstance(policy, TuningPolicy):
            raise ConfigError(
                f"AutoTuner(policy={policy!r}): pass a TuningPolicy(rounds=..., ...) or None."
            )
        self.timer = timer
        self.policy = policy if policy is not None else TuningPolicy()
        self.isolation = Isolation.resolve(isolation)
        self.distributed = DistributedTuning.resolve(distributed)
        self.cache = cache if cache is not None else TuningCache()
        self.stats = TunerStats()
        self.history: list[ProfileRecord] = []
        self.misses = MissLog()
        self.failed_profiles: set[CacheKey] = set()
        self.tuning_mode = False
        self.show_progress = show_progress
        self._clock = clock
        self._is_capturing = is_capturing or _default_is_capturing
        self._warned_ops: set[str] = set()
        self._local_classes = LocalClasses()  # runner classes made in a function: see there
        self._failures = FailureLog(self.stats)
        self._summary: list[tuple[Any, ...]] = []
        # Indexes of the summary rows whose fallback time is one sample (it left the race).
        self._one_sample_rows: set[int] = set()
        self._executors = TuningExecutors()  # timers and the tactic worker, kept across runs
        # record_calls() state, per thread: another thread's calls are neither recorded nor
        # dry-run, and overlapping blocks in two threads each restore their own thread's state.
        self._local = _RecordingState()
        # Hits by exact call signature, valid while the cache's version is unchanged: a decode
        # step asks for the same signatures over and over, and bucketing and key building cost.
        self._memo = HitMemo()
        # One tuning run at a time: two threads tuning one op would time each other's kernels.
        self._tune_lock = threading.RLock()

    # -- public API ---------------------------------------------------------------------------

    def choose_one(
        self,
        op: str,
        runners: Sequence[TunableRunner],
        config: TuningConfig,
        inputs: Sequence[Any],
        **kwargs: Any,
    ) -> tuple[TunableRunner, Any]:
        """Returns the (runner, tactic) to run ``op`` on ``inputs`` with.

        Looks the inputs' bucketed shapes up in the cache. On a miss in tuning mode (and while no
        CUDA stream is capturing) it tunes every missing profile of the op first; otherwise a
        miss returns ``(runners[0], -1)``, counted in ``stats.fallbacks``, recorded in
        ``misses`` and warned once per op. A size the bucket mapper maps to 0 always runs the
        fallback.

        Args:
            op: Name of the op (part of the cache key).
            runners: Implementations to choose from; ``runners[0]`` with tactic ``-1`` is the
                fallback and the baseline of the reported speed-up.
            config: How the op's shapes are bucketed and timed.
            inputs: The live inputs, as ``forward`` receives them.
            **kwargs: Passed to every runner's ``get_valid_tactics`` and ``forward`` while
                tuning, and part of the cache key (so their values need a stable text).

        Raises:
            ConfigError: No runners, ``config`` is not a ``TuningConfig``, a runner or keyword
                argument has no stable identity, a keyword argument is named ``inputs``,
                ``profile`` or ``tactic`` (graphtune passes those), or every candidate failed
                and a runner's ``get_valid_tactics`` or ``forward`` cannot take the call
                graphtune makes.
            InputError: A spec points at an input or dimension that does not exist.
        """
        signature = memo_key(op, runners, config, inputs, kwargs)
        recording, dry_run = self._local.recording, self._local.dry_run
        hit = self._memo.get(signature, self.cache) if recording is None else None
        if hit is not None:  # the hot path: no copies, no checks (a bad call is never memoised)
            self.stats.hits += 1
            return hit
        call = OpCall.checked(op, runners, config, inputs, kwargs)
        runners, inputs = list(call.runners), list(call.inputs)
        if recording is not None:
            recording.append(call)
            hit = self._memo.get(signature, self.cache)
            if hit is not None:
                if not dry_run:
                    self.stats.hits += 1
                return hit
        resolved = self._resolve(call)
        key = resolved.live_key()
        version = self.cache.version  # before the look-up: see HitMemo.put
        found = self._lookup(key, runners) if key is not None else None
        if dry_run:
            return found or (runners[0], FALLBACK_TACTIC)
        if found is not None:
            self.stats.hits += 1
            self._memo.put(signature, self.cache, version, found)
            return found
        self.stats.misses += 1
        why = self._miss_reason(key)
        if why is None:
            with self._tune_lock:
                self._run(resolved)
            found = self._lookup(key, runners) if key is not None else None
            if found is not None:
                return found
            why = UNTUNABLE
        if key is None:
            return self._fallback(op, runners, NO_BUCKET)
        self.misses.add(key, lambda: CallRecord.of(call, resolved.ids, key))
        return self._fallback(op, runners, why)

    @contextmanager
    def record_calls(self, *, dry_run: bool = False) -> Iterator[list[OpCall]]:
        """Records every ``choose_one`` call made in the block (for example one decode step) as
        an :class:`~graphtune.autotuner.calls.OpCall`, in call order; yields the list.

        With ``dry_run`` the block's calls neither tune nor count: each returns its cached pick
        or the fallback, and ``stats``, ``misses`` and the once-per-op warnings stay as they
        were (how ``graphtune.engine.tuning.tune_step`` records one untuned step to ``prepare``).

        Only the calling thread's calls are recorded (and dry-run): other threads' calls behave
        as they would without the block. Blocks nest within a thread; the innermost records.
        """
        local = self._local
        previous = local.recording, local.dry_run
        calls: list[OpCall] = []
        local.recording, local.dry_run = calls, dry_run
        try:
            yield calls
        finally:
            local.recording, local.dry_run = previous

    def tune_call(self, call: OpCall) -> tuple[TunableRunner, Any]:
        """Tunes exactly the profile of ``call`` (if it is not cached) and returns its pick.

        Unlike a tuning-mode ``choose_one``, which tunes every missing bucket of the op, this
        times only the bucket the call maps to: what ``graphtune tune --from-misses`` does.
        """
        resolved = self._resolve(call)
        runners = list(call.runners)
        key = resolved.live_key()
        if key is None:
            return runners[0], FALLBACK_TACTIC
        if key not in self.cache:
            with self._tune_lock:
                self._run(resolved, only=key)
        return self._lookup(key, runners) or (runners[0], FALLBACK_TACTIC)

    def prepare(self, calls: Sequence[OpCall], *, ahead: bool = False) -> int:
        """Prepares (``prepare_all``: compiles) every candidate of every missing profile of
        ``calls`` at once, before any of them is tuned: one ``prepare_all`` per runner over all
        the calls, the runners in parallel threads. Tuning the calls afterwards (running the
        step under ``autotune()``) then finds their tactics compiled. Only in-process isolation
        (a worker process compiles on its own). Returns the (inputs, tactic) pairs prepared.

        Args:
            calls: For example the op calls of one untuned step (``record_calls()``), in the
                order they will be tuned.
            ahead: Start each runner's work in the background instead (``prepare_ahead``, in
                the order of ``calls``) and return at once: each op's tuning then waits only
                for its own tactics while the rest is still being prepared. A runner that
                starts nothing so (or has no ``prepare_ahead``) is prepared up front.
        """
        if self.isolation.mode != "inprocess":
            return 0
        start = self._clock()
        profiles = resolved_calls.distinct_profiles(self._resolve(c) for c in calls)
        pairs = prepare_runs((self._tuning_run(resolved) for resolved in profiles), ahead=ahead)
        phases = self.stats.phase_seconds
        phases["prepare"] = phases.get("prepare", 0.0) + self._clock() - start
        return pairs

    def missing_profiles(self, calls: Sequence[OpCall]) -> int:
        """How many (op, bucket) profiles of ``calls`` a tuning-mode run would tune: every bucket
        of each call's op whose key is not in this process's cache (no collective, no timing)."""
        missing: set[CacheKey] = set()
        for resolved in resolved_calls.distinct_profiles(self._resolve(call) for call in calls):
            for profile in generate_profiles(resolved.call.config, list(resolved.call.inputs)):
                key = resolved.key(profile)
                if key not in self.cache:
                    missing.add(key)
        return len(missing)

    def cached(self, call: OpCall) -> tuple[CacheKey, CacheEntry] | None:
        """The cache key of the call's profile and its entry (``entry.runner_index`` indexes
        ``call.runners``), or ``None`` when there is none (not tuned, or a size the bucket
        mapper gives no bucket). ``cache.put(key, entry)`` puts a replaced pick back."""
        profile = profile_for(call.config, list(call.inputs))
        key = None if profile is None else self._resolve(call).key(profile)
        entry = None if key is None else self.cache.get(key)
        return None if key is None or entry is None else (key, entry)

    def pin(
        self,
        call: OpCall,
        runner_index: int,
        tactic: Any = FALLBACK_TACTIC,
        *,
        time_us: float | None = None,
    ) -> CacheKey:
        """Makes ``(call.runners[runner_index], tactic)`` the cached pick of the call's profile
        (saved like any pick), for decisions that time more than the op alone: see
        ``graphtune.engine.tuning.check_fusion``.

        Raises:
            ConfigError: ``runner_index`` names no runner of the call, ``tactic`` cannot be
                stored in a cache file, ``time_us`` is not ``None`` or a finite number > 0, or
                the call's size maps to no bucket (such calls always run the fallback).
        """
        check_pin(call, runner_index, tactic, time_us)
        profile = profile_for(call.config, list(call.inputs))
        if profile is None:
            raise ConfigError(
                f"pin: this call of op {call.op!r} maps to no bucket, so it always runs the "
                "fallback and has no pick to pin; pin a call of a tuned size"
            )
        resolved = self._resolve(call)
        key = resolved.key(profile)
        entry = CacheEntry(resolved.ids[runner_index], runner_index, tactic, time_us, None)
        self.cache.put(key, entry)
        return key

    def reset_stats(self) -> None:
        """Zeroes ``stats`` and re-arms the once-per-op warnings (for example after warm-up, so
        that serving counts its own fallbacks)."""
        self.stats = TunerStats()
        self._failures = FailureLog(self.stats)
        self._warned_ops.clear()
        self.misses.rearm_warnings()

    def close(self) -> None:
        """Stops the tactic worker process, if any (``autotune()`` calls this on exit)."""
        self._executors.close()

    def summary_rows(self) -> list[tuple[Any, ...]]:
        """One row per tuned profile: op, bucket, winner, time, fallback time, speed-up, in µs.
        The times are medians, except a fallback time that is one sample because the fallback
        left the race; :meth:`summary_table_rows` marks those."""
        return list(self._summary)

    def summary_table_rows(self, start: int = 0) -> list[tuple[Any, ...]]:
        """:meth:`summary_rows` from ``start`` for a table: a fallback time that is one sample
        reads ``"6561.0 (1 sample)"`` beside the winner's median."""
        return [
            (*row[:4], f"{format_cell(row[4])} (1 sample)", *row[5:])
            if index in self._one_sample_rows
            else row
            for index, row in enumerate(self._summary[start:], start)
        ]

    def summary_table(self, title: str | None = "graphtune autotuning picks") -> str:
        """The picks of this tuner's tuning runs as a text table (empty string if none)."""
        rows = self.summary_table_rows()
        return render_table(title, SUMMARY_COLUMNS, rows) if rows else ""

    # -- look-up --------------------------------------------------------------------------------

    def _mode_name(self, config: TuningConfig, device: torch.device) -> str:
        if self.timer is not None:
            return self.timer.name
        if config.timing == "auto":
            return "graph" if device.type == "cuda" else "wallclock"
        return config.timing

    def _resolve(self, call: OpCall) -> ResolvedCall:
        ids = tuple(runner_id(r) for r in call.runners)
        self._local_classes.check(call.runners, ids)
        device = device_of(call.inputs)
        extra = ""
        if call.kwargs:
            extra = canonical_text(identity_value(call.kwargs, f"keyword arguments of {call.op!r}"))
        return ResolvedCall(
            call,
            ids,
            device,
            key_timing(self._mode_name(call.config, device), call.config.cold_l2),
            sources_digest(call.runners),
            extra,
        )

    def _lookup(
        self, key: CacheKey, runners: list[TunableRunner]
    ) -> tuple[TunableRunner, Any] | None:
        entry = self.cache.get(key)
        if entry is None:
            return None
        index = entry.runner_index
        if not 0 <= index < len(runners) or key.runners[index] != entry.runner_id:
            return None  # an entry that does not name one of these runners is never trusted
        return runners[index], entry.tactic

    def _miss_reason(self, key: CacheKey | None) -> str | None:
        """Why this miss is answered with the fallback, or ``None`` when it is to be tuned."""
        if not self.tuning_mode:
            return "not in tuning mode"
        if self._is_capturing():
            return "a CUDA stream is capturing, so it cannot be timed"
        if key is not None and key in self.failed_profiles:
            return UNTUNABLE
        return None

    def _fallback(
        self, op: str, runners: list[TunableRunner], why: str
    ) -> tuple[TunableRunner, Any]:
        self.stats.fallbacks[op] = self.stats.fallbacks.get(op, 0) + 1
        if op not in self._warned_ops:
            self._warned_ops.add(op)
            level = logging.INFO if why == NO_BUCKET else logging.WARNING
            logger.log(
                level,
                "op %r: no tuned pick for this shape (%s); using %s with the fallback tactic -1. "
                "%s Further misses of this op are counted in stats.fallbacks only.",
                op,
                why,
                type(runners[0]).__qualname__,
                "The warnings of its tuning say why."
                if why == UNTUNABLE
                else "Tune it by running the workload under graphtune.autotune() before serving.",
            )
        return runners[0], FALLBACK_TACTIC

    # -- tuning ---------------------------------------------------------------------------------

    def _tuning_run(self, resolved: ResolvedCall, only: CacheKey | None = None) -> TuningRun:
        call = resolved.call
        coordinator = OpCoordinator(self.distributed or DistributedTuning(), call.op, resolved.ids)
        return TuningRun(
            op=call.op,
            runners=list(call.runners),
            ids=resolved.ids,
            config=call.config,
            inputs=list(call.inputs),
            kwargs=dict(call.kwargs),
            device=resolved.device,
            make_key=resolved.key,
            policy=self.policy,
            cache=self.cache,
            executor=self._executors.executor(
                self.timer, self.isolation, self.policy.session_bytes, call.config, resolved.device
            ),
            coordinator=coordinator,
            stats=self.stats,
            failures=self._failures,
            on_profile=lambda outcome: self._store(call.op, outcome, coordinator),
            clock=self._clock,
            show_progress=self.show_progress,
            only=only,
            failed=self.failed_profiles,
        )

    def _run(self, resolved: ResolvedCall, only: CacheKey | None = None) -> None:
        op = resolved.call.op
        first_row = len(self._summary)
        start = self._clock()
        self._tuning_run(resolved, only).run()
        tuned = len(self._summary) - first_row
        if tuned:
            # One line per op at INFO; autotune() logs the table of all picks when it exits.
            logger.info("tuned %s: %d buckets in %.2f s", op, tuned, self._clock() - start)
            table = render_table(
                f"autotuned {op}", SUMMARY_COLUMNS, self.summary_table_rows(first_row)
            )
            logger.debug("%s", table)

    def _store(self, op: str, outcome: ProfileOutcome, coord: OpCoordinator) -> None:
        self.history.append(outcome.record)
        entry = outcome.entry
        if entry is None:
            self.failed_profiles.add(outcome.key)
            return
        if self.distributed is not None:
            entry = replace(entry, tuned_by=coord.provenance)
        self.cache.put(outcome.key, entry)
        winner = f"{short_runner_name(entry.runner_id)} tactic={tactic_text(entry.tactic)}"
        if entry.fallback_us is not None and _one_sample_fallback(outcome.record):
            self._one_sample_rows.add(len(self._summary))  # not a median like the winner's
        row = (op, outcome.profile.describe(), winner, entry.time_us, entry.fallback_us)
        self._summary.append((*row, entry.speedup))


def _one_sample_fallback(rec: ProfileRecord) -> bool:
    """Whether the fallback's time is one raced-out sample against a median of the winner's."""
    won = rec.candidates[rec.winner_index].samples if rec.winner_index is not None else 0
    once = [
        c.samples == 1 for c in rec.candidates if (c.runner_index, c.tactic) == (0, FALLBACK_TACTIC)
    ]
    return won > 1 and once == [True]
