"""Picks decided in the step: each profile's nearest rivals pinned and raced in the whole step.

The tuner times an op alone, on its own inputs, as back-to-back calls of itself. Inside the decode
step a kernel sits between other kernels, and with programmatic dependent launch its cost also
depends on them: how early its programs start, on how many SMs the kernel before left room, how
many kernels a call launches. ``benchmarks/step_truth.py`` pins every candidate of every profile
in the whole step and times it there; on the H200 (results README, "Which per-op time predicts
the step") candidates within 3% of each other alone moved the step by up to 17 us, and the
fastest by the op-alone CUPTI truth could cost the step 60 us. Neither the tuner's times nor a
truth of the op alone can see that; only the step can.

:func:`refine_in_step` therefore lets the step decide among the candidates the op-alone timing
cannot separate. After tuning (``tune_step(refine=True)``), at each batch bucket, for every profile
the step looks up (in step order) whose tuning measured rivals within ``band`` of the pick's own
time, it captures the step with the pick and with each of the ``rivals`` nearest rivals pinned
(``AutoTuner.pin``), races them (``rounds`` measurements each, interleaved so that a drift of
clocks hits all alike) and keeps the fastest when it beats the pick by more than ``margin`` of
the step. Later profiles are raced on the step with the earlier decisions in place. A kept rival
is a cache entry like any pick (saved with the cache; a restart keeps it). The rivals come from
``AutoTuner.history``, so only profiles tuned in this process are refined.

The step runs with its rows in KV-cache slots ``0 .. B-1`` at the cache's last position, so
attention reads a full context, as the attention op is tuned for; every request writes its own
row at a position before reading it, so writing that row disturbs no request. Single-process
steps only (the ranks of a tensor-parallel group would decide on their own timings).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphtune.autotuner.calls import OpCall
from graphtune.autotuner.config import power_of_two_buckets
from graphtune.autotuner.identity import short_runner_name
from graphtune.autotuner.profiles import profile_for
from graphtune.autotuner.selection import CandidateRecord, ProfileRecord
from graphtune.autotuner.timing.base import SessionTimer, Timer
from graphtune.engine.step import DecodeStep
from graphtune.errors import ConfigError
from graphtune.finite_json import brief, finite_float

logger = logging.getLogger(__name__)

RIVAL_BAND = 0.25
"""Rivals are candidates whose op-alone time is within this fraction above the pick's."""
RIVALS = 3
"""Most rivals raced against a pick."""
STEP_MARGIN = 0.004
"""How much faster (relative) the step must run for a rival to replace the pick."""
STEP_ROUNDS = 3
"""Measurements of each candidate's step, interleaved."""
STEPS_PER_SAMPLE = 2
"""Back-to-back steps in one timed sample (the graph timer's ``repeat``)."""


@dataclass(frozen=True)
class StepRefinement:
    """One profile raced in the step by :func:`refine_in_step`.

    Attributes:
        batch: The bucket (the step ran at this batch size).
        op: The op name.
        profile: The profile's bucketed shapes (``Profile.describe()``).
        rivals: Rivals raced against the pick.
        pick_us: Time per step with the tuner's pick.
        kept_us: Time per step with the candidate kept.
        kept: ``"runner tactic"`` of the candidate kept.
        switched: Whether a rival replaced the pick.
    """

    batch: int
    op: str
    profile: str
    rivals: int
    pick_us: float
    kept_us: float
    kept: str
    switched: bool


def profile_record(tuner: Any, call: OpCall) -> ProfileRecord | None:
    """The latest ``tuner.history`` record of the profile ``call`` looks up, or ``None``."""
    profile = profile_for(call.config, list(call.inputs))
    if profile is None:
        return None
    text = profile.describe()
    for record in reversed(tuner.history):
        if record.op == call.op and record.profile == text:
            return record
    return None


def nearest_rivals(
    record: ProfileRecord, pick: tuple[int, Any], *, band: float, limit: int
) -> list[CandidateRecord]:
    """Measured candidates other than ``pick`` (``(runner_index, tactic)``) whose op-alone time
    is within ``band`` above the pick's, fastest first, at most ``limit``.

    The pick's own time is its candidate's; a pick that was not measured (a pin) is compared
    with the fastest candidate's time.
    """
    usable = [c for c in record.candidates if c.failed is None and math.isfinite(c.median_us)]
    if not usable:
        return []
    own = [c.median_us for c in usable if (c.runner_index, c.tactic) == pick]
    reference = own[0] if own else min(c.median_us for c in usable)
    rivals = [
        c
        for c in usable
        if (c.runner_index, c.tactic) != pick and c.median_us <= reference * (1.0 + band)
    ]
    return sorted(rivals, key=lambda c: c.median_us)[:limit]


def race_in_step(
    timer: Timer, run: Callable[[int], object], pins: Sequence[Callable[[], None]], rounds: int
) -> list[float]:
    """Median time per step of ``run`` as each ``pins[i]()`` leaves the tuner's cache.

    With a session timer every pin's step is set up (captured) once, then measured ``rounds``
    times, interleaved; otherwise each round pins and measures again. A candidate whose step
    cannot be set up or measured reads ``inf``.
    """
    samples: list[list[float]] = [[] for _ in pins]
    if isinstance(timer, SessionTimer):
        sessions: list[Any] = []
        try:
            for pin in pins:
                pin()
                try:
                    sessions.append(timer.open(run, warmup=1, repeat=STEPS_PER_SAMPLE))
                except Exception as exc:  # a rival that cannot run in the step loses
                    logger.warning("refine_in_step: a candidate's step failed to set up: %s", exc)
                    sessions.append(None)
            for _ in range(rounds):
                for row, session in zip(samples, sessions, strict=True):
                    if session is not None:
                        row.append(session.measure().median_us)
        finally:
            for session in sessions:
                if session is not None:
                    session.close()
    else:
        for _ in range(rounds):
            for row, pin in zip(samples, pins, strict=True):
                pin()
                row.append(timer.measure(run, warmup=1, repeat=STEPS_PER_SAMPLE).median_us)
    return [statistics.median(row) if row else math.inf for row in samples]


def whole_step_inputs(
    step: DecodeStep, batch: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, positions, slots)`` of the whole-step timings (this module's and
    ``graphtune.engine.tuning.check_fusion``'s): rows in slots ``0 .. batch-1`` at the last
    position, so attention reads a full context.

    Raises:
        ConfigError: ``batch`` is outside ``1 .. step.max_batch_size``.
    """
    if not 1 <= batch <= step.max_batch_size:
        raise ConfigError(
            f"a whole-step timing at batch {batch}: outside 1..{step.max_batch_size} (the step's "
            "KV cache slots); pass buckets within the step's max_batch_size"
        )
    slots = torch.arange(batch, dtype=torch.long, device=step.model.device)
    positions = torch.full_like(slots, step.cache.max_seq_len - 1)
    return torch.zeros_like(slots), positions, slots


def refine_in_step(
    step: DecodeStep,
    timer: Timer,
    *,
    buckets: Sequence[int] | None = None,
    band: float = RIVAL_BAND,
    rivals: int = RIVALS,
    margin: float = STEP_MARGIN,
    rounds: int = STEP_ROUNDS,
    log: Callable[[str], None] | None = None,
) -> list[StepRefinement]:
    """Races each profile's pick against its nearest rivals in the whole step (module docstring).

    Args:
        step: A tuned single-process step (its tuner's history names the rivals).
        timer: Times whole steps (a CUDA-graph timer on the GPU).
        buckets: Batch sizes (default ``1, 2, 4, ..., max_batch_size``).
        band: Rivals are within this fraction above the pick's op-alone time.
        rivals: Most rivals per profile.
        margin: Relative step-time gain a rival needs to replace the pick.
        rounds: Measurements per candidate.
        log: Called with one line per bucket.

    Returns:
        One :class:`StepRefinement` per profile raced, in the order raced.

    Raises:
        ConfigError: ``step`` has no tuner or belongs to a tensor-parallel group, or bad
            settings.
    """
    tuner = step.tuner
    if tuner is None or step.model.parallel is not None:
        raise ConfigError(
            "refine_in_step needs a single-process step built with a tuner "
            "(build_step(model, cache, tuner=AutoTuner())); a tensor-parallel step's ranks "
            "would decide on their own timings"
        )
    counts_ok = all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (rivals, rounds)
    )
    shares_ok = all(finite_float(x) and x >= 0 for x in (band, margin))
    if not (counts_ok and shares_ok):
        raise ConfigError(
            "refine_in_step: need finite numbers band >= 0 and margin >= 0, and integers "
            f"rivals >= 1 and rounds >= 1; got {brief(band)}, {brief(rivals)}, "
            f"{brief(margin)}, {brief(rounds)}"
        )
    results: list[StepRefinement] = []
    previous = tuner.tuning_mode
    tuner.tuning_mode = False
    try:
        for batch in buckets or power_of_two_buckets(step.max_batch_size):
            inputs = whole_step_inputs(step, batch)

            def run(_: int, inputs: tuple[torch.Tensor, ...] = inputs) -> None:
                step.decode(step.ops, *inputs)

            with torch.no_grad(), tuner.record_calls(dry_run=True) as calls:
                run(0)
            settings = (band, rivals, margin, rounds)
            raced = _refine_bucket(tuner, timer, batch, calls, run, settings)
            results.extend(raced)
            if log is not None:
                switched = sum(r.switched for r in raced)
                log(f"in-step refinement at batch {batch}: {switched} of {len(raced)} switched")
    finally:
        tuner.tuning_mode = previous
    return results


def _refine_bucket(
    tuner: Any,
    timer: Timer,
    batch: int,
    calls: list[OpCall],
    run: Callable[[int], object],
    settings: tuple[float, int, float, int],
) -> list[StepRefinement]:
    """Races every profile of one bucket's calls, in step order (each profile once)."""
    band, rivals, margin, rounds = settings
    raced: list[StepRefinement] = []
    seen: set[Any] = set()
    for call in calls:
        found = tuner.cached(call)
        if found is None or found[0] in seen:
            continue
        key, entry = found
        seen.add(key)
        record = profile_record(tuner, call)
        pick = (entry.runner_index, entry.tactic)
        near = [] if record is None else nearest_rivals(record, pick, band=band, limit=rivals)
        if record is None or not near:
            continue

        def restore(key: Any = key, entry: Any = entry) -> None:
            tuner.cache.put(key, entry)

        def pin_to(rival: CandidateRecord, call: OpCall = call) -> Callable[[], None]:
            return lambda: tuner.pin(
                call, rival.runner_index, rival.tactic, time_us=rival.median_us
            )

        with torch.no_grad():
            times = race_in_step(timer, run, [restore, *map(pin_to, near)], rounds)
        best = min(range(len(times)), key=times.__getitem__)
        switched = best > 0 and times[best] < times[0] * (1.0 - margin)
        if switched:
            kept = near[best - 1]
            pin_to(kept)()
            kept_text = f"{kept.runner} {kept.tactic}"
        else:
            restore()
            kept_text = f"{short_runner_name(entry.runner_id)} {entry.tactic}"
        raced.append(
            StepRefinement(
                batch=batch,
                op=call.op,
                profile=record.profile,
                rivals=len(near),
                pick_us=times[0],
                kept_us=times[best] if switched else times[0],
                kept=kept_text,
                switched=switched,
            )
        )
    return raced
