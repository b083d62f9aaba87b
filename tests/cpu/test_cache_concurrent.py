"""Two real processes saving to one cache file at the same time lose nothing."""

from __future__ import annotations

import multiprocessing

import pytest

from graphtune.autotuner import persist

SAVES_PER_WRITER = 25


def _writer(path: str, writer: int, barrier) -> None:
    # Imports happen in the child (spawn), exactly as in a separate serving process.
    from graphtune.autotuner import CacheEntry, CacheKey, TuningCache

    barrier.wait()  # start together so the saves really interleave
    for i in range(SAVES_PER_WRITER):
        # A fresh cache each time: only the file can carry earlier entries forward.
        cache = TuningCache()
        key = CacheKey(
            f"op{writer}", ("mod.R",), ((i + 1, 8),), ("float32",), "wallclock", device="cpu"
        )
        cache.put(key, CacheEntry("mod.R", 0, [writer, i], 1.0 + i, 2.0 + i))
        cache.save(path)


@pytest.mark.slow
def test_two_processes_writing_one_file_lose_nothing(tmp_path) -> None:
    path = str(tmp_path / "cache.json")
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(path, w, barrier)) for w in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    entries = persist.load(path, strict=True)
    assert len(entries) == 2 * SAVES_PER_WRITER
    assert {tuple(e.tactic) for e in entries.values()} == {
        (w, i) for w in range(2) for i in range(SAVES_PER_WRITER)
    }
    assert not list(tmp_path.glob(".cache.json.*.tmp"))
