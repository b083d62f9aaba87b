"""Tuning is running the step: :func:`tune_step` runs the real forward at every batch bucket.

The step's ops look their picks up in the tuner; in tuning mode the first call of an op that
misses tunes every bucket of that op (up to the step's ``max_batch_size``) on synthetic inputs of
the live call's shapes, then runs the pick. Running the real step therefore tunes exactly the keys
the step looks up later (no list of ops kept beside the model), ops nested inside other ops
included. TensorRT-LLM tunes the same way during its warm-up.

Before that, :func:`record_step_calls` runs the step once at its largest batch without tuning
(``AutoTuner.record_calls(dry_run=True)``: nothing is timed or counted) and ``AutoTuner.prepare``
hands the Triton tactics of every missing profile of those calls to the compile worker processes
at once (``ahead=True``; see ``graphtune.ops._compile_pool``), in the order the passes below tune
them: each op's tuning then waits only for its own binaries, and the workers compile the later
ops' while the earlier ones are timed. When no profile of
those calls, nor of the unfused step's calls, is missing at any bucket (a restart with the cache
file), the bucket runs below would tune nothing and are skipped (single-process steps only).

Then the step runs twice per bucket: first with its stages unfused (``OpContext.unfused``), which
tunes every single op (GEMMs, norms, RoPE, SiLU-and-mul, attention) from the live calls; then as
built, which tunes the fused ops (:mod:`graphtune.ops.fused`). A fused op's runner 0 is the
unfused sequence, so timing it needs the single ops' picks: the first pass has put them in the
cache, and the nested look-ups hit. So no op is tuned inside another op's timing, the order of
the tuning collectives is the step's order on every rank whatever the distributed strategy
(``broadcast`` and ``parallel`` time a candidate on one rank only, which a nested tuning would
turn into a collective only that rank enters), and the tuned unfused step (``fused=False``)
finds its picks too.

Last, on CUDA, :func:`check_fusion` times the whole step at every bucket where a fused op picked
its fused kernel and switches each such op to its unfused runner (runner 0) where the step runs
faster that way: the tuner times an op alone, but inside the step a kernel's cost also depends on
its neighbours (with programmatic dependent launch, how much of its start overlaps the kernel
before), so a fused kernel that wins alone can lose in the step.

The calls use :meth:`DecodeStep.example_inputs`: they write only the KV cache's scratch slot.
Every rank of a tensor-parallel group must call this together (the ops' look-ups and the step's
all-reduces are collectives in the same order on every rank).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from graphtune.autotuner.calls import OpCall
from graphtune.autotuner.config import power_of_two_buckets
from graphtune.autotuner.identity import runner_id
from graphtune.autotuner.timing import resolve_timer
from graphtune.autotuner.timing.base import SessionTimer, Timer
from graphtune.engine.step import DecodeStep
from graphtune.engine.step_refine import StepRefinement, refine_in_step, whole_step_inputs
from graphtune.errors import ConfigError
from graphtune.ops._compile_pool import close_compile_workers, start_compile_workers
from graphtune.ops._triton_runner import triton_runners
from graphtune.ops.fused._base import UnfusedRunner

logger = logging.getLogger(__name__)

UNFUSED_MARGIN = 0.01
"""How much faster (relative) the step must run for :func:`check_fusion` to switch a fused op to
its unfused runner; below it the tuner's per-op picks stand."""


@dataclass(frozen=True)
class FusionCheck:
    """The whole-step comparison of :func:`check_fusion` at one batch bucket.

    Attributes:
        batch: The bucket (the step ran at this batch size).
        fused_us: Time per step as tuned.
        unfused_us: Time per step with every fused op on its unfused runner.
        kept_us: Time per step with the picks the check kept.
        pinned: Fused-op profiles switched to their unfused runner.
        candidates: Fused-op profiles whose pick was a fused kernel.
        step_timings: Whole-step timings the check made at this bucket.
    """

    batch: int
    fused_us: float
    unfused_us: float
    kept_us: float
    pinned: int
    candidates: int
    step_timings: int


@dataclass
class TuneReport:
    """What :func:`tune_step` did.

    Attributes:
        buckets: Batch sizes the step ran at (``1, 2, 4, ..., max_batch_size``).
        rows: The tuner's summary rows added by this call (op, bucket, winner, time, ...), one
            per (op, bucket) profile tuned.
        seconds: Wall time of the whole call.
        prepare_seconds: Part of it spent before any timing: recording the untuned step and
            ``AutoTuner.prepare`` (planning every missing profile and handing its Triton tactics
            to the compile workers; runners that cannot compile in the background are compiled
            here).
        prepared: (inputs, tactic) pairs ``prepare`` planned.
        bucket_runs_seconds: Part of it spent running the step at every bucket in tuning mode
            (where the ops are timed and picked).
        check_seconds: Part of it spent by the whole-step passes after the bucket runs
            (:func:`check_fusion` and ``refine``).
        compile_seconds: Compile time of the Triton runners during the call, summed over runners
            (several runners compile side by side, so this can exceed the call's wall time);
            with the compile workers, most of it is waiting for binaries compiled ahead.
        compile_seconds_by_op: That compile time per op name (ops that compiled nothing are left
            out).
        fusion_checks: :func:`check_fusion`'s comparisons, one per bucket where a fused op had
            picked its fused kernel (empty when the check did not run).
        refinements: What ``refine=True`` raced in the step
            (:func:`~graphtune.engine.step_refine.refine_in_step`), one per profile.
    """

    buckets: tuple[int, ...]
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    seconds: float = 0.0
    prepare_seconds: float = 0.0
    prepared: int = 0
    bucket_runs_seconds: float = 0.0
    check_seconds: float = 0.0
    compile_seconds: float = 0.0
    compile_seconds_by_op: dict[str, float] = field(default_factory=dict)
    fusion_checks: list[FusionCheck] = field(default_factory=list)
    refinements: list[StepRefinement] = field(default_factory=list)

    @property
    def profiles_tuned(self) -> int:
        """(op, bucket) profiles tuned by this call."""
        return len(self.rows)

    def summary(self) -> str:
        """One line for people: profiles, seconds, the up-front part and compile time by op."""
        line = (
            f"{self.profiles_tuned} (op, bucket) profiles tuned in {self.seconds:.1f} s "
            f"({self.prepare_seconds:.1f} s preparing {self.prepared} tactics up front) for "
            f"batch buckets {list(self.buckets)}"
        )
        if self.compile_seconds_by_op:
            parts = ", ".join(
                f"{op} {seconds:.1f} s"
                for op, seconds in sorted(self.compile_seconds_by_op.items())
            )
            line += f"; compiling by op: {parts}"
        if self.fusion_checks:
            switched = {c.batch: f"{c.pinned}/{c.candidates}" for c in self.fusion_checks}
            line += f"; whole-step check, fused profiles switched to unfused by batch: {switched}"
        if self.refinements:
            kept = sum(r.switched for r in self.refinements)
            line += f"; in-step refinement: {kept} of {len(self.refinements)} picks replaced"
        return line


def describe_tuning(tuner: Any, report: TuneReport | None) -> str:
    """What tuning did (``report``, ``None`` for look-ups only) and how the step's look-ups in
    ``tuner`` (``None``: an untuned step) went, for people: ``Engine.tuning_report()``."""
    if tuner is None:
        return "tuning: off (untuned torch decode step)"
    stats = tuner.stats
    summary = report.summary() if report is not None else None
    lines = [f"tuning: {summary}" if summary else "tuning: look-ups only (tune=False)"]
    lines.append(f"look-ups: {stats.hits} hits, {stats.misses} misses")
    if stats.fallbacks:
        ops = ", ".join(f"{op}: {n}" for op, n in sorted(stats.fallbacks.items()))
        lines.append(f"untuned shapes ran the torch fallback: {ops}")
    else:
        lines.append("no fallbacks: every look-up found a tuned pick")
    if stats.tactic_failures:
        lines.append(f"failed tactics while tuning: {dict(stats.tactic_failures)}")
    return "\n".join(lines)


def _require_tuner(step: DecodeStep, what: str) -> Any:
    if step.tuner is None:
        raise ConfigError(
            f"{what} needs a step built with a tuner (build_step(model, cache, tuner=AutoTuner()) "
            "or Engine(..., tune=True)); an untuned step runs the torch fallbacks only"
        )
    return step.tuner


def record_step_calls(
    step: DecodeStep, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
) -> list[OpCall]:
    """The op calls of one step, in call order.

    The step runs once on ``inputs`` (``(tokens, positions, slots)``; default
    ``step.example_inputs(step.max_batch_size)``, which write only the scratch slot) with its
    tuner recording in dry-run mode (``AutoTuner.record_calls(dry_run=True)``): every op runs
    its cached pick or its fallback, nothing is tuned, and the tuner's stats and misses are left
    as they were. A fused op that falls back runs its unfused ops, whose calls are recorded too.

    Raises:
        ConfigError: ``step`` has no tuner.
    """
    tuner = _require_tuner(step, "record_step_calls")
    args = inputs if inputs is not None else step.example_inputs(step.max_batch_size)
    with torch.no_grad(), tuner.record_calls(dry_run=True) as calls:
        step(*args)
    return calls


def tune_step(
    step: DecodeStep,
    *,
    log: Callable[[str], None] | None = None,
    prepare: bool = True,
    step_timer: Timer | None = None,
    check_fused: bool = True,
    refine: bool = False,
) -> TuneReport:
    """Tunes every op of ``step`` by running it at batch sizes ``1, 2, 4, ..., max_batch_size``,
    unfused and then as built (see the module docstring).

    First (with ``prepare``) the calls of one untuned step are recorded
    (:func:`record_step_calls`) and ``tuner.prepare`` compiles the tactics of all their missing
    profiles at once; when nothing is missing, it returns without the bucket runs. The step's
    tuner is switched to tuning mode for the call (and restored after), so this works inside or
    outside :func:`graphtune.autotune`; wrap it in ``autotune(cache_path, tuner)`` to load and
    save a cache file. Entries already in the tuner's cache are not tuned again.

    Args:
        step: A step built with a tuner (``build_step(model, cache, tuner=...)``, on every rank
            of a tensor-parallel group).
        log: Called with one line per phase and batch size run (progress).
        prepare: Record one untuned step and compile its ops' tactics up front (``False``: each
            op compiles its tactics when it is tuned, as before ``AutoTuner.prepare``).
        step_timer: Times whole steps for :func:`check_fusion`. Default: a CUDA-graph timer on a
            CUDA device, and no check on the CPU (pass a timer to check there).
        check_fused: Run :func:`check_fusion` (``False`` keeps every per-op pick, for example
            to test the fused kernels where the step would run faster without them).
        refine: Afterwards race each profile's pick against its nearest rivals in the whole
            step and keep the fastest (:func:`~graphtune.engine.step_refine.refine_in_step`;
            single-process steps with a step timer; seconds per bucket, so off by default).

    Returns:
        A :class:`TuneReport`.

    Raises:
        ConfigError: ``step`` has no tuner.
    """
    tuner = _require_tuner(step, "tune_step")
    report = TuneReport(buckets=power_of_two_buckets(step.max_batch_size))
    compiled_before = {id(r): r.compile_seconds for r in triton_runners()}
    first_row = len(tuner.summary_rows())
    started = time.perf_counter()
    previous = tuner.tuning_mode
    try:
        with torch.no_grad():
            if prepare:
                if log is not None:
                    log(f"tuning: recording the step at batch {step.max_batch_size}, compiling")
                on_gpu = step.model.device.type == "cuda"
                # With an empty cache there is compiling to do: the workers' start (seconds)
                # then overlaps the recording and the planning.
                workers = on_gpu and len(tuner.cache) == 0 and start_compile_workers()
                calls = record_step_calls(step)
                if _all_cached(step, tuner, calls):
                    report.prepare_seconds = report.seconds = time.perf_counter() - started
                    logger.info("tune_step: every profile of the step is cached; nothing to run")
                    return report
                cached_ops = {key.op for key, _ in tuner.cache.items()}
                if on_gpu and not workers and {c.op for c in calls} - cached_ops:
                    # An op with no pick at all: the workers' start overlaps the planning
                    # (otherwise they start when a batch needs them).
                    start_compile_workers()
                report.prepared = tuner.prepare(_in_tuning_order(calls), ahead=True)
                report.prepare_seconds = time.perf_counter() - started
            tuner.tuning_mode = True
            runs_started = time.perf_counter()
            passes = [("single ops", step.ops.unfused())]
            if step.ops.fused:
                passes.append(("fused ops", step.ops))
            for what, ops in passes:
                for batch in report.buckets:
                    if log is not None:
                        log(f"tuning the {what}: running the step at batch {batch}")
                    step.decode(ops, *step.example_inputs(batch))
            report.bucket_runs_seconds = time.perf_counter() - runs_started
    finally:
        tuner.tuning_mode = previous
        close_compile_workers()
    cuda = step.model.device.type == "cuda"
    # The whole-step passes time a single-process step, on CUDA or with a given step timer.
    timer = None
    if step.model.parallel is None and (cuda or step_timer is not None):
        timer = step_timer if step_timer is not None else resolve_timer("graph", step.model.device)
    checks_started = time.perf_counter()
    if timer is not None and check_fused and step.ops.fused:
        report.fusion_checks = check_fusion(step, timer, buckets=report.buckets, log=log)
    if timer is not None and refine:
        report.refinements = refine_in_step(step, timer, buckets=report.buckets, log=log)
    elif refine:
        logger.warning(
            "tune_step(refine=True) skipped the in-step refinement: it needs a single-process "
            "step and a step timer (CUDA, or step_timer=...); the per-op picks stand"
        )
    if cuda:
        torch.cuda.synchronize(step.model.device)
    report.check_seconds = time.perf_counter() - checks_started
    report.seconds = time.perf_counter() - started
    report.rows = tuner.summary_rows()[first_row:]
    report.compile_seconds_by_op = _compile_seconds_by_op(tuner, compiled_before)
    report.compile_seconds = sum(report.compile_seconds_by_op.values())
    logger.info("tuned the step: %s", report.summary())
    return report


def check_fusion(
    step: DecodeStep,
    timer: Timer,
    *,
    buckets: tuple[int, ...] | None = None,
    margin: float = UNFUSED_MARGIN,
    log: Callable[[str], None] | None = None,
) -> list[FusionCheck]:
    """Keeps a fused op's unfused runner at each bucket where the whole step runs faster so.

    At every bucket (default ``1, 2, 4, ..., max_batch_size``) where some fused op's cached pick
    is its fused kernel, ``timer`` times the whole step (a CUDA-graph timer replays back-to-back
    steps; rows in their own slots at the cache's last position, as served at a full context:
    :func:`~graphtune.engine.step_refine.whole_step_inputs`): as tuned, with every stage
    unfused, and then, where there are several such fused-op profiles, once per profile, in step
    order, with that profile switched to its unfused runner (``AutoTuner.pin``; with one profile
    that switch is the unfused step). A switch stays when the step got faster than the best so
    far by more than ``margin``; otherwise the pick is put back. When the fully unfused step
    beats the result by more than ``margin``, every profile is switched. The picks kept are
    saved with the cache, so a restart keeps them.

    Only for single-process steps (the ranks of a tensor-parallel group would each decide on
    their own timings); the tuner is out of tuning mode meanwhile, so nothing is tuned here.

    Raises:
        ConfigError: ``step`` has no tuner, or belongs to a tensor-parallel group.
    """
    tuner = _require_tuner(step, "check_fusion")
    if step.model.parallel is not None:
        raise ConfigError(
            "check_fusion times a single-process step; a tensor-parallel step's ranks would "
            "decide on their own timings (tune it with tune_step, which skips the check)"
        )
    checks: list[FusionCheck] = []
    previous = tuner.tuning_mode
    tuner.tuning_mode = False
    last_us: float | None = None  # the step's last timing, which sizes the next capture
    try:
        for batch in buckets or power_of_two_buckets(step.max_batch_size):
            args = whole_step_inputs(step, batch)
            with torch.no_grad(), tuner.record_calls(dry_run=True) as calls:
                step.decode(step.ops, *args)
            fused: dict[Any, tuple[OpCall, Any]] = {}
            for call in calls:
                found = _fused_pick(tuner, call)
                if found is not None and found[0] not in fused:
                    fused[found[0]] = (call, found[1])
            if not fused:
                continue
            as_tuned = _step_us(step, timer, step.ops, args, last_us)
            unfused = _step_us(step, timer, step.ops.unfused(), args, as_tuned)
            best, pinned, timings = as_tuned, 0, 2
            last_us = as_tuned
            # With one fused profile, switching it is the unfused step, timed just above.
            for key, (call, entry) in fused.items() if len(fused) > 1 else ():
                tuner.pin(call, 0)
                now = _step_us(step, timer, step.ops, args, as_tuned)
                timings += 1
                if now < best * (1.0 - margin):
                    best, pinned = now, pinned + 1
                else:
                    tuner.cache.put(key, entry)
            if unfused < best * (1.0 - margin):
                for call, _ in fused.values():
                    tuner.pin(call, 0)
                best, pinned = unfused, len(fused)
            checks.append(FusionCheck(batch, as_tuned, unfused, best, pinned, len(fused), timings))
            if log is not None:
                log(
                    f"whole-step check at batch {batch}: as tuned {as_tuned:.1f} us, unfused "
                    f"{unfused:.1f} us, kept {best:.1f} us with {pinned} of {len(fused)} fused "
                    "profiles switched to their unfused runner"
                )
    finally:
        tuner.tuning_mode = previous
    return checks


def _step_us(
    step: DecodeStep,
    timer: Timer,
    ops: Any,
    args: tuple[torch.Tensor, ...],
    hint_us: float | None = None,
) -> float:
    """Time per step of ``step.decode(ops, *args)`` by ``timer``; ``hint_us``: a timing of a
    similar step (or ``None``)."""

    def run(_: int) -> None:
        step.decode(ops, *args)

    with torch.no_grad():
        if hint_us is None or not isinstance(timer, SessionTimer):
            # One step per replay: a step lasts far longer than a graph timer's shortest
            # replay. Two warm-up calls, since a graph timer times all but the first: that
            # bound lets it capture one step once; after a single untimed warm-up it captures
            # its fewest calls for a short call (three steps), probes, and captures one again.
            return float(timer.measure(run, warmup=2, repeat=1).median_us)
        # A step timed before sizes the capture instead (GraphTimer: a hint of a long call
        # captures one step), so one warm-up call does: each is a whole eager step.
        with timer.open(run, warmup=1, repeat=1, hint_us=hint_us) as session:
            session.measure()  # a graph timer's first measurement is its probe's few replays
            return float(session.measure().median_us)


def _in_tuning_order(calls: list[OpCall]) -> list[OpCall]:
    """The single ops' calls first, then the fused ops' (runner 0 is their unfused sequence),
    each in step order: the order the two bucket passes of :func:`tune_step` tune them in."""
    return sorted(calls, key=lambda c: bool(c.runners) and isinstance(c.runners[0], UnfusedRunner))


def _fused_pick(tuner: Any, call: OpCall) -> tuple[Any, Any] | None:
    """``(key, entry)`` when ``call`` is a fused op (runner 0 is its unfused sequence) whose
    cached pick is another runner (its fused kernel), else ``None``."""
    if not call.runners or not isinstance(call.runners[0], UnfusedRunner):
        return None
    found = tuner.cached(call)
    return found if found is not None and found[1].runner_index != 0 else None


def _all_cached(step: DecodeStep, tuner: Any, calls: list[OpCall]) -> bool:
    """Whether the bucket runs would tune nothing: no profile of the recorded calls, nor of the
    unfused step's calls (a cached fused pick hides its single ops), is missing at any bucket.

    The unfused step is recorded only when some fused op of ``calls`` ran its fused kernel:
    otherwise each ran its unfused runner, whose single-op calls are the unfused step's calls
    and are in ``calls`` already (above 16 rows only the MLP stage can have a fused kernel).

    Only for a single-process step: the ranks of a tensor-parallel group must all run the
    bucket passes or none, and their caches are not compared here.
    """
    if step.model.parallel is not None or tuner.missing_profiles(calls):
        return False
    if step.ops.fused and any(_fused_pick(tuner, c) is not None for c in calls):
        with torch.no_grad(), tuner.record_calls(dry_run=True) as unfused:
            step.decode(step.ops.unfused(), *step.example_inputs(step.max_batch_size))
        return not tuner.missing_profiles(unfused)
    return True


def _compile_seconds_by_op(tuner: Any, before: dict[int, float]) -> dict[str, float]:
    """Compile time since ``before`` of every Triton runner, by the op whose keys name it."""
    ops_by_runner: dict[str, set[str]] = {}
    for key, _ in tuner.cache.items():
        for ident in key.runners:
            ops_by_runner.setdefault(ident, set()).add(key.op)
    by_op: dict[str, float] = {}
    for runner in triton_runners():
        spent = runner.compile_seconds - before.get(id(runner), 0.0)
        if spent <= 0:
            continue
        # A runner serves one op in practice; one that several ops list counts for all of them.
        name = "+".join(sorted(ops_by_runner.get(runner_id(runner), {"unknown op"})))
        by_op[name] = by_op.get(name, 0.0) + spent
    return by_op
