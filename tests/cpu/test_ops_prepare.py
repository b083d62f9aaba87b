"""Ahead-of-time compilation of an op's tactics (prepare_all), and the consistency check on the
Triton runners, on the CPU interpreter (small shapes: the interpreter runs programs in numpy)."""

from __future__ import annotations

import os
from typing import Any

import torch

# The interpreter must be chosen before Triton decorates the kernels (see test_ops_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from graphtune.autotuner import (  # noqa: E402
    AutoTuner,
    TuningPolicy,
    autotune,
    check_tactics,
)
from graphtune.autotuner.timing import WallClockTimer  # noqa: E402
from graphtune.errors import ConfigError  # noqa: E402
from graphtune.ops import _triton  # noqa: E402
from graphtune.ops.gemm import OP_NAME, TorchGemmRunner, TritonGemmRunner, gemm_config  # noqa: E402
from graphtune.ops.rmsnorm import TritonRMSNormRunner  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)

TACTIC = {"bm": 16, "bn": 32, "bk": 32, "warps": 4, "stages": 2, "split_k": 1}
SPLIT = {**TACTIC, "split_k": 2}


def gemm_inputs(m: int, n: int = 32, k: int = 128) -> list[Any]:
    return [torch.randn(m, k), torch.randn(n, k), None, None, False]


def test_prepare_all_compiles_each_distinct_binary_once() -> None:
    runner = TritonGemmRunner(compile_workers=2)
    # The kernel does not specialise on M, so rows 1, 2, 16 and 40 share binaries; N = 24 (not a
    # multiple of 16, unlike 32) specialises the strides differently and needs its own.
    work = [(gemm_inputs(m), [TACTIC, SPLIT]) for m in (2, 16, 1, 40)]
    work.append((gemm_inputs(2, n=24), [TACTIC, SPLIT]))
    runner.prepare_all(work)
    assert runner.compiled == 4 and runner.compile_shared == 6
    for inputs, tactics in work:  # prepare finds everything compiled: no compile of its own
        for tactic in tactics:
            runner.prepare(inputs, tactic)
    assert runner.compiled == 4


def test_prepare_all_keeps_each_failure_for_its_tactic() -> None:
    runner = TritonGemmRunner(compile_workers=1)
    bad = {**TACTIC, "split_k": 8}  # 8 * 32 does not divide K = 128
    inputs = gemm_inputs(2)
    runner.prepare_all([(inputs, [TACTIC, bad])])
    runner.prepare(inputs, TACTIC)
    with pytest.raises(ConfigError, match="divisible"):
        runner.prepare(inputs, bad)


class CountingGemm(TritonGemmRunner):
    """Counts ``prepare_all`` calls and the pairs it was given."""

    identity_excludes = TritonGemmRunner.identity_excludes | {"calls"}

    def __init__(self) -> None:
        super().__init__(max_tactics=2, min_rows=1, compile_workers=2)
        self.calls: list[int] = []

    def prepare_all(self, work: Any) -> None:
        self.calls.append(sum(len(tactics) for _, tactics in work))
        super().prepare_all(work)


def test_the_tuner_prepares_every_profile_of_an_op_at_once_before_timing() -> None:
    runner = CountingGemm()
    tuner = AutoTuner(
        WallClockTimer(samples=1),
        policy=TuningPolicy(rounds=1, remeasure_top=0, max_extra_rounds=0),
        show_progress=False,
    )
    with autotune(None, tuner):
        tuner.choose_one(OP_NAME, [TorchGemmRunner(), runner], gemm_config(4), gemm_inputs(4))
    # Buckets 2 and 4, 2 tactics each (the tiled GEMM offers none for one row).
    assert len(runner.calls) == 1 and runner.calls[0] == 2 * 2
    assert tuner.stats.phase_seconds["prepare"] > 0 and len(tuner.cache) == 3


class OffByOne(TritonRMSNormRunner):
    """A kernel bug: the split-row tactic (a block narrower than the row) adds a stray offset."""

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> Any:
        out, res = super().launch(inputs, tactic, warmup=warmup)
        if not warmup and tactic["block"] < inputs[0].shape[1]:
            out = out + 0.5
        return out, res


def test_check_tactics_finds_a_wrong_triton_tactic(unpruned) -> None:
    from graphtune.ops.rmsnorm import TorchRMSNormRunner, rms_norm_config

    hidden = 1024  # wide enough for a two-pass (split-row) tactic, offered when unpruned
    x, weight, residual = torch.randn(2, hidden), torch.randn(hidden), torch.randn(2, hidden)
    inputs = [x, weight, residual, 1e-5]
    config = rms_norm_config(4, True)
    good = check_tactics("rms", [TorchRMSNormRunner(), TritonRMSNormRunner()], config, inputs)
    assert good.passed and good.checks
    bad = check_tactics("rms", [TorchRMSNormRunner(), OffByOne()], config, inputs)
    wrong = {c.tactic["block"] for c in bad.failures}
    assert wrong and all(block < hidden for block in wrong)
    assert all(c.passed for c in bad.checks if c.tactic["block"] >= hidden)


def test_prepare_compiles_the_tactics_of_several_op_calls_before_tuning() -> None:
    from graphtune import ops
    from graphtune.ops.rmsnorm import TorchRMSNormRunner, rms_norm_config

    gemm_runner, norm_runner = CountingGemm(), TritonRMSNormRunner(compile_workers=2)
    recorder = AutoTuner(show_progress=False)
    x, w = torch.randn(4, 128), torch.randn(32, 128)
    gemm_runners = (TorchGemmRunner(), gemm_runner)  # one tuple, as gemm_runners() gives
    with recorder.record_calls() as calls:
        ops.gemm(x, w, tuner=recorder, max_m=4, runners=gemm_runners)
        ops.gemm(x, w, tuner=recorder, max_m=4, runners=gemm_runners)  # another layer
        ops.fused_add_rms_norm(
            torch.randn(4, 64), torch.randn(64), 1e-5, torch.randn(4, 64),
            tuner=recorder, max_m=4, runners=(TorchRMSNormRunner(), norm_runner),
        )  # fmt: skip
    assert len(calls) == 3
    tuner = AutoTuner(
        WallClockTimer(samples=1),
        policy=TuningPolicy(rounds=1, remeasure_top=0, max_extra_rounds=0),
        show_progress=False,
    )
    prepared = tuner.prepare(calls)
    # Buckets 2 and 4 (none for one row), 2 tactics each; the repeated call planned once.
    assert prepared > 0 and gemm_runner.calls == [2 * 2]
    compiled = (gemm_runner.compiled, norm_runner.compiled)
    assert all(compiled)
    with autotune(None, tuner):
        for call in calls:
            tuner.choose_one(call.op, call.runners, call.config, call.inputs)
    assert (gemm_runner.compiled, norm_runner.compiled) == compiled  # nothing left to compile
    assert len(tuner.cache) == 6 and tuner.stats.fallbacks == {}
    assert rms_norm_config(4, True) == calls[2].config


def test_triton_key_is_computed_in_a_background_thread_that_launches_wait_for(
    monkeypatch,
) -> None:
    import threading

    import triton.runtime.cache as triton_cache

    calls: list[str] = []
    release = threading.Event()

    def slow_key() -> None:
        release.wait(timeout=10)
        calls.append(threading.current_thread().name)

    monkeypatch.setattr(triton_cache, "triton_key", slow_key)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _triton.start_cache_key_warmup.cache_clear()
    try:
        thread = _triton.start_cache_key_warmup()
        assert thread is not None and thread.is_alive()
        waiter = threading.Thread(target=_triton.wait_for_cache_key)
        waiter.start()
        waiter.join(timeout=0.2)
        assert waiter.is_alive(), "wait_for_cache_key returned while the key was computed"
        release.set()
        waiter.join(timeout=10)
        assert calls == ["graphtune-triton-key"]  # computed once, in the background
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert _triton.start_cache_key_warmup.__wrapped__() is None  # no CUDA: nothing
    finally:
        _triton.start_cache_key_warmup.cache_clear()


class _Compiled:
    def __init__(self) -> None:
        self.loads = 0

    def _init_handles(self) -> None:
        self.loads += 1


class _Kernel:
    """Stands in for a JITFunction: ``warmup`` compiles (returns what Triton's does), a launch
    loads the binary on its first call, as Triton's does."""

    arg_names = ("x",)

    def __init__(self, compiled: _Compiled) -> None:
        self.compiled = compiled
        self.warmed = 0
        self.launched = 0

    def warmup(self, *args, grid, **meta):
        self.warmed += 1
        return self.compiled

    def __getitem__(self, grid):
        def launch(*args, **meta):
            if not self.launched:
                self.compiled._init_handles()
            self.launched += 1

        return launch


def test_a_warm_up_compile_leaves_the_load_to_the_first_launch():
    # A load waits for the GPU work in flight, so it belongs to the thread that launches, not to
    # a compile thread running while the tuner keeps the GPU busy.
    from graphtune.ops._triton import run_kernel

    compiled = _Compiled()
    kernel = _Kernel(compiled)
    run_kernel(kernel, (1,), (torch.zeros(1),), {}, True)
    assert kernel.warmed == 1 and compiled.loads == 0 and kernel.launched == 0
    run_kernel(kernel, (1,), (torch.zeros(1),), {}, False)
    assert compiled.loads == 1 and kernel.launched == 1
