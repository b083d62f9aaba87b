"""AutoTuner.choose_one, the process-default tuner and the ``autotune()`` context manager.

Outside tuning mode ``choose_one`` is a dictionary look-up. Inside it, a miss tunes every profile
of the op (bucket combination) at once: each (runner, tactic) is timed on synthetic inputs by the
timer that was passed in (or the one ``TuningConfig.timing`` names), and the pick is cached.

Noise handling, so that repeated tuning runs pick the same tactic:

* candidates are measured interleaved (round-robin over all of them for ``rounds`` rounds), so a
  slow drift of clocks or temperature hits every candidate alike instead of whichever ran last;
* the ``remeasure_top`` fastest are measured ``rounds`` more times, interleaved;
* a candidate's time is the median of its measurements; every candidate within ``tie_tolerance``
  (relative, default 2%) of the fastest counts as tied, and the tie goes to the lowest
  (runner index, tactic index): the earliest-listed, usually simplest implementation.

Faults: a tactic that raises, hangs, crashes or returns a garbage time (NaN, inf, <= 0) counts as
infinitely slow, with its reason counted in ``stats.tactic_failures``. Where a tactic runs while
timed is chosen by ``isolation`` (see :mod:`graphtune.autotuner.isolation`); tactics that crashed,
hung or corrupted the CUDA context are put on the cache's blocklist and never timed again until
the user clears it.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from os import PathLike
from typing import Any

import torch

from graphtune import env
from graphtune.autotuner.cache import BlockedTactic, CacheEntry, CacheKey, TuningCache
from graphtune.autotuner.config import TuningConfig
from graphtune.autotuner.distributed import DistributedTuning, OpCoordinator
from graphtune.autotuner.isolation import (
    InProcessExecutor,
    Isolation,
    SubprocessExecutor,
    TacticFailure,
)
from graphtune.autotuner.profiles import (
    Profile,
    generate_profiles,
    input_bytes,
    profile_for,
    synthesize_inputs,
)
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner, runner_id, short_runner_name
from graphtune.autotuner.timing.base import Timer
from graphtune.errors import CacheFileError, ConfigError, TuningError
from graphtune.reporting import ProgressTask, progress, render_table

logger = logging.getLogger(__name__)

SUMMARY_COLUMNS = ("op", "bucket", "winner", "time (us)", "fallback (us)", "speed-up")


@dataclass
class TunerStats:
    """Counters of one :class:`AutoTuner`.

    Attributes:
        hits: ``choose_one`` calls answered from the cache.
        misses: Calls whose shape was not in the cache (tuned, or answered with the fallback).
        fallbacks: Per op, calls answered with ``(runners[0], -1)`` because nothing was tuned.
        profiles_tuned: (op, bucket) combinations tuned.
        tactics_timed: (runner, tactic) candidates timed successfully, summed over profiles.
        measurements: Timer calls made.
        tactic_failures: Failed candidates by reason: an exception type name, or ``timeout``,
            ``crash``, ``context corrupted``, ``invalid time`` (NaN, inf or <= 0 from the timer).
        tactics_blocked: Candidates skipped because the blocklist names them.
        workers_started: Worker processes started (``isolation="subprocess"``).
        tuning_seconds: Wall time spent tuning.
    """

    hits: int = 0
    misses: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    profiles_tuned: int = 0
    tactics_timed: int = 0
    measurements: int = 0
    tactic_failures: dict[str, int] = field(default_factory=dict)
    tactics_blocked: int = 0
    workers_started: int = 0
    tuning_seconds: float = 0.0


@dataclass
class _Candidate:
    runner_index: int
    runner: TunableRunner
    tactic_index: int
    tactic: Any
    samples: list[float] = field(default_factory=list)
    failed: str | None = None

    @property
    def order(self) -> tuple[int, int]:
        return (self.runner_index, self.tactic_index)

    @property
    def score(self) -> float:
        return statistics.median(self.samples) if self.samples and not self.failed else math.inf


def _default_is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _device_of(inputs: Sequence[Any]) -> torch.device:
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _tactic_text(tactic: Any) -> str:
    return json.dumps(tactic, default=str)


class AutoTuner:
    """Picks the fastest (runner, tactic) per op and shape bucket, and remembers it.

    Args:
        timer: Times every candidate; ``None`` resolves one per call from ``TuningConfig.timing``
            and the inputs' device. A timer given here takes precedence over the config.
        rounds: Interleaved measurement rounds over all candidates (and again over the top few).
        remeasure_top: How many of the fastest candidates are measured again.
        tie_tolerance: Relative gap within which candidates count as tied (0.02 = 2%); ties go to
            the lowest (runner index, tactic index).
        is_capturing: Returns whether a CUDA stream is capturing (then nothing is profiled); the
            default asks ``torch.cuda.is_current_stream_capturing()``. A seam for tests.
        cache: The cache to use; a new empty one by default.
        show_progress: Force the progress bar on or off; ``None`` decides from the terminal.
        isolation: ``"inprocess"`` (default), ``"subprocess"`` (time every tactic in a reusable
            worker process that is replaced when a tactic crashes, hangs or corrupts the CUDA
            context; runners, inputs and ``timer`` must be picklable), or an
            :class:`~graphtune.autotuner.isolation.Isolation` with timeouts.
        distributed: How the ranks of a process group share tuning: ``None`` (not distributed,
            the default), a strategy name or a :class:`~graphtune.autotuner.distributed.
            DistributedTuning` (see ``docs/distributed.md``).
    """

    def __init__(
        self,
        timer: Timer | None = None,
        *,
        rounds: int = 3,
        remeasure_top: int = 3,
        tie_tolerance: float = 0.02,
        is_capturing: Callable[[], bool] | None = None,
        cache: TuningCache | None = None,
        show_progress: bool | None = None,
        isolation: str | Isolation | None = None,
        distributed: str | DistributedTuning | None = None,
    ) -> None:
        if timer is not None and not isinstance(timer, Timer):
            raise ConfigError(
                f"AutoTuner(timer={timer!r}): a timer needs a `name` and "
                "`measure(fn, *, warmup, repeat) -> Measurement` (see graphtune.autotuner.timing)."
            )
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ConfigError(f"AutoTuner(rounds={rounds!r}): rounds must be an int >= 1.")
        bad_top = isinstance(remeasure_top, bool) or not isinstance(remeasure_top, int)
        if bad_top or remeasure_top < 0:
            raise ConfigError(
                f"AutoTuner(remeasure_top={remeasure_top!r}): must be an int >= 0 (0 turns it off)."
            )
        if not 0.0 <= float(tie_tolerance) < 1.0:
            raise ConfigError(
                f"AutoTuner(tie_tolerance={tie_tolerance!r}): must be in [0, 1), e.g. 0.02 for 2%."
            )
        self.isolation = Isolation.resolve(isolation)
        self.distributed = DistributedTuning.resolve(distributed)
        self.timer = timer
        self.rounds = rounds
        self.remeasure_top = remeasure_top
        self.tie_tolerance = float(tie_tolerance)
        self.cache = cache if cache is not None else TuningCache()
        self.stats = TunerStats()
        self.tuning_mode = False
        self.show_progress = show_progress
        self._is_capturing = is_capturing or _default_is_capturing
        self._timers: dict[tuple[str, str], Timer] = {}
        self._warned_ops: set[str] = set()
        self._logged_failures: set[tuple[str, str]] = set()
        self._summary: list[tuple[Any, ...]] = []
        self._worker: SubprocessExecutor | None = None
        # One tuning run at a time: two threads tuning one op would time each other's kernels.
        self._tune_lock = threading.RLock()

    # -- public API ---------------------------------------------------------------------------

    def choose_one(
        self,
        op: str,
        runners: Sequence[TunableRunner],
        config: TuningConfig,
        inputs: Sequence[Any],
    ) -> tuple[TunableRunner, Any]:
        """Returns the (runner, tactic) to run ``op`` on ``inputs`` with.

        Looks the inputs' bucketed shapes up in the cache. On a miss in tuning mode (and while no
        CUDA stream is capturing) it tunes every profile of the op first; otherwise a miss returns
        ``(runners[0], -1)``, counted in ``stats.fallbacks`` and warned once per op.

        Args:
            op: Name of the op (part of the cache key).
            runners: Implementations to choose from; ``runners[0]`` with tactic ``-1`` is the
                fallback and the baseline of the reported speed-up.
            config: How the op's shapes are bucketed and timed.
            inputs: The live inputs, as ``forward`` receives them.

        Raises:
            ConfigError: No runners, or ``config`` is not a ``TuningConfig``.
            InputError: A spec points at an input or dimension that does not exist.
        """
        runners = list(runners)
        inputs = list(inputs)
        if not runners:
            raise ConfigError(
                f"choose_one({op!r}) got no runners; pass at least one TunableRunner."
            )
        if not isinstance(config, TuningConfig):
            raise ConfigError(f"choose_one({op!r}) needs a TuningConfig, got {config!r}.")
        ids = tuple(runner_id(r) for r in runners)
        device = _device_of(inputs)
        mode = self._mode_name(config, device)
        key = self._key(op, ids, profile_for(config, inputs), mode)
        found = self._lookup(key, runners)
        if found is not None:
            self.stats.hits += 1
            return found
        self.stats.misses += 1
        if not self.tuning_mode:
            return self._fallback(op, runners, "not in tuning mode")
        if self._is_capturing():
            return self._fallback(op, runners, "a CUDA stream is capturing, so it cannot be timed")
        with self._tune_lock:
            self._tune_op(op, runners, ids, config, inputs, device, mode)
        found = self._lookup(key, runners)
        return found if found is not None else (runners[0], FALLBACK_TACTIC)

    def close(self) -> None:
        """Stops the tactic worker process, if any (``autotune()`` calls this on exit)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def summary_rows(self) -> list[tuple[Any, ...]]:
        """One row per tuned profile: op, bucket, winner, time, fallback time, speed-up."""
        return list(self._summary)

    def summary_table(self, title: str | None = "graphtune autotuning picks") -> str:
        """The picks of this tuner's tuning runs as a text table (empty string if none)."""
        rows = self.summary_rows()
        return render_table(title, SUMMARY_COLUMNS, rows) if rows else ""

    # -- look-up --------------------------------------------------------------------------------

    def _mode_name(self, config: TuningConfig, device: torch.device) -> str:
        if self.timer is not None:
            return self.timer.name
        if config.timing == "auto":
            return "graph" if device.type == "cuda" else "wallclock"
        return config.timing

    @staticmethod
    def _key(op: str, ids: tuple[str, ...], profile: Profile, mode: str) -> CacheKey:
        return CacheKey(op, ids, profile.shapes, profile.dtypes, mode)

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

    def _fallback(
        self, op: str, runners: list[TunableRunner], why: str
    ) -> tuple[TunableRunner, Any]:
        self.stats.fallbacks[op] = self.stats.fallbacks.get(op, 0) + 1
        if op not in self._warned_ops:
            self._warned_ops.add(op)
            logger.warning(
                "op %r: no tuned pick for this shape (%s); using %s with the fallback tactic -1. "
                "Tune it by running the workload under graphtune.autotune() before serving. "
                "Further misses of this op are counted in stats.fallbacks only.",
                op,
                why,
                type(runners[0]).__qualname__,
            )
        return runners[0], FALLBACK_TACTIC

    # -- tuning ---------------------------------------------------------------------------------

    def _timer_for(self, config: TuningConfig, device: torch.device) -> Timer:
        if self.timer is not None:
            return self.timer
        slot = (config.timing, str(device))
        if slot not in self._timers:
            from graphtune.autotuner.timing import resolve_timer

            self._timers[slot] = resolve_timer(config.timing, device)
        return self._timers[slot]

    def _input_sets(
        self, config: TuningConfig, inputs: list[Any], profile: Profile, device: torch.device
    ) -> list[list[Any]]:
        first = synthesize_inputs(config, inputs, profile)
        if not config.cold_l2:
            return [first]
        from graphtune.autotuner import timing

        copies = max(1, int(timing.cold_l2_copies(input_bytes(first), device)))
        return [first] + [
            synthesize_inputs(config, inputs, profile, seed=1000 * k) for k in range(1, copies)
        ]

    def _executor(
        self, config: TuningConfig, device: torch.device
    ) -> InProcessExecutor | SubprocessExecutor:
        if self.isolation.mode == "inprocess":
            return InProcessExecutor(self._timer_for(config, device), device)
        worker = self._worker
        if worker is None or worker.key != (config.timing, str(device)):
            self.close()
            worker = SubprocessExecutor(self.isolation, self.timer, config.timing, device)
            self._worker = worker
        return worker

    def _candidates(
        self,
        op: str,
        runners: list[TunableRunner],
        ids: tuple[str, ...],
        inputs: list[Any],
        profile: Profile,
    ) -> list[_Candidate]:
        candidates: list[_Candidate] = []
        for ri, runner in enumerate(runners):
            try:
                tactics = list(runner.get_valid_tactics(inputs, profile))
            except Exception as exc:  # a broken runner is data, not a crash (principle 5)
                self._record_failure(op, runner, "get_valid_tactics", exc)
                tactics = []
            if ri == 0 and FALLBACK_TACTIC not in tactics:
                # The untuned choice is always timed: it is the baseline of the speed-up.
                tactics.insert(0, FALLBACK_TACTIC)
            for ti, tactic in enumerate(tactics):
                blocked = self.cache.blocked(ids[ri], tactic)
                if blocked is not None:  # crashed or hung before: never run it again
                    self.stats.tactics_blocked += 1
                    logger.info(
                        "op %r: skipping blocklisted %s tactic %s (%s); clear it with "
                        "`graphtune cache unblock FILE` to retry",
                        op, short_runner_name(ids[ri]), _tactic_text(tactic), blocked.reason,
                    )
                    continue
                candidates.append(_Candidate(ri, runner, ti, tactic))
        return candidates

    def _tune_op(
        self,
        op: str,
        runners: list[TunableRunner],
        ids: tuple[str, ...],
        config: TuningConfig,
        inputs: list[Any],
        device: torch.device,
        mode: str,
    ) -> None:
        start = time.perf_counter()
        coord = OpCoordinator(self.distributed or DistributedTuning(), op, ids)
        executor = self._executor(config, device)
        profiles = [(p, self._key(op, ids, p, mode)) for p in generate_profiles(config, inputs)]
        keys = [k for _, k in profiles]
        todo = coord.profiles_to_tune(keys, [k in self.cache for k in keys])
        plans = []
        for (profile, key), tune in zip(profiles, todo, strict=True):
            if not tune:
                continue
            first = synthesize_inputs(config, inputs, profile)
            plans.append((profile, key, self._candidates(op, runners, ids, first, profile)))
        total = sum(len(cands) for _, _, cands in plans) * self.rounds
        first_row = len(self._summary)
        starts = executor.starts
        try:
            with progress(f"tuning {op}", total, enabled=self.show_progress) as bar:
                for profile, key, candidates in plans:
                    sets = self._input_sets(config, inputs, profile, device)
                    executor.begin(runners, sets)
                    entry = self._tune_profile(
                        op, ids, config, executor, profile, candidates, bar, coord, len(sets)
                    )
                    if self.distributed is not None:
                        entry = replace(entry, tuned_by=coord.provenance)
                    self.cache.put(key, entry)
                    self.stats.profiles_tuned += 1
                    self._summary.append(self._row(op, profile, entry))
        finally:
            self.stats.workers_started += executor.starts - starts
        elapsed = time.perf_counter() - start
        self.stats.tuning_seconds += elapsed
        if len(self._summary) > first_row:
            # One line per op at INFO; autotune() logs the table of all picks when it exits.
            tuned = len(self._summary) - first_row
            logger.info("tuned %s: %d buckets in %.2f s", op, tuned, elapsed)
            table = render_table(f"autotuned {op}", SUMMARY_COLUMNS, self._summary[first_row:])
            logger.debug("%s", table)

    def _tune_profile(
        self,
        op: str,
        ids: tuple[str, ...],
        config: TuningConfig,
        executor: InProcessExecutor | SubprocessExecutor,
        profile: Profile,
        candidates: list[_Candidate],
        bar: ProgressTask,
        coord: OpCoordinator,
        n_sets: int,
    ) -> CacheEntry:
        label = f"{op} [{profile.describe()}]"
        # With rotated copies, one sample must walk through all of them, or the few it touches
        # stay in L2 (a graph timer replays the same ``repeat`` calls).
        repeat = max(config.repeat, n_sets) if n_sets > 1 else config.repeat

        def time_here(cands: list[Any]) -> None:
            self._time_candidates(op, ids, config, executor, cands, bar, repeat, label)

        # The seam of distributed tuning: which candidates this rank times, and the agreed times.
        candidates = coord.run(candidates, time_here)  # type: ignore[arg-type,assignment]
        fallback = next(
            (c for c in candidates if c.runner_index == 0 and c.tactic == FALLBACK_TACTIC), None
        )
        fallback_us = fallback.score if fallback is not None else math.inf
        fallback_us_or_none = fallback_us if math.isfinite(fallback_us) else None
        winner = self._pick(candidates)
        if winner is None:
            logger.warning(
                "op %r [%s]: every (runner, tactic) failed; using the fallback %s tactic -1. "
                "See the earlier warnings for the errors.",
                op,
                profile.describe(),
                short_runner_name(ids[0]),
            )
            return CacheEntry(ids[0], 0, FALLBACK_TACTIC, None, fallback_us_or_none)
        return CacheEntry(
            ids[winner.runner_index],
            winner.runner_index,
            winner.tactic,
            winner.score,
            fallback_us_or_none,
        )

    def _time_candidates(
        self,
        op: str,
        ids: tuple[str, ...],
        config: TuningConfig,
        executor: InProcessExecutor | SubprocessExecutor,
        candidates: list[_Candidate],
        bar: ProgressTask,
        repeat: int,
        label: str,
    ) -> None:
        """Prepares and times ``candidates`` in this process, interleaved, the top few again."""
        for cand in candidates:
            try:
                executor.prepare(cand.runner_index, cand.runner, cand.tactic)
            except TacticFailure as failure:  # recorded as a failed tactic; tuning goes on
                self._fail(op, cand, "prepare", failure, ids, label)
        for _ in range(self.rounds):
            for cand in candidates:
                if cand.failed is None:
                    self._measure(op, executor, config, cand, repeat, ids, label)
                bar.advance(label)
        alive = sorted(
            (c for c in candidates if c.failed is None), key=lambda c: (c.score, c.order)
        )
        top = alive[: self.remeasure_top]
        if len(top) > 1:
            for _ in range(self.rounds):
                for cand in top:
                    if cand.failed is None:
                        self._measure(op, executor, config, cand, repeat, ids, label)
        self.stats.tactics_timed += sum(1 for c in candidates if c.failed is None and c.samples)

    def _measure(
        self,
        op: str,
        executor: InProcessExecutor | SubprocessExecutor,
        config: TuningConfig,
        cand: _Candidate,
        repeat: int,
        ids: tuple[str, ...],
        label: str,
    ) -> None:
        self.stats.measurements += 1
        try:
            value = executor.measure(
                cand.runner_index, cand.runner, cand.tactic, warmup=config.warmup, repeat=repeat
            )
        except TacticFailure as failure:  # a failing tactic is data: infinite time, counted
            self._fail(op, cand, "timing", failure, ids, label)
            return
        cand.samples.append(value)

    def _pick(self, candidates: list[_Candidate]) -> _Candidate | None:
        alive = [c for c in candidates if c.failed is None and c.samples]
        if not alive:
            return None
        best = min(c.score for c in alive)
        tied = [c for c in alive if c.score <= best * (1.0 + self.tie_tolerance)]
        return min(tied, key=lambda c: c.order)

    def _fail(
        self,
        op: str,
        cand: _Candidate,
        stage: str,
        failure: TacticFailure,
        ids: tuple[str, ...],
        label: str,
    ) -> None:
        cand.failed = failure.reason
        what = f"{stage} of tactic {_tactic_text(cand.tactic)}"
        self._record_failure(op, cand.runner, what, failure)
        if failure.block:
            self.cache.block(
                BlockedTactic(ids[cand.runner_index], cand.tactic, str(failure), op, label)
            )
        if failure.fatal:
            raise TuningError(
                f"op {op!r}: {type(cand.runner).__qualname__} {what} corrupted the CUDA context "
                f"of this process ({failure.detail}). Nothing in this process can use CUDA any "
                "more; the tactic is on the cache's blocklist, which autotune() saves, so a "
                "restarted process skips it. Tune with AutoTuner(isolation='subprocess') to "
                "survive such tactics without restarting."
            )

    def _record_failure(
        self, op: str, runner: TunableRunner, what: str, exc: Exception
    ) -> None:
        if isinstance(exc, TacticFailure):
            reason, detail = exc.reason, exc.detail
        else:
            reason, detail = type(exc).__name__, str(exc)
        self.stats.tactic_failures[reason] = self.stats.tactic_failures.get(reason, 0) + 1
        if (op, reason) in self._logged_failures:
            logger.debug(
                "op %r: %s %s failed: %s: %s", op, type(runner).__qualname__, what, reason, detail
            )
            return
        self._logged_failures.add((op, reason))
        logger.warning(
            "op %r: %s %s failed (%s: %s); it counts as infinitely slow and tuning goes on. "
            "Further %s failures of this op are counted in stats.tactic_failures only.",
            op,
            type(runner).__qualname__,
            what,
            reason,
            detail,
            reason,
        )

    @staticmethod
    def _row(op: str, profile: Profile, entry: CacheEntry) -> tuple[Any, ...]:
        winner = f"{short_runner_name(entry.runner_id)} tactic={_tactic_text(entry.tactic)}"
        return (op, profile.describe(), winner, entry.time_us, entry.fallback_us, entry.speedup)


_default_tuner: AutoTuner | None = None
_default_lock = threading.Lock()


def get_tuner() -> AutoTuner:
    """The process-default :class:`AutoTuner` (created on first use)."""
    global _default_tuner
    with _default_lock:
        if _default_tuner is None:
            _default_tuner = AutoTuner()
        return _default_tuner


@contextmanager
def autotune(
    cache_path: str | PathLike[str] | None = None,
    tuner: AutoTuner | None = None,
    *,
    strict: bool | None = None,
    distributed: str | DistributedTuning | None = None,
) -> Iterator[AutoTuner]:
    """Turns tuning on for the block; loads the cache file before and saves it after.

    Args:
        cache_path: Cache file; ``None`` uses ``GRAPHTUNE_CACHE`` (no file when that is unset).
        tuner: The tuner to use; the process default when ``None``.
        strict: Passed to the cache load (raise on an unusable file instead of warning).
        distributed: A distributed tuning strategy for the block (replaces the tuner's own
            ``distributed`` until the block ends); ``None`` keeps the tuner's.

    Yields:
        The tuner, in tuning mode.
    """
    tuner = tuner if tuner is not None else get_tuner()
    path = cache_path if cache_path is not None else env.default_cache_path()
    if path is not None:
        tuner.cache.load(path, strict=strict)
    previous, previous_dist = tuner.tuning_mode, tuner.distributed
    if distributed is not None:
        tuner.distributed = DistributedTuning.resolve(distributed)
    first_row = len(tuner.summary_rows())
    tuner.tuning_mode = True
    try:
        yield tuner
    except BaseException:
        tuner.tuning_mode, tuner.distributed = previous, previous_dist
        tuner.close()
        if path is not None:
            _save_quietly(tuner, path)  # keep what was tuned before the error, without masking it
        raise
    tuner.tuning_mode, tuner.distributed = previous, previous_dist
    tuner.close()
    rows = tuner.summary_rows()[first_row:]
    if rows:
        logger.info("%s", render_table("graphtune autotuning picks", SUMMARY_COLUMNS, rows))
    if path is not None:
        tuner.cache.save(path)


def _save_quietly(tuner: AutoTuner, path: str | PathLike[str]) -> None:
    try:
        tuner.cache.save(path)
    except CacheFileError as exc:
        logger.warning("could not save the tuning cache after an error: %s", exc)
