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
    rows = [1, 2, 4, 8, 16, 32, 64, 128]  # the decode buckets of one Llama-1B QKV projection
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


def test_a_prepared_tactic_is_loaded_before_its_first_launch() -> None:
    # The module load happens in the ahead-of-time compile (run_kernel with warmup), so the
    # first launch, which in tuning is a timing warm-up, loads nothing.
    import torch
    from triton.compiler import compiler

    from graphtune.ops.rmsnorm import TritonRMSNormRunner

    loads: list[str] = []
    original = compiler.CompiledKernel._init_handles

    def counting(self) -> None:  # noqa: ANN001
        if self.module is None:
            loads.append(self.name)
        original(self)

    runner = TritonRMSNormRunner()
    # A row length no other test uses and not a multiple of 16: Triton specialises a new binary.
    x = torch.randn(3, 1500, device="cuda", dtype=torch.bfloat16)
    inputs = [x, torch.randn(1500, device="cuda", dtype=torch.bfloat16), None, 1e-5]
    tactic = runner.tactics_for(inputs)[0]
    compiler.CompiledKernel._init_handles = counting
    try:
        runner.prepare(inputs, tactic)
        prepared = len(loads)
        runner.forward(inputs, tactic=tactic)
        torch.cuda.synchronize()
    finally:
        compiler.CompiledKernel._init_handles = original
    assert prepared >= 1, "prepare loaded no module: the binary was not new"
    assert len(loads) == prepared, f"the first launch loaded {loads[prepared:]}"
