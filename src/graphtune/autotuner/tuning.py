"""One op's tuning run: every missing profile (bucket combination) timed and decided.

:class:`TuningRun` is made by ``AutoTuner.choose_one`` on a miss in tuning mode and holds what
the run needs (the op, its runners and config, the executor, the distributed coordinator, the
policy); the tuner stores what each profile decided through ``on_profile``. The run:

1. synthesizes one input set per missing profile and asks every runner for its valid tactics
   there (blocklisted ones are dropped, and the fallback ``-1`` is a candidate only where a
   runner lists it);
2. lets each runner prepare all its tactics of all profiles at once (``prepare_all``: Triton
   runners compile them in parallel), untimed;
3. per profile: candidates blocklisted since planning (a crash or hang in an earlier profile)
   are dropped; a lone candidate is picked without timing (there is nothing to choose); else
   the candidates are prepared and timed by the schedule of :mod:`graphtune.autotuner.schedule`
   and the rule of :mod:`graphtune.autotuner.selection`. A profile where every candidate failed
   is *not* cached (a later run retries it); when they all failed with one and the same
   ``TypeError``, the runner's signature is wrong and a :class:`~graphtune.errors.ConfigError`
   says so instead.

Faults are data (docs/design.md, principle 5): a tactic that raises, hangs, crashes or returns a
garbage time (NaN, inf, <= 0) counts as infinitely slow, with its reason counted in
``TunerStats.tactic_failures``. Tactics that crashed, hung or corrupted the CUDA context go on the
cache's blocklist.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from graphtune import env
from graphtune.autotuner.blocked import drop_blocked
from graphtune.autotuner.cache import TuningCache
from graphtune.autotuner.config import TuningConfig, calls_per_sample
from graphtune.autotuner.distributed import OpCoordinator
from graphtune.autotuner.entries import BlockedTactic, CacheEntry, CacheKey, tactic_text
from graphtune.autotuner.failures import FailureLog
from graphtune.autotuner.identity import short_runner_name
from graphtune.autotuner.isolation import Executor, TacticFailure
from graphtune.autotuner.policy import TuningPolicy
from graphtune.autotuner.profiles import (
    Profile,
    generate_profiles,
    input_sets,
    profile_bytes,
    static_inputs_memo,
    synthesize_inputs,
)
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.autotuner.runner_contract import signature_error, tactic_list, takes
from graphtune.autotuner.schedule import (
    Candidate,
    conclude,
    interleave,
    race,
    record,
    remeasure_top,
    select,
)
from graphtune.autotuner.selection import ProfileRecord
from graphtune.autotuner.stats import TunerStats
from graphtune.autotuner.timing.cold_l2 import device_memory_bytes
from graphtune.autotuner.values import encode_value
from graphtune.errors import ConfigError, DistributedError, TuningError
from graphtune.reporting import ProgressTask, progress

logger = logging.getLogger(__name__)

#: Bytes all input sets of one profile may take together (``TuningPolicy.input_sets``): sets
#: past the first are only made while they fit, so a large weight is not copied several times.
INPUT_SET_BYTES = 1 << 30


@dataclass
class ProfileOutcome:
    """What one profile decided: its key and pick (``None`` when every candidate failed, which is
    not cached) and the record of what was measured."""

    profile: Profile
    key: CacheKey
    entry: CacheEntry | None
    record: ProfileRecord


@dataclass
class _Plan:
    profile: Profile
    key: CacheKey
    first: list[Any]
    candidates: list[Candidate]


@dataclass
class TuningRun:
    """One op's tuning (see the module docstring). Fields are what the run reads and writes.

    Attributes:
        op: Op name.
        runners: The op's runners.
        ids: Their identities.
        config: The op's tuning config.
        inputs: The live inputs.
        kwargs: ``choose_one``'s keyword arguments, passed to ``get_valid_tactics`` and
            ``forward``.
        device: Device of the inputs.
        make_key: The cache key of a profile.
        policy: Measurement and tie knobs.
        cache: Consulted for what is cached and blocklisted; blocked tactics are added to it.
        executor: Where tactics are prepared and timed.
        coordinator: How ranks share the work (non-distributed: an ``independent`` one).
        stats: Counters to update.
        failures: The failure counter and once-per-reason warnings.
        on_profile: Receives each profile's outcome as soon as it is decided.
        clock: Seconds, for the time accounting in ``stats``.
        show_progress: Force the progress bar on or off; ``None`` decides from the terminal.
        only: Tune just this profile key (if it is missing) instead of every missing profile.
    """

    op: str
    runners: list[TunableRunner]
    ids: tuple[str, ...]
    config: TuningConfig
    inputs: list[Any]
    kwargs: dict[str, Any]
    device: torch.device
    make_key: Callable[[Profile], CacheKey]
    policy: TuningPolicy
    cache: TuningCache
    executor: Executor
    coordinator: OpCoordinator
    stats: TunerStats
    failures: FailureLog
    on_profile: Callable[[ProfileOutcome], None]
    clock: Callable[[], float]
    show_progress: bool | None = None
    only: CacheKey | None = None
    failed: Container[CacheKey] = frozenset()  # not tuned again in this process
    _synthesized: dict[Any, Any] = field(default_factory=dict)

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            seconds = self.stats.phase_seconds
            seconds[name] = seconds.get(name, 0.0) + self.clock() - start

    def run(self) -> int:
        """Tunes the missing profiles; returns how many were decided.

        Raises:
            ConfigError: A ``GRAPHTUNE_*`` on/off variable has a value that is neither on nor
                off (read by the kernels' launches, it would fail every tactic as a tactic
                failure, and the torch picks would be saved).
        """
        env.check_switches()
        start = self.clock()
        failure: Exception | None = None
        plans: list[_Plan] = []
        try:
            plans = self.plan()
            with self._phase("prepare"):
                self._prepare_all(plans)
        except DistributedError:
            raise  # raised alike on every rank by a collective: no rank is left waiting
        except Exception as exc:  # joins the other ranks before raising (principle 7)
            failure = exc
        self.coordinator.join(failure, "listing or preparing its tactics")
        total = sum(len(p.candidates) for p in plans) * self.policy.rounds
        starts = self.executor.starts
        try:
            with progress(f"tuning {self.op}", total, enabled=self.show_progress) as bar:
                for plan in plans:
                    self.on_profile(self._tune_profile(plan, bar))
        finally:
            self.executor.end()
            self.stats.workers_started += self.executor.starts - starts
            self.stats.tuning_seconds += self.clock() - start
        return len(plans)

    def plan(self, *, local: bool = False) -> list[_Plan]:
        """The missing profiles with their first input set and candidates. ``local``: what is
        missing here, without asking the other ranks (no collective) or counting failures and
        blocklist skips (the tuning run that follows counts them)."""
        profiles = [(p, self.make_key(p)) for p in generate_profiles(self.config, self.inputs)]
        if self.only is not None:
            profiles = [(p, k) for p, k in profiles if k == self.only]
        keys = [k for _, k in profiles]
        cached = [k in self.cache or k in self.failed for k in keys]
        todo = [not c for c in cached] if local else self.coordinator.profiles_to_tune(keys, cached)
        tuned = [p for (p, _), t in zip(profiles, todo, strict=True) if t]
        self._synthesized = static_inputs_memo(tuned)
        plans = []
        memory = device_memory_bytes(self.device)
        for (profile, key), tune in zip(profiles, todo, strict=True):
            needed = profile_bytes(self.inputs, profile) if tune else 0
            if needed > memory:
                self._skip_oversized(profile, key, needed, memory)
            elif tune:
                with self._phase("inputs"):
                    first = synthesize_inputs(
                        self.config, self.inputs, profile, memo=self._synthesized
                    )
                with self._phase("tactics"):
                    candidates = self._candidates(first, profile, count=not local)
                plans.append(_Plan(profile, key, first, candidates))
        return plans

    def _skip_oversized(self, profile: Profile, key: CacheKey, needed: int, memory: int) -> None:
        """A profile whose inputs cannot exist on the device (a mapper's far-off bucket) is not
        tuned, as one whose candidates all failed: look-ups run the fallback."""
        self.stats.profiles_failed += 1
        record = ProfileRecord(self.op, profile.describe(), (), None, 0.0)
        self.on_profile(ProfileOutcome(profile, key, None, record))
        if (self.op, "oversized") not in self.failures.logged:
            self.failures.logged.add((self.op, "oversized"))
            logger.warning(
                "op %r [%s]: its inputs need %.3g GiB, more than the %.3g GiB of %s, so it is not "
                "tuned (look-ups run the fallback). A DynamicTensorSpec's buckets or map_to_bucket "
                "gave this size; cap them with TuningConfig(max_value=...).",
                self.op,
                profile.describe(),
                needed / 2**30,
                memory / 2**30,
                self.device,
            )

    def prepare_work(
        self, plans: list[_Plan]
    ) -> list[tuple[TunableRunner, list[tuple[list[Any], list[Any]]]]]:
        """Per runner, the ``(inputs, tactics)`` its ``prepare_all`` gets (profiles with a lone
        candidate are left out: it is not timed)."""
        out = []
        for ri, runner in enumerate(self.runners):
            work = []
            for plan in plans:
                tactics = [c.tactic for c in plan.candidates if c.runner_index == ri]
                if tactics and len(plan.candidates) > 1:
                    work.append((plan.first, tactics))
            if work:
                out.append((runner, work))
        return out

    # -- candidates ----------------------------------------------------------------------------

    def _candidates(self, inputs: list[Any], profile: Profile, *, count: bool) -> list[Candidate]:
        """The profile's candidates. ``count``: count and warn failures and blocklisted tactics
        (off for a look-ahead such as ``AutoTuner.prepare``: the tuning run counts them)."""
        candidates: list[Candidate] = []
        for ri, runner in enumerate(self.runners):
            try:
                tactics = tactic_list(
                    runner, runner.get_valid_tactics(inputs, profile, **self.kwargs)
                )
            except Exception as exc:  # a broken runner is data (docs/design.md, principle 5)
                if isinstance(exc, TypeError) and not takes(
                    runner.get_valid_tactics, inputs, profile, **self.kwargs
                ):
                    raise signature_error(
                        f"op {self.op!r}", runner, "get_valid_tactics", self.kwargs
                    ) from None
                if count:
                    self.failures.add(self.op, runner, "get_valid_tactics", exc)
                continue
            if not tactics and getattr(runner, "requires_tactic", False):
                raise TuningError(
                    f"op {self.op!r} [{profile.describe()}]: {type(runner).__qualname__}"
                    ".get_valid_tactics returned no tactic, but the runner declares "
                    "requires_tactic = True. Loosen its pruning rules for this shape, or set "
                    "requires_tactic = False if the runner may not apply to it."
                )
            for ti, tactic in enumerate(tactics):
                try:
                    encode_value(tactic)  # what the cache file will store, checked now
                except (TypeError, ValueError) as exc:
                    # A pick the cache cannot store would make the whole save fail at the end.
                    problem = ConfigError(f"tactic {tactic!r} cannot be stored in a cache: {exc}")
                    if count:
                        self.failures.add(self.op, runner, "get_valid_tactics", problem)
                    continue
                candidates.append(Candidate(ri, runner, ti, tactic))
        return drop_blocked(
            self.op, self.cache, self.ids, candidates, self.stats if count else None
        )

    def _prepare_all(self, plans: list[_Plan]) -> None:
        for runner, work in self.prepare_work(plans):
            try:
                self.executor.prepare_all(runner, work)
            except TacticFailure as failure:  # each tactic's own prepare reports it again
                if failure.fatal:
                    raise TuningError(
                        f"op {self.op!r}: {type(runner).__qualname__}.prepare_all corrupted the "
                        f"CUDA context of this process ({failure.detail}); restart the process."
                    ) from None
                logger.warning(
                    "op %r: %s.prepare_all failed (%s); tactics are prepared one at a time",
                    self.op,
                    type(runner).__qualname__,
                    failure,
                )

    # -- one profile ---------------------------------------------------------------------------

    def _tune_profile(self, plan: _Plan, bar: ProgressTask) -> ProfileOutcome:
        start = self.clock()
        label = f"{self.op} [{plan.profile.describe()}]"
        failure: Exception | None = None
        repeat = 1
        try:  # may fail on one rank alone (an inputs_pre_hook, memory): every rank joins
            repeat = self._begin_profile(plan, bar, label)
        except Exception as exc:
            failure = exc
        self.coordinator.join(failure, f"making the input sets of [{plan.profile.describe()}]")
        # Collective strategies leave one agreed time per candidate: no band to refine.
        adaptive = not self.coordinator.setting.collective

        def time_here(cands: list[Candidate]) -> None:
            try:  # closing the timer sessions may fail too: inside the collective's join
                self._time_candidates(cands, bar, repeat, label, adaptive)
            finally:
                self.executor.end()

        # The seam of distributed tuning: which candidates this rank times, and the agreed times.
        # Everything below uses only what coord.run left, identical on every rank.
        candidates = self.coordinator.run(
            plan.candidates, time_here, skip_single=True, cache=self.cache
        )
        self.executor.end()
        with self._phase("select"):
            return self._decide(plan, candidates, self.clock() - start, label)

    def _begin_profile(self, plan: _Plan, bar: ProgressTask, label: str) -> int:
        """A profile's input sets and executor set-up; returns the calls per sample."""
        with self._phase("inputs"):
            sets = input_sets(
                self.config,
                self.inputs,
                plan.profile,
                self.device,
                self.policy.input_sets,
                INPUT_SET_BYTES,
                first=plan.first,
                memo=self._synthesized,
            )
        # A tactic that crashed or hung in an earlier profile of this run is blocklisted by now.
        planned = plan.candidates
        plan.candidates = drop_blocked(self.op, self.cache, self.ids, planned, self.stats)
        if len(planned) > len(plan.candidates):
            bar.advance(label, (len(planned) - len(plan.candidates)) * self.policy.rounds)
        self.executor.begin(
            self.runners, sets, rotate_in_call=self.config.cold_l2, kwargs=self.kwargs
        )
        return calls_per_sample(self.config, len(sets), self.executor.sizes_samples)

    def _decide(
        self, plan: _Plan, candidates: list[Candidate], seconds: float, label: str
    ) -> ProfileOutcome:
        profile, ids = plan.profile, self.ids
        ordered, chosen = select(candidates, self.policy.tie_rule)
        lone = len(candidates) == 1 and not candidates[0].samples and not candidates[0].failed
        if lone:  # nothing to choose: picked without timing
            only = candidates[0]
            self.stats.untimed_picks += 1
            chosen = type(chosen)(0, 0, (True,), (), chosen.tie_band)
            entry = CacheEntry(ids[only.runner_index], only.runner_index, only.tactic, None, None)
            rec = record(self.op, profile.describe(), ids, ordered, chosen, seconds)
            return ProfileOutcome(profile, plan.key, entry, rec)
        rec = record(self.op, profile.describe(), ids, ordered, chosen, seconds)
        winner = ordered[chosen.winner] if chosen.winner is not None else None
        if winner is None:
            self._check_signature(candidates, label)
            self.stats.profiles_failed += 1
            if (self.op, "every candidate") not in self.failures.logged:
                self.failures.logged.add((self.op, "every candidate"))
                logger.warning(
                    "%s: %s; nothing is cached, so look-ups run the fallback %s tactic -1 and a "
                    "later tuning run tries again. Further such profiles of this op are counted "
                    "in stats.profiles_failed only.",
                    label,
                    "every (runner, tactic) failed (see the earlier warnings for the errors)"
                    if candidates
                    else "no runner offers a tactic for this shape",
                    short_runner_name(ids[0]),
                )
            return ProfileOutcome(profile, plan.key, None, rec)
        self.stats.profiles_tuned += 1
        fallback = next(
            (c for c in candidates if c.runner_index == 0 and c.tactic == FALLBACK_TACTIC), None
        )
        fallback_us = fallback.score if fallback is not None else math.inf
        entry = CacheEntry(
            ids[winner.runner_index],
            winner.runner_index,
            winner.tactic,
            winner.score,
            fallback_us if math.isfinite(fallback_us) else None,
        )
        return ProfileOutcome(profile, plan.key, entry, rec)

    def _check_signature(self, candidates: list[Candidate], label: str) -> None:
        """Every candidate failed: if a runner's ``forward`` cannot take the call graphtune makes
        (its signature, not a ``TypeError`` raised inside it), say so instead of tuning on."""
        if self.coordinator.setting.collective:
            return  # other ranks' candidates are not known here; stay rank-consistent
        for c in candidates:
            if not takes(c.runner.forward, self.inputs, tactic=c.tactic, **self.kwargs):
                raise signature_error(label, c.runner, "forward", self.kwargs)

    # -- timing --------------------------------------------------------------------------------

    def _time_candidates(
        self,
        candidates: list[Candidate],
        bar: ProgressTask,
        repeat: int,
        label: str,
        adaptive: bool,
    ) -> None:
        """Prepares and times ``candidates`` in this process, interleaved, the top few again,
        then (``adaptive``) the fastest and the undecided ones until they are decided (and
        raced-out ones again where the race's premise broke: ``schedule.conclude``)."""
        with self._phase("prepare"):
            for cand in candidates:
                try:
                    self.executor.prepare(cand.runner_index, cand.runner, cand.tactic)
                except TacticFailure as failure:  # recorded as a failed tactic; tuning goes on
                    self._fail(cand, "prepare", failure, label)

        def measure(cand: Candidate) -> None:
            self._measure(cand, repeat, label)

        policy = self.policy

        def advance() -> None:  # one progress step per candidate and round
            bar.advance(label)

        interleave(candidates, measure, 1, advance)
        # Collective strategies need every rank to measure the same candidates: no racing.
        racing = race(candidates, policy.race_margin if adaptive else 0.0, policy.tie_rule)
        self.stats.raced_out += sum(1 for c in candidates if c.failed is None) - len(racing)
        for _ in range(policy.rounds - 1):
            interleave(racing, measure, 1, advance)
            bar.advance(label, len(candidates) - len(racing))
        remeasure_top(racing, measure, policy.remeasure_top, policy.rounds)
        if adaptive:  # settle; a raced-out candidate the leader's median fell behind is re-timed
            extra, retimed = conclude(candidates, measure, policy)
            self.stats.extra_rounds += extra
            self.stats.retimed += retimed
            self.stats.raced_out -= retimed  # no longer measured once
            if extra:
                logger.debug("%s: %d extra round(s) to decide near-ties", label, extra)
        self.stats.tactics_timed += sum(1 for c in candidates if c.failed is None and c.samples)

    def _measure(self, cand: Candidate, repeat: int, label: str) -> None:
        self.stats.measurements += 1
        try:
            with self._phase("measure"):
                value = self.executor.measure(
                    cand.runner_index,
                    cand.runner,
                    cand.tactic,
                    warmup=self.config.warmup,
                    repeat=repeat,
                    sample=len(cand.samples),
                    tactic_index=cand.tactic_index,
                )
        except TacticFailure as failure:  # a failing tactic is data: infinite time, counted
            self._fail(cand, "timing", failure, label)
            return
        cand.samples.append(value)

    def _fail(self, cand: Candidate, stage: str, failure: TacticFailure, label: str) -> None:
        cand.failed = failure.reason
        what = f"{stage} of tactic {tactic_text(cand.tactic)}"
        self.failures.add(self.op, cand.runner, what, failure)
        if failure.block:
            self.cache.block(
                BlockedTactic(
                    self.ids[cand.runner_index], cand.tactic, str(failure), self.op, label
                )
            )
        if failure.fatal:
            raise TuningError(
                f"op {self.op!r}: {type(cand.runner).__qualname__} {what} corrupted the CUDA "
                f"context of this process ({failure.detail}). Nothing in this process can use "
                "CUDA any more; the tactic is on the cache's blocklist, which autotune() saves, "
                "so a restarted process skips it. Tune with AutoTuner(isolation='subprocess') to "
                "survive such tactics without restarting."
            )
