"""Runs a function in several ``spawn`` processes joined by one gloo process group, for the
multi-process tests (the tensor-parallel engine's ``test_engine_tp*.py`` and
``test_tp_rank_failures.py``, distributed tuning's ``test_distributed_blocklist.py``)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def _worker(
    fn: Callable[[int], Any],
    rank: int,
    world: int,
    store: str,
    results: Any,
    group_timeout: float | None,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the CPU; oversubscription slows gloo a lot
    timeout = (
        {} if group_timeout is None else {"timeout": datetime.timedelta(seconds=group_timeout)}
    )
    try:
        dist.init_process_group(
            "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, **timeout
        )
        try:
            results.put((rank, fn(rank)))
            # No rank tears gloo down while another still talks to it: under load, a rank that
            # destroyed its group early has ended with "terminate called without an active
            # exception" (exit code not 0) after reporting. Bounded, so a failed rank (whose
            # traceback is already reported) cannot hang this one. A group that fn's engine
            # aborted is gone already: nothing to wait for or tear down.
            if dist.is_initialized():
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except Exception:  # report any failure to the parent instead of hanging it
        results.put((rank, traceback.format_exc()))


def run_on_ranks(
    fn: Callable[[int], Any],
    world: int,
    folder: Path,
    timeout: float = 120.0,
    group_timeout: float | None = None,
) -> dict[int, Any]:
    """``fn(rank)`` on ``world`` ranks (``fn`` must be importable by a spawned process); returns
    each rank's result, failing the test with a rank's traceback or when one does not report
    within ``timeout`` seconds (a collective some rank never reached). ``group_timeout``: the
    gloo group's timeout in seconds (torch's default when ``None``)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = str(folder / "store")
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world, store, results, group_timeout))
        for r in range(world)
    ]
    # Other test modules turn on Triton's interpreter for this process; the ranks may tune on
    # the CPU, where interpreted Triton tactics would take minutes: start them without it.
    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        for p in procs:
            p.start()
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    got: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, value = results.get(timeout=timeout)
            got[rank] = value
    except queue.Empty:
        pytest.fail(f"ranks hung: only {sorted(got)} reported within {timeout:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for rank, value in got.items():
        assert not isinstance(value, str), f"rank {rank} failed:\n{value}"
    assert all(p.exitcode == 0 for p in procs)
    return got
