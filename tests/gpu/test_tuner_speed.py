"""GPU tests of what makes tuning cheap: graph-timer sessions, the up-front compile of an op's
tactics, and the consistency of every decode-op tactic (skipped without CUDA by conftest.py)."""

from __future__ import annotations

import torch

from graphtune.autotuner import AutoTuner, autotune, check_tactics
from graphtune.autotuner.timing import GraphTimer
from graphtune.cli.check_tactics import check_step
from graphtune.ops.gemm import (
    OP_NAME,
    TorchGemmRunner,
    TritonGemmRunner,
    TritonGemvRunner,
    gemm_config,
)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def test_a_graph_session_replays_one_capture_for_every_measurement() -> None:
    device = _device()
    a = torch.randn(64, 2048, device=device, dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    timer = GraphTimer(device=device)
    before = torch.cuda.memory_reserved(device)
    with timer.open(lambda i: a @ w.t(), warmup=2, repeat=10) as session:
        first = session.measure()
        others = [session.measure() for _ in range(4)]
    # One capture, sized once; the same graph gives the same time within the noise.
    assert session.calls == timer.last_calls and first.calls_per_sample == session.calls
    for m in others:
        assert abs(m.median_us - first.median_us) / first.median_us < 0.10
    one_shot = timer.measure(lambda i: a @ w.t(), warmup=2, repeat=10)
    assert abs(one_shot.median_us - first.median_us) / first.median_us < 0.10
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(device) - before < 64 << 20  # the graph's pool is freed


def test_gemm_tuning_reuses_sessions_and_compiles_each_binary_once() -> None:
    device = _device()
    runners = (TorchGemmRunner(), TritonGemmRunner(min_rows=1), TritonGemvRunner(max_rows=8))
    tuner = AutoTuner(show_progress=False)
    a = torch.randn(8, 2048, device=device, dtype=torch.bfloat16)
    w = torch.randn(3072, 2048, device=device, dtype=torch.bfloat16)
    with autotune(None, tuner):
        tuner.choose_one(OP_NAME, runners, gemm_config(8), [a, w, None, None, False])
    stats = tuner.stats
    assert stats.profiles_tuned == 4 and stats.fallbacks == {}  # buckets 1, 2, 4, 8
    assert stats.measurements > stats.tactics_timed  # several measurements per candidate...
    assert stats.phase_seconds["measure"] < stats.tuning_seconds
    tiled = runners[1]
    assert tiled.compiled > 0 and tiled.compile_shared > 0  # ...and shared binaries
    # The cost per (tactic, bucket) is a speed target: benchmarks/tuning_time.py measures it.


def test_every_decode_op_tactic_matches_the_fallback_on_the_gpu() -> None:
    reports = check_step("llama-1b-shape", (1, 8, 32), device="cuda", dtype="bfloat16")
    failed = [(r.op, r.profile, c.runner, c.tactic, c.error) for r in reports for c in r.failures]
    assert not failed, failed
    assert sum(len(r.checks) for r in reports) > 100  # the Triton tactics were all run


def test_check_tactics_on_a_gemm_with_a_residual_in_place() -> None:
    device = _device()
    a = torch.randn(4, 512, device=device, dtype=torch.bfloat16)
    w = torch.randn(256, 512, device=device, dtype=torch.bfloat16) / 512**0.5
    residual = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
    runners = (TorchGemmRunner(), TritonGemmRunner(min_rows=1), TritonGemvRunner(max_rows=8))
    report = check_tactics(OP_NAME, runners, gemm_config(4, True), [a, w, None, residual, True])
    assert report.passed and len(report.checks) > 10, report.failures
