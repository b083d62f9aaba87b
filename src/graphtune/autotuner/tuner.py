"""AutoTuner.choose_one: look a pick up, or tune every profile of the op and cache the picks.

Outside tuning mode ``choose_one`` is a dictionary look-up. Inside it, a miss tunes every profile
of the op (bucket combination) at once: each (runner, tactic) is timed on synthetic inputs by the
timer that was passed in (or the one ``TuningConfig.timing`` names), and the pick is cached.

Noise handling, so that repeated tuning runs pick the same tactic:

* candidates are measured interleaved (round-robin over all of them for ``rounds`` rounds), so a
  slow drift of clocks or temperature hits every candidate alike instead of whichever ran last;
* the ``remeasure_top`` fastest are measured ``rounds`` more times, interleaved;
* a candidate's time is the median of its measurements. Another candidate is tied with the
  fastest when its relative gap is at most ``max(tie_tolerance, noise band)``: ``tie_tolerance``
  (default 0.5%) is a floor below which differences never matter, and the noise band is
  ``noise_z`` (default 2) standard errors of the difference of the two medians (robust, from each
  candidate's median absolute deviation), relative to the fastest, capped at
  ``max_tie_tolerance`` (default 5%) so that a very noisy timer cannot tie everything. The rule
  lives in :mod:`graphtune.autotuner.selection`;
* a candidate whose gap is above the floor but inside the band is undecided: it and the fastest
  alone are measured again, interleaved, for up to ``max_extra_rounds`` more rounds, stopping as
  soon as none is undecided, so extra time goes only where it can change the decision;
* an absolute floor ``tie_floor_us`` (default 0.03 µs) ties differences of a few tens of
  nanoseconds on microsecond kernels: CUPTI's own timestamps step by 32 ns on an H200, and the
  order of such near-equal tactics changed from one tuning run to the next;
* with ``input_sets > 1`` (opt-in) the k-th measurement of every candidate times synthetic input
  set ``k % input_sets`` (fresh values and allocations): on an H200 the ranking of near-equal GEMM
  tactics moved by 1-2% between input allocations, which one set per run hides from the noise
  band (``benchmarks/tuning_stability.py``), though 3 sets did not raise 3-of-3 agreement in an
  A/B run there (``benchmarks/results/README.md``);
* the tie goes to the lowest (runner index, tactic index) among the tied: the earliest-listed,
  usually simplest implementation. So a tactic measurably faster than the fallback by more than
  the floor wins, and one whose advantage is inside the noise does not.

The schedule of measurements is :mod:`graphtune.autotuner.schedule`.

Under a collective distributed strategy (``broadcast``, ``parallel``, ``agree``) the ranks reduce
each candidate to one agreed time, which is all the pick may use (it must be the same on every
rank): the band is then 0, only ``tie_tolerance`` applies, and the adaptive rounds are skipped
(they would refine a band the pick does not use). ``independent`` and non-distributed tuning use
the full rule. Every tuned profile appends a :class:`~graphtune.autotuner.selection.ProfileRecord`
of what was measured to ``AutoTuner.history``.

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
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

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
    input_sets,
    profile_for,
    synthesize_inputs,
)
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner, runner_id, short_runner_name
from graphtune.autotuner.schedule import (
    Candidate,
    interleave,
    record,
    remeasure_top,
    select,
    settle,
)
from graphtune.autotuner.selection import ProfileRecord, TieRule
from graphtune.autotuner.timing.base import Timer
from graphtune.errors import ConfigError, TuningError
from graphtune.reporting import ProgressTask, progress, render_table

logger = logging.getLogger(__name__)

#: Bytes all input sets of one profile may take together (``AutoTuner(input_sets=...)``): sets
#: past the first are only made while they fit, so a large weight is not copied several times.
INPUT_SET_BYTES = 1 << 30

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
        extra_rounds: Adaptive rounds run to decide candidates inside the noise band.
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
    extra_rounds: int = 0
    tactic_failures: dict[str, int] = field(default_factory=dict)
    tactics_blocked: int = 0
    workers_started: int = 0
    tuning_seconds: float = 0.0


def _default_is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _device_of(inputs: Sequence[Any]) -> torch.device:
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


_MEMO_LIMIT = 4096


def _memo_key(
    op: str, runners: list[TunableRunner], config: TuningConfig, inputs: list[Any]
) -> tuple[Any, ...] | None:
    """What a cache hit depends on, or ``None`` when an input is not hashable (no memo)."""
    parts: list[Any] = [op, config, *runners]
    for x in inputs:
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), x.dtype, x.device.type))
        elif x is None or isinstance(x, (bool, int, float, str)):
            parts.append(x)
        else:
            return None
    try:
        key = tuple(parts)
        hash(key)
    except TypeError:  # an unhashable config or runner: look up the slow way
        return None
    return key


def _tactic_text(tactic: Any) -> str:
    return json.dumps(tactic, default=str)


class AutoTuner:
    """Picks the fastest (runner, tactic) per op and shape bucket, and remembers it.

    Args:
        timer: Times every candidate; ``None`` resolves one per call from ``TuningConfig.timing``
            and the inputs' device. A timer given here takes precedence over the config.
        rounds: Interleaved measurement rounds over all candidates (and again over the top few).
        remeasure_top: How many of the fastest candidates are measured again.
        tie_tolerance: Relative gap below which a difference never matters (0.005 = 0.5%): the
            floor of the tie threshold. Ties go to the lowest (runner index, tactic index).
        noise_z: Standard errors of the difference of two medians that count as noise (the
            noise band; see the module docstring).
        max_tie_tolerance: Cap of the noise band (0.05 = 5%); ``tie_tolerance`` applies even
            above it.
        max_extra_rounds: Most adaptive rounds over the fastest and the undecided candidates
            (gap above the floor, inside the band); 0 turns them off.
        tie_floor_us: Absolute gap in microseconds per call below which a difference never
            matters (the floor is the larger of this and ``tie_tolerance``; 0.03 = 30 ns);
            0 turns it off.
        input_sets: Distinct synthetic input sets per profile (fresh allocations and values);
            the k-th measurement of every candidate uses set ``k % input_sets``, so a pick does
            not rest on one allocation's luck (see the module docstring). Sets past the first
            are only made while all of them fit in ``INPUT_SET_BYTES``. Cold-L2 timing already
            rotates copies inside every measurement and ignores it.
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

    Attributes:
        cache: The :class:`~graphtune.autotuner.cache.TuningCache` of picks.
        stats: The :class:`TunerStats` counters.
        history: One :class:`~graphtune.autotuner.selection.ProfileRecord` per tuned profile,
            appended in tuning order: every candidate's median time, spread, sample count,
            failure and tie status, the winner and the tie band. It grows by one record per
            tuned profile for the tuner's lifetime; clear it freely.
    """

    def __init__(
        self,
        timer: Timer | None = None,
        *,
        rounds: int = 3,
        remeasure_top: int = 3,
        tie_tolerance: float = 0.005,
        noise_z: float = 2.0,
        max_tie_tolerance: float = 0.05,
        max_extra_rounds: int = 6,
        tie_floor_us: float = 0.03,
        input_sets: int = 1,
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
        bad_extra = isinstance(max_extra_rounds, bool) or not isinstance(max_extra_rounds, int)
        if bad_extra or max_extra_rounds < 0:
            raise ConfigError(
                f"AutoTuner(max_extra_rounds={max_extra_rounds!r}): must be an int >= 0 "
                "(0 turns the adaptive rounds off)."
            )
        bad_sets = isinstance(input_sets, bool) or not isinstance(input_sets, int)
        if bad_sets or input_sets < 1:
            raise ConfigError(
                f"AutoTuner(input_sets={input_sets!r}): must be an int >= 1 (1 times every "
                "candidate on one synthetic input set)."
            )
        TieRule(tie_tolerance, noise_z, max_tie_tolerance, tie_floor_us)  # validates them
        self.isolation = Isolation.resolve(isolation)
        self.distributed = DistributedTuning.resolve(distributed)
        self.timer = timer
        self.rounds = rounds
        self.remeasure_top = remeasure_top
        self.tie_tolerance = float(tie_tolerance)
        self.noise_z = float(noise_z)
        self.max_tie_tolerance = float(max_tie_tolerance)
        self.max_extra_rounds = max_extra_rounds
        self.tie_floor_us = float(tie_floor_us)
        self.input_sets = input_sets
        self.history: list[ProfileRecord] = []
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
        # Hits by exact call signature (op, runners, config, input shapes), valid while the
        # cache's version is unchanged: a decode step asks ~100 times per call, and bucketing
        # plus key building cost tens of microseconds of host time each.
        self._memo: dict[tuple[Any, ...], tuple[TuningCache, int, tuple[TunableRunner, Any]]] = {}
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
        memo_key = _memo_key(op, runners, config, inputs)
        memo = self._memo.get(memo_key) if memo_key is not None else None
        if memo is not None and memo[0] is self.cache and memo[1] == self.cache.version:
            self.stats.hits += 1
            return memo[2]
        ids = tuple(runner_id(r) for r in runners)
        device = _device_of(inputs)
        mode = self._mode_name(config, device)
        key = self._key(op, ids, profile_for(config, inputs), mode)
        found = self._lookup(key, runners)
        if found is not None:
            self.stats.hits += 1
            if memo_key is not None:
                if len(self._memo) >= _MEMO_LIMIT:
                    self._memo.clear()
                self._memo[memo_key] = (self.cache, self.cache.version, found)
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
    ) -> list[Candidate]:
        candidates: list[Candidate] = []
        for ri, runner in enumerate(runners):
            try:
                tactics = list(runner.get_valid_tactics(inputs, profile))
            except (
                Exception
            ) as exc:  # a broken runner is data, not a crash (docs/design.md, principle 5)
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
                        op,
                        short_runner_name(ids[ri]),
                        _tactic_text(tactic),
                        blocked.reason,
                    )
                    continue
                candidates.append(Candidate(ri, runner, ti, tactic))
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
                    sets = input_sets(
                        config, inputs, profile, device, self.input_sets, INPUT_SET_BYTES
                    )
                    executor.begin(runners, sets, rotate_in_call=config.cold_l2)
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
        candidates: list[Candidate],
        bar: ProgressTask,
        coord: OpCoordinator,
        n_sets: int,
    ) -> CacheEntry:
        label = f"{op} [{profile.describe()}]"
        # With rotated copies, one sample must walk through all of them, or the few it touches
        # stay in L2 (a graph timer replays the same ``repeat`` calls).
        repeat = max(config.repeat, n_sets) if config.cold_l2 else config.repeat
        # Collective strategies leave one agreed time per candidate: no band to refine.
        adaptive = not coord.setting.collective

        def time_here(cands: list[Any]) -> None:
            self._time_candidates(op, ids, config, executor, cands, bar, repeat, label, adaptive)

        # The seam of distributed tuning: which candidates this rank times, and the agreed times.
        # Everything below uses only what coord.run left, identical on every rank.
        candidates = coord.run(candidates, time_here)  # type: ignore[arg-type,assignment]
        fallback = next(
            (c for c in candidates if c.runner_index == 0 and c.tactic == FALLBACK_TACTIC), None
        )
        fallback_us = fallback.score if fallback is not None else math.inf
        fallback_us_or_none = fallback_us if math.isfinite(fallback_us) else None
        ordered, chosen = select(candidates, self._rule())
        self.history.append(record(op, profile.describe(), ids, ordered, chosen))
        winner = ordered[chosen.winner] if chosen.winner is not None else None
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
        candidates: list[Candidate],
        bar: ProgressTask,
        repeat: int,
        label: str,
        adaptive: bool = True,
    ) -> None:
        """Prepares and times ``candidates`` in this process, interleaved, the top few again,
        then (``adaptive``) the fastest and the undecided ones until they are decided."""
        for cand in candidates:
            try:
                executor.prepare(cand.runner_index, cand.runner, cand.tactic)
            except TacticFailure as failure:  # recorded as a failed tactic; tuning goes on
                self._fail(op, cand, "prepare", failure, ids, label)

        def measure(cand: Candidate) -> None:
            self._measure(op, executor, config, cand, repeat, ids, label)

        interleave(candidates, measure, self.rounds, lambda: bar.advance(label))
        remeasure_top(candidates, measure, self.remeasure_top, self.rounds)
        if adaptive:
            extra = settle(candidates, measure, self._rule(), self.max_extra_rounds)
            self.stats.extra_rounds += extra
            if extra:
                logger.debug("%s: %d extra round(s) to decide near-ties", label, extra)
        self.stats.tactics_timed += sum(1 for c in candidates if c.failed is None and c.samples)

    def _measure(
        self,
        op: str,
        executor: InProcessExecutor | SubprocessExecutor,
        config: TuningConfig,
        cand: Candidate,
        repeat: int,
        ids: tuple[str, ...],
        label: str,
    ) -> None:
        self.stats.measurements += 1
        try:
            value = executor.measure(
                cand.runner_index,
                cand.runner,
                cand.tactic,
                warmup=config.warmup,
                repeat=repeat,
                sample=len(cand.samples),
            )
        except TacticFailure as failure:  # a failing tactic is data: infinite time, counted
            self._fail(op, cand, "timing", failure, ids, label)
            return
        cand.samples.append(value)

    def _rule(self) -> TieRule:
        return TieRule(self.tie_tolerance, self.noise_z, self.max_tie_tolerance, self.tie_floor_us)

    def _fail(
        self,
        op: str,
        cand: Candidate,
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

    def _record_failure(self, op: str, runner: TunableRunner, what: str, exc: Exception) -> None:
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


def __getattr__(name: str) -> Any:
    # get_tuner and autotune moved to graphtune.autotuner.context, which imports this module;
    # resolved lazily so ``from graphtune.autotuner.tuner import get_tuner`` still works.
    if name in ("get_tuner", "autotune"):
        from graphtune.autotuner import context

        return getattr(context, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
