"""Preparing (compiling) the candidates of several tuning runs at once, before any is timed:
one ``prepare_all`` per runner over all the runs, the runners in parallel threads (how
:meth:`graphtune.autotuner.tuner.AutoTuner.prepare` works)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from graphtune.autotuner.runner import TunableRunner
from graphtune.autotuner.tuning import TuningRun

logger = logging.getLogger(__name__)


def prepare_runs(runs: Iterable[TuningRun], *, ahead: bool) -> int:
    """Prepares every candidate of the profiles ``runs`` would time; returns the (inputs,
    tactic) pairs prepared. With ``ahead``, a runner's ``prepare_ahead`` starts its work in the
    background instead where it can (see :meth:`~graphtune.autotuner.tuner.AutoTuner.prepare`).
    """
    work: dict[int, tuple[TunableRunner, list[tuple[list[Any], list[Any]]]]] = {}
    pairs = 0
    for run in runs:
        for runner, items in run.prepare_work(run.plan(local=True)):
            pairs += sum(len(tactics) for _, tactics in items)
            prepare_ahead = getattr(runner, "prepare_ahead", None)  # another base class
            if ahead and prepare_ahead is not None and prepare_ahead(items):
                continue
            work.setdefault(id(runner), (runner, []))[1].extend(items)
    if work:
        threads = ThreadPoolExecutor(len(work), thread_name_prefix="graphtune-prep")
        with threads as ex:
            list(ex.map(_prepare_one, work.values()))
    return pairs


def _prepare_one(entry: tuple[TunableRunner, list[Any]]) -> None:
    """``prepare_all`` of one runner (in a thread of :func:`prepare_runs`)."""
    runner, items = entry
    try:
        runner.prepare_all(items)
    except Exception as exc:  # advisory: the tuning run prepares each tactic again
        logger.warning("%s.prepare_all failed: %s", type(runner).__qualname__, exc)
