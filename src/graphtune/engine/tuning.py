"""Tuning is running the step: :func:`tune_step` runs the real forward at every batch bucket.

The step's ops look their picks up in the tuner; in tuning mode the first call of an op that
misses tunes every bucket of that op (up to the step's ``max_batch_size``) on synthetic inputs of
the live call's shapes, then runs the pick. Running the real step therefore tunes exactly the keys
the step looks up later (no list of ops kept beside the model), ops nested inside other ops
included. TensorRT-LLM tunes the same way during its warm-up.

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

from graphtune.autotuner.config import power_of_two_buckets
from graphtune.autotuner.identity import runner_id
from graphtune.engine.step import DecodeStep
from graphtune.errors import ConfigError
from graphtune.ops._triton_runner import triton_runners

logger = logging.getLogger(__name__)


@dataclass
class TuneReport:
    """What :func:`tune_step` did.

    Attributes:
        buckets: Batch sizes the step ran at (``1, 2, 4, ..., max_batch_size``).
        rows: The tuner's summary rows added by this call (op, bucket, winner, time, ...), one
            per (op, bucket) profile tuned.
        seconds: Wall time of the whole call.
        compile_seconds: Part of it spent compiling Triton tactics ahead of timing.
        compile_seconds_by_op: That compile time per op name (ops that compiled nothing are left
            out).
    """

    buckets: tuple[int, ...]
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    seconds: float = 0.0
    compile_seconds: float = 0.0
    compile_seconds_by_op: dict[str, float] = field(default_factory=dict)

    @property
    def profiles_tuned(self) -> int:
        """(op, bucket) profiles tuned by this call."""
        return len(self.rows)

    def summary(self) -> str:
        """One line for people: profiles, seconds, compile seconds and where they went."""
        line = (
            f"{self.profiles_tuned} (op, bucket) profiles tuned in {self.seconds:.1f} s "
            f"({self.compile_seconds:.1f} s compiling) for batch buckets {list(self.buckets)}"
        )
        if self.compile_seconds_by_op:
            parts = ", ".join(
                f"{op} {seconds:.1f} s"
                for op, seconds in sorted(self.compile_seconds_by_op.items())
            )
            line += f"; compiling by op: {parts}"
        return line


def tune_step(step: DecodeStep, *, log: Callable[[str], None] | None = None) -> TuneReport:
    """Tunes every op of ``step`` by running it at batch sizes ``1, 2, 4, ..., max_batch_size``.

    The step's tuner is switched to tuning mode for the call (and restored after), so this works
    inside or outside :func:`graphtune.autotune`; wrap it in ``autotune(cache_path, tuner)`` to
    load and save a cache file. Entries already in the tuner's cache are not tuned again.

    Args:
        step: A step built with a tuner (``DecodeStep(..., tuner=...)``, or the tensor-parallel
            step on every rank).
        log: Called with one line per batch size run (progress).

    Returns:
        A :class:`TuneReport`.

    Raises:
        ConfigError: ``step`` has no tuner.
    """
    tuner = step.tuner
    if tuner is None:
        raise ConfigError(
            "tune_step needs a step built with a tuner (DecodeStep(model, cache, tuner=AutoTuner())"
            " or Engine(..., tune=True)); an untuned step runs the torch fallbacks only"
        )
    report = TuneReport(buckets=power_of_two_buckets(step.max_batch_size))
    compiled_before = {id(r): r.compile_seconds for r in triton_runners()}
    first_row = len(tuner.summary_rows())
    started = time.perf_counter()
    previous = tuner.tuning_mode
    tuner.tuning_mode = True
    try:
        with torch.no_grad():
            for batch in report.buckets:
                if log is not None:
                    log(f"tuning: running the step at batch {batch}")
                step(*step.example_inputs(batch))
    finally:
        tuner.tuning_mode = previous
    if step.model.device.type == "cuda":
        torch.cuda.synchronize(step.model.device)
    report.seconds = time.perf_counter() - started
    report.rows = tuner.summary_rows()[first_row:]
    report.compile_seconds_by_op = _compile_seconds_by_op(tuner, compiled_before)
    report.compile_seconds = sum(report.compile_seconds_by_op.values())
    logger.info("tuned the step: %s", report.summary())
    return report


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
