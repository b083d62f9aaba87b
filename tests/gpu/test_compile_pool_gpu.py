"""Triton compiles in worker processes on the GPU machine (skipped without CUDA by conftest.py).

The same check as tests/cpu/test_compile_pool.py through Triton's own CUDA driver: with worker
processes the tuning process runs no code generator and ends up with the binaries it compiles
by itself; the wall times of threads only and of the default worker count are printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from test_compile_pool import run_child  # noqa: E402


def test_workers_compile_the_gemm_tactics_and_this_process_loads_them(tmp_path) -> None:
    from graphtune.ops._compile_pool import compile_processes

    workers = compile_processes()
    if workers < 2:
        pytest.skip("fewer than two CPU cores for compile workers")
    # The decode buckets of one Llama-1B QKV projection that the tiled GEMM has tactics for (none
    # at one row: graphtune.ops.gemm.tiled).
    rows = [2, 4, 8, 16, 32, 64, 128]
    pooled = run_child(tmp_path, workers, rows, 2048, 3072, "cuda")
    if not pooled["pool_enabled"]:
        pytest.skip("this Triton has no knobs.runtime.jit_cache_hook (Triton < 3.4)")
    alone = run_child(tmp_path, 0, rows, 2048, 3072, "cuda")
    count = pooled["binaries"]
    assert pooled["errors"] == alone["errors"] == [] and alone["binaries"] == count >= 8
    assert pooled["generated_here"] == 0 and pooled["compiled_in_workers"] == count
    assert alone["generated_here"] == count
    assert pooled["cubins"] == alone["cubins"]
    print(
        f"\n{count} GEMM binaries on the GPU machine: threads {alone['seconds']:.2f} s, "
        f"{workers} worker processes {pooled['seconds']:.2f} s (including their start)"
    )


def test_the_first_launch_of_a_worker_compiled_tactic_builds_no_launcher_here(tmp_path) -> None:
    # Triton up to 3.6 builds a C launcher per kernel signature at the first load; the compile
    # workers build it with the binary, so the tuning process's first launch only reads it.
    pooled = run_child(tmp_path, 2, [2], 2048, 3072, "cuda")
    if not pooled["pool_enabled"]:
        pytest.skip("this Triton has no knobs.runtime.jit_cache_hook (Triton < 3.4)")
    alone = run_child(tmp_path, 0, [2], 2048, 3072, "cuda")
    assert pooled["launchers_built_here"] == 0, pooled["worker_launchers"]
    if alone["launchers_built_here"]:  # this Triton builds launchers: the workers built them
        assert "built" in pooled["worker_launchers"], pooled["worker_launchers"]
    else:
        assert pooled["worker_launchers"] in (["None", "not needed"], ["not needed"])
