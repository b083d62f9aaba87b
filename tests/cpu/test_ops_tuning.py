"""graphtune.ops: valid-tactic pruning, fallbacks without Triton, ahead-of-time compile, and
tuning through the real AutoTuner (fake timer and the real WallClockTimer) on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

if not torch.cuda.is_available():  # see test_ops_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from graphtune.autotuner import AutoTuner, TuningPolicy, autotune  # noqa: E402
from graphtune.autotuner.entries import tactic_text  # noqa: E402
from graphtune.autotuner.timing import WallClockTimer  # noqa: E402
from graphtune.autotuner.timing.base import Measurement  # noqa: E402
from graphtune.errors import ConfigError  # noqa: E402
from graphtune.ops import _triton, gemm_tactics  # noqa: E402
from graphtune.ops.gemm import (  # noqa: E402
    TorchGemmRunner,
    TritonGemmRunner,
    TunableLinear,
    check_gemm_tactic,
)
from graphtune.ops.rmsnorm import rms_norm_tactics  # noqa: E402
from graphtune.ops.rotary import rope_tactics  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
needs_interpreter = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)


# --- pruning (pure) ------------------------------------------------------------------------------


def test_gemm_tactics_obey_every_pruning_rule():
    # One row is the GEMV runner's and cuBLAS's (see graphtune.ops.gemm.tiled).
    assert gemm_tactics(1, 3072, 2048, itemsize=2, smem_bytes=100 * 1024, sm_count=132) == []
    for m, n, k in [
        (2, 3072, 2048),
        (8, 2048, 8192),
        (16, 2048, 2048),
        (64, 16384, 2048),
        (128, 2048, 2048),
        (3, 40, 100),
    ]:
        smem = 100 * 1024
        tactics = gemm_tactics(m, n, k, itemsize=2, smem_bytes=smem, sm_count=132)
        assert 1 <= len(tactics) <= 20
        assert len({json.dumps(t, sort_keys=True) for t in tactics}) == len(tactics)
        for t in tactics:
            assert check_gemm_tactic(t, k) is None
            assert t["stages"] * (t["bm"] + t["bn"]) * t["bk"] * 2 <= smem
            if t["split_k"] > 1:
                assert m <= 64 and k % (t["split_k"] * t["bk"]) == 0 and t["split_k"] <= 8
                tile = (t["bn"], t["bk"], t["warps"], t["stages"])
                assert m > 16 or tile != (32, 128, 4, 4)
            assert t["bn"] <= max(16, 1 << (n - 1).bit_length())
            assert t["bk"] <= max(16, 1 << (k - 1).bit_length())
            assert t["bm"] <= max(16, 1 << (m - 1).bit_length())


def test_gemm_tactics_offer_split_k_for_skinny_m_only():
    skinny = gemm_tactics(2, 2048, 2048, itemsize=2, smem_bytes=227 * 1024, sm_count=132)
    assert any(t["split_k"] > 1 for t in skinny)
    wide = gemm_tactics(128, 2048, 2048, itemsize=2, smem_bytes=227 * 1024, sm_count=132)
    assert all(t["split_k"] == 1 for t in wide)
    # K = 100 cannot be cut into whole 64/128 blocks: no split-K at all.
    odd = gemm_tactics(2, 2048, 100, itemsize=2, smem_bytes=227 * 1024, sm_count=132)
    assert odd and all(t["split_k"] == 1 for t in odd)


def test_gemm_tactics_shrink_with_the_shared_memory_budget_and_the_cap():
    big = gemm_tactics(128, 4096, 4096, itemsize=2, smem_bytes=227 * 1024, sm_count=132)
    small = gemm_tactics(128, 4096, 4096, itemsize=2, smem_bytes=64 * 1024, sm_count=132)
    assert len(small) < len(big)
    capped = gemm_tactics(
        2, 3072, 2048, itemsize=2, smem_bytes=227 * 1024, sm_count=132, max_tactics=5
    )
    assert len(capped) == 5


def test_check_gemm_tactic_names_the_rule():
    good = {"bm": 16, "bn": 64, "bk": 64, "warps": 4, "stages": 3, "split_k": 4}
    assert check_gemm_tactic(good, 256) is None
    assert "divisible" in check_gemm_tactic(good, 192)
    assert "powers of two" in check_gemm_tactic({**good, "bn": 48}, 256)
    assert "keys" in check_gemm_tactic([16, 64], 256)
    with pytest.raises(ConfigError, match="divisible"):
        TritonGemmRunner().forward(
            [torch.randn(2, 192), torch.randn(8, 192), None, None, False], good
        )


def test_elementwise_tactic_lists_are_small_and_valid():
    # Two-pass blocks only above 2048 (graphtune.ops._pruned): measured losers up to there.
    assert {t["block"] for t in rms_norm_tactics(2048)} == {2048}
    norm = rms_norm_tactics(4096)
    assert 3 <= len(norm) <= 16 and {t["block"] for t in norm} == {4096, 2048, 1024}
    assert rms_norm_tactics(64) == [{"block": 64, "warps": 1}]
    rope = rope_tactics(32, 8, 64)
    assert 3 <= len(rope) <= 16 and max(t["heads"] for t in rope) == 16


# --- Triton optional -----------------------------------------------------------------------------


def test_ops_import_without_triton_and_fall_back_to_torch():
    code = r"""
import sys
import graphtune.ops as ops
assert "triton" not in sys.modules, "importing graphtune.ops imported triton"
sys.modules["triton"] = None  # any later `import triton` raises ImportError
ops._triton._import_triton.cache_clear()
import torch
assert not ops.triton_available()
try:
    ops.require_triton("TritonGemmRunner")
except ops.TritonUnavailableError as exc:
    assert "pip install" in str(exc), exc
else:
    raise AssertionError("require_triton did not raise")
assert [type(r).__name__ for r in ops.gemm_runners()] == ["TorchGemmRunner"]
a, w = torch.randn(3, 16), torch.randn(8, 16)
assert torch.equal(ops.gemm(a, w), torch.nn.functional.linear(a, w))
x, nw = torch.randn(3, 16), torch.randn(16)
out, res = ops.fused_add_rms_norm(x, nw, 1e-5, x)
assert out.shape == x.shape and torch.equal(res, x + x)
assert ops.silu_and_mul(torch.randn(2, 8)).shape == (2, 4)
assert ops.TritonGemmRunner().get_valid_tactics([a, w, None, None, False], None) == []
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


# --- ahead-of-time compile -----------------------------------------------------------------------


@needs_interpreter
def test_precompile_reports_each_tactic_and_prepare_reraises_failures():
    runner = TritonGemmRunner(compile_workers=2)
    inputs = [torch.randn(2, 128), torch.randn(32, 128), None, None, False]
    good = {"bm": 16, "bn": 32, "bk": 32, "warps": 4, "stages": 2, "split_k": 2}
    bad = {**good, "split_k": 8}  # 8 * 32 does not divide K = 128
    report = runner.precompile(inputs, [good, -1, bad])
    assert report[tactic_text(good)] is None
    assert "divisible" in report[tactic_text(bad)]
    assert runner.compiled == 1 and runner.compile_seconds >= 0
    runner.prepare(inputs, good)
    with pytest.raises(ConfigError):
        runner.prepare(inputs, bad)


# --- tuning through the real AutoTuner -----------------------------------------------------------


class _RecordingTriton(TritonGemmRunner):
    last: object = None

    def forward(self, inputs, tactic=-1):
        type(self).last = tactic
        return super().forward(inputs, tactic)


class _RecordingTorch(TorchGemmRunner):
    def forward(self, inputs, tactic=-1):
        _RecordingTriton.last = ("torch", tactic)
        return super().forward(inputs, tactic)


class _TacticTimer:
    """Fake timer: runs the call once and returns the time its tactic was assigned."""

    name = "fake"

    def __init__(self, fastest) -> None:
        self.fastest = fastest

    def measure(self, fn, *, warmup, repeat):
        fn(0)
        us = 1.0 if _RecordingTriton.last == self.fastest else 5.0
        return Measurement.from_samples([us], calls_per_sample=1, timer=self.name)


@needs_interpreter
def test_tunable_linear_picks_what_the_timer_says_and_lookups_use_it(tmp_path):
    runners = (_RecordingTorch(), _RecordingTriton(sm_count=4, max_tactics=6, min_rows=1))
    probe = runners[1].get_valid_tactics(
        [torch.randn(2, 256), torch.randn(24, 256), None, None, False], None
    )
    fastest = next(t for t in probe if t["split_k"] > 1)
    tuner = AutoTuner(
        timer=_TacticTimer(fastest),
        show_progress=False,
        policy=TuningPolicy(rounds=1, remeasure_top=0),
    )
    layer = TunableLinear(256, 24, bias=True, max_m=4, tuner=tuner, runners=runners)
    x = torch.randn(3, 256)
    with autotune(tmp_path / "cache.json", tuner):
        layer(x)
    # Buckets 2 and 4 are timed; bucket 1 has one candidate (the tiled GEMM offers nothing for
    # one row), which is picked without timing.
    assert tuner.stats.profiles_tuned == 2 and tuner.stats.untimed_picks == 1
    for m in (2, 3, 4):
        out = layer(torch.randn(m, 256))
        assert _RecordingTriton.last == fastest  # lookups run the picked split-K tactic
        assert out.shape == (m, 24)
    x = torch.randn(2, 256)
    assert torch.allclose(
        layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5
    )
    saved = json.loads((tmp_path / "cache.json").read_text())
    assert "split_k" in json.dumps(saved)


@needs_interpreter
def test_tunable_linear_with_the_wallclock_timer_on_cpu():
    runners = (TorchGemmRunner(), TritonGemmRunner(max_tactics=2, min_rows=1))
    tuner = AutoTuner(
        # The median of three windows: one window of the torch call stalled by a busy CPU (17.6
        # ms in one run beside other test processes) made the interpreted kernel look faster.
        timer=WallClockTimer(samples=3),
        show_progress=False,
        policy=TuningPolicy(rounds=1, remeasure_top=0),
    )
    layer = TunableLinear(64, 32, bias=False, max_m=2, tuner=tuner, runners=runners)
    x = torch.randn(2, 64)
    # One intra-op thread: with the test processes beside it on a small CPU, torch's spinning
    # worker threads made one 2x64 product take 24 ms a call (median of three windows).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with autotune(tuner=tuner):
            out = layer(x)
    finally:
        torch.set_num_threads(threads)
    # Bucket 2 is timed; bucket 1 has only torch (the tiled GEMM offers nothing for one row).
    assert tuner.stats.profiles_tuned == 1 and tuner.stats.tactics_timed >= 2
    assert not tuner.stats.tactic_failures
    # The interpreter runs numpy per program: cuBLAS-less CPU torch wins by far.
    rows = tuner.summary_rows()
    assert len(rows) == 2 and all("TorchGemmRunner" in row[2] for row in rows)
    assert torch.allclose(out, x @ layer.weight.T, atol=1e-5)


class _FirstTritonTactic:
    """Fake timer that makes the first Triton tactic of every op the fastest."""

    name = "fake"

    def measure(self, fn, *, warmup, repeat):
        fn(0)
        return Measurement.from_samples([1.0], calls_per_sample=1, timer=self.name)


@needs_interpreter
def test_rope_pick_is_shared_across_cache_sizes():
    from graphtune.ops import rope_kv_cache

    tuner = AutoTuner(
        timer=_FirstTritonTactic(),
        show_progress=False,
        policy=TuningPolicy(rounds=1, remeasure_top=0),
    )
    heads, kv, dim = 2, 1, 8

    def call(cache_rows, table_rows):
        qkv = torch.randn(2, (heads + 2 * kv) * dim)
        cos, sin = torch.randn(table_rows, dim), torch.randn(table_rows, dim)
        k, v = torch.zeros(cache_rows, dim), torch.zeros(cache_rows, dim)
        rows = torch.tensor([0, cache_rows - 1])
        return rope_kv_cache(
            qkv,
            torch.tensor([0, 1]),
            cos,
            sin,
            k,
            v,
            rows,
            num_heads=heads,
            num_kv_heads=kv,
            tuner=tuner,
            max_m=2,
        )

    with autotune(tuner=tuner):
        call(16, 8)
    hits = tuner.stats.hits
    call(100, 30)  # another cache and table size: same key
    assert tuner.stats.hits == hits + 1 and not tuner.stats.fallbacks


def test_triton_runners_pickle_for_subprocess_isolation():
    import pickle

    from graphtune.ops.rotary import TritonRopeRunner

    for runner in (TritonGemmRunner(sm_count=8), TritonRopeRunner(4, 2, True)):
        clone = pickle.loads(pickle.dumps(runner))
        assert clone.cache_key_extras() == runner.cache_key_extras()
        assert clone.compile_seconds == 0.0


def test_gemm_cold_l2_rotates_weight_copies_under_cache_keys_of_their_own(monkeypatch):
    from graphtune.autotuner import timing
    from graphtune.autotuner.isolation import InProcessExecutor
    from graphtune.ops import OpContext

    # Pretend the operands must be copied 3 times to exceed L2 (the CPU has no such rule).
    monkeypatch.setattr(timing, "cold_l2_copies", lambda nbytes, device: 3)
    sets_per_profile: list[int] = []
    begin = InProcessExecutor.begin
    monkeypatch.setattr(
        InProcessExecutor,
        "begin",
        lambda self, runners, sets, **kw: (
            sets_per_profile.append(len(sets)),
            begin(self, runners, sets, **kw),
        )[1],
    )
    keys = {}
    a, w, x = torch.randn(2, 32), torch.randn(48, 32), torch.randn(2, 48)
    for cold in (False, True):
        sets_per_profile.clear()
        tuner = AutoTuner(
            timer=_FirstTritonTactic(),
            show_progress=False,
            policy=TuningPolicy(rounds=1, remeasure_top=0),
        )
        ops = OpContext(tuner, 2, gemm_cold_l2=cold)
        with autotune(tuner=tuner):
            ops.gemm(a, w)
            ops.gemm(a, w, residual=x, inplace=True)
        keys[cold] = {k for k, _ in tuner.cache.items()}
        # 2 GEMM forms x buckets 1, 2; with cold L2 each profile rotates 3 copies of its operands.
        assert sets_per_profile == [3 if cold else 1] * 4
    # The same keys but for the timing, so a warm-L2 pick never answers a cold-L2 call.
    assert len(keys[True]) == 4 and {k.timing for k in keys[True]} == {"fake+cold_l2"}
    assert {replace(k, timing="fake") for k in keys[True]} == keys[False]


def test_fused_op_priors_come_first_so_near_ties_go_to_them():
    from graphtune.autotuner.runner import preferred_first
    from graphtune.ops.activation import preferred_silu_tactic, silu_and_mul_tactics
    from graphtune.ops.rotary import PREFERRED_ROPE_TACTIC

    assert preferred_first([1, 2, 3], 3) == [3, 1, 2]
    assert preferred_first([1, 2, 3], 9) == [1, 2, 3]
    rope = rope_tactics(32, 8, 64)
    assert rope[0] == PREFERRED_ROPE_TACTIC and len(rope) == len({json.dumps(t) for t in rope})
    # The largest block <= 1024 with >= 16 programs, 4 elements per thread.
    assert preferred_silu_tactic(8192, 1) == {"block": 512, "warps": 4}
    assert preferred_silu_tactic(8192, 8) == {"block": 1024, "warps": 8}
    assert preferred_silu_tactic(100, 1) == {"block": 256, "warps": 2}
    for rows in (1, 8, 64):
        tactics = silu_and_mul_tactics(8192, rows)
        assert tactics[0] == preferred_silu_tactic(8192, rows)
        same = sorted(map(json.dumps, silu_and_mul_tactics(8192)))
        assert sorted(map(json.dumps, tactics)) == same  # the same set, reordered
    assert rms_norm_tactics(2048)[0] == {"block": 2048, "warps": 4}  # already the best on an H200
