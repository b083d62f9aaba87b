"""TritonGemvRunner (skinny-M GEMV) on the CPU: the kernel under Triton's interpreter against a
float64 reference, the tactic pruning rules, bad tactics, and tuning through the AutoTuner.

Shapes are small (the interpreter runs each program in numpy, milliseconds per program) and every
test draws fresh random inputs; the seed is in the assertion message.
"""

from __future__ import annotations

import math
import os

import torch

# The interpreter must be chosen before Triton decorates the kernels (see test_ops_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from graphtune.autotuner import AutoTuner, TuningPolicy, autotune  # noqa: E402
from graphtune.autotuner.identity import runner_id  # noqa: E402
from graphtune.autotuner.timing.base import Measurement  # noqa: E402
from graphtune.errors import ConfigError  # noqa: E402
from graphtune.ops import _triton  # noqa: E402
from graphtune.ops.gemm import (  # noqa: E402
    TorchGemmRunner,
    TritonGemmRunner,
    TunableLinear,
    gemm,
    gemm_runners,
)
from graphtune.ops.gemm.gemv import (  # noqa: E402
    BK_CHOICES,
    BN_CHOICES,
    MAX_M,
    TritonGemvRunner,
    check_gemv_tactic,
    defer_reduction,
    gemv_tactics,
    rows_per_program,
)

needs_interpreter = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)

# Relative error against float64 of the same (rounded) inputs: float32 accumulation everywhere;
# a bfloat16 result is rounded once (2^-9 relative), float32 only by summation order.
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
DECODE_SHAPES = {  # Llama-3.2-1B decode GEMMs, (N, K)
    "qkv": (3072, 2048),
    "o_proj": (2048, 2048),
    "down": (2048, 8192),
    "gate_up": (16384, 2048),
    "lm_head": (128256, 2048),
}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def _want(a, w, bias=None, residual=None) -> torch.Tensor:
    out = a.double() @ w.double().T
    if bias is not None:
        out = out + bias.double()
    return out + residual.double() if residual is not None else out


# --- the kernel under the interpreter ------------------------------------------------------------

# (M, N, K, tactic): N never a multiple of bn; K a multiple of bk (EVEN_K) or not (masked loop);
# 3 rows run a 4-row program with one clamped row; split-K of 2 and 4.
KERNEL_CASES = [
    (1, 40, 256, {"bn": 16, "bk": 128, "warps": 4, "split_k": 1}),
    (3, 37, 100, {"bn": 8, "bk": 64, "warps": 2, "split_k": 1}),
    (8, 20, 256, {"bn": 16, "bk": 64, "warps": 2, "split_k": 2}),
    (3, 24, 512, {"bn": 32, "bk": 128, "warps": 4, "split_k": 4}),
]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,tactic", KERNEL_CASES)
def test_gemv_matches_float64(dtype, m, n, k, tactic):
    gen = _gen()
    runner = TritonGemvRunner()
    a, w, bias = (_randn(gen, *s, dtype=dtype) for s in ((m, k), (n, k), (n,)))
    for b in (None, bias):
        got = runner.forward([a, w, b, None, False], tactic)
        assert got.dtype == dtype and got.shape == (m, n)
        assert _rel(got, _want(a, w, b)) < TOL[dtype], (tactic, b is not None, gen.initial_seed())


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 2])
def test_gemv_residual_in_place_out_of_place_and_out(dtype, split):
    gen = _gen()
    runner = TritonGemvRunner()
    m, n, k = 2, 24, 256
    tactic = {"bn": 16, "bk": 128, "warps": 2, "split_k": split}
    a, w, bias = (_randn(gen, *s, dtype=dtype) for s in ((m, k), (n, k), (n,)))
    residual = _randn(gen, m, n, dtype=dtype)
    want = _want(a, w, bias, residual)
    seed = gen.initial_seed()

    got = runner.forward([a, w, bias, residual, False], tactic)
    assert got is not residual and _rel(got, want) < TOL[dtype], (tactic, seed)
    out = torch.empty(m, n, dtype=dtype)
    assert runner.forward([a, w, bias, residual, False, out], tactic) is out
    assert torch.equal(out, got)  # same kernel, same order: bit-equal
    assert torch.equal(runner.forward([a, w, bias, residual, False], tactic), got)  # no atomics
    inplace = residual.clone()
    assert runner.forward([a, w, bias, inplace, True], tactic) is inplace  # like addmm_
    assert torch.equal(inplace, got)
    plain = torch.empty(m, n, dtype=dtype)  # out= without bias or residual
    runner.forward([a, w, None, None, False, plain], tactic)
    assert _rel(plain, _want(a, w)) < TOL[dtype], (tactic, seed)


@needs_interpreter
def test_deferred_and_per_chunk_reductions_agree():
    gen = _gen()
    runner = TritonGemvRunner()
    m, n, k = 8, 20, 256
    a, w = _randn(gen, m, k), _randn(gen, n, k)
    deferred = {"bn": 4, "bk": 64, "warps": 1, "split_k": 1}  # 8 rows x 8 products per thread
    chunked = {"bn": 16, "bk": 128, "warps": 1, "split_k": 1}  # 8 rows x 64: too many registers
    assert defer_reduction(8, 4, 64, 1) and not defer_reduction(8, 16, 128, 1)
    want = _want(a, w)
    results = [runner.forward([a, w, None, None, False], t) for t in (deferred, chunked)]
    for tactic, got in zip((deferred, chunked), results, strict=True):
        assert _rel(got, want) < TOL[torch.float32], (tactic, gen.initial_seed())


@needs_interpreter
def test_a_bucket_pick_runs_every_row_count_of_its_bucket():
    # gemm_config maps a live M to the power of two below it (and caps it at max_m), so the pick
    # for bucket 8 also runs 9..15 rows (two row blocks) and bucket 4's runs 5..7 (8-row program).
    gen = _gen()
    runner = TritonGemvRunner()
    n, k = 20, 128
    w = _randn(gen, n, k)
    tactic = {"bn": 32, "bk": 128, "warps": 4, "split_k": 1}
    for m in (5, 12, 15):
        a = _randn(gen, m, k)
        assert rows_per_program(m) == min(8, 1 << (m - 1).bit_length())
        assert _rel(runner.forward([a, w, None, None, False], tactic), _want(a, w)) < 1e-5, m
    empty = runner.forward([_randn(gen, 0, k), w, None, None, False], tactic)
    assert empty.shape == (0, n)


@needs_interpreter
def test_every_valid_tactic_of_a_small_shape_runs_and_is_correct():
    gen = _gen()
    # Few SMs: the small grid of one row gets split-K candidates.
    runner = TritonGemvRunner(sm_count=4)
    m, n, k = 1, 40, 256
    a, w, bias = _randn(gen, m, k), _randn(gen, n, k), _randn(gen, n)
    inputs = [a, w, bias, None, False]
    tactics = runner.get_valid_tactics(inputs, None)
    assert 8 <= len(tactics) <= 16 and any(t["split_k"] > 1 for t in tactics)
    want = _want(a, w, bias)
    for tactic in tactics:
        assert _rel(runner.forward(inputs, tactic), want) < TOL[torch.float32], tactic
    assert torch.equal(runner.forward(inputs, -1), torch.nn.functional.linear(a, w, bias))


@needs_interpreter
def test_tuned_gemm_runs_the_gemv_pick_for_every_m_of_each_bucket():
    class LastIsFastest:  # each measurement beats the last: the last candidate (a GEMV) wins
        name = "fake"
        calls = 0

        def measure(self, fn, *, warmup, repeat):
            self.calls += 1
            return Measurement.from_samples(
                [1000.0 / self.calls], calls_per_sample=1, timer=self.name
            )

    tuner = AutoTuner(
        timer=LastIsFastest(),
        show_progress=False,
        policy=TuningPolicy(rounds=1, remeasure_top=0, tie_tolerance=0.0),
    )
    runners = (TorchGemmRunner(), TritonGemmRunner(max_tactics=2), TritonGemvRunner())
    gen = _gen()
    layer = TunableLinear(64, 24, bias=True, max_m=2, tuner=tuner, runners=runners)
    with autotune(tuner=tuner):
        layer(_randn(gen, 2, 64))
    assert tuner.stats.profiles_tuned == 2  # buckets 1 and 2: the GEMV offers tactics up to 2
    assert all("TritonGemvRunner" in row[2] for row in tuner.summary_rows())
    for m in (1, 2, 3, 7, 11):  # 3 rows and more: bucket 2 (max_m caps it), several row blocks
        x = _randn(gen, m, 64)
        assert _rel(layer(x), _want(x, layer.weight, layer.bias)) < 1e-5, m
    assert not tuner.stats.fallbacks


# --- tactics (pure) ------------------------------------------------------------------------------


@pytest.mark.parametrize("itemsize", [2, 4])
def test_gemv_tactics_obey_every_pruning_rule(itemsize):
    sms = 132
    for name, (n, k) in DECODE_SHAPES.items():
        for m in range(1, MAX_M + 1):
            tactics = gemv_tactics(m, n, k, itemsize=itemsize, sm_count=sms)
            assert 4 <= len(tactics) <= 16, (name, m)
            idents = [(t["split_k"], t["warps"], t["bn"], t["bk"]) for t in tactics]
            assert idents == sorted(set(idents)), (name, m)  # simplest first, no duplicates
            bm = rows_per_program(m)
            for t in tactics:
                assert check_gemv_tactic(t, k) is None
                assert t["bn"] in BN_CHOICES and t["bk"] in BK_CHOICES
                assert t["warps"] in (1, 2, 4, 8)
                assert 16 <= t["bn"] * t["bk"] * itemsize // (32 * t["warps"]) <= 64
                assert 2 * t["bn"] >= bm
                assert t["bn"] * (k // t["split_k"]) * itemsize >= 4096
                if t["split_k"] > 1:
                    programs = math.ceil(n / t["bn"]) * math.ceil(m / bm)
                    assert k % (t["split_k"] * t["bk"]) == 0
                    assert programs < 2 * sms and programs * t["split_k"] <= 4 * sms
    # The small grids (N = 2048) are offered split-K; the LM head's 128256 rows are not.
    assert any(t["split_k"] > 1 for t in gemv_tactics(1, 2048, 2048, itemsize=2, sm_count=sms))
    assert all(t["split_k"] == 1 for t in gemv_tactics(1, 128256, 2048, itemsize=2, sm_count=sms))


def test_gemv_tactics_only_for_buckets_up_to_eight_rows():
    assert gemv_tactics(8, 3072, 2048, itemsize=2, sm_count=132)
    for m in (9, 12, 16, 64):
        assert gemv_tactics(m, 3072, 2048, itemsize=2, sm_count=132) == []
    runner = TritonGemvRunner(max_rows=MAX_M)
    w = torch.randn(40, 64)
    if _triton.device_supported(torch.device("cpu")):
        assert runner.get_valid_tactics([torch.randn(8, 64), w, None, None, False], None)
        # By default only the buckets where the GEMV measured near the best (graphtune.ops._pruned).
        default = TritonGemvRunner()
        assert default.get_valid_tactics([torch.randn(2, 64), w, None, None, False], None)
        assert default.get_valid_tactics([torch.randn(4, 64), w, None, None, False], None) == []
    assert runner.get_valid_tactics([torch.randn(16, 64), w, None, None, False], None) == []
    assert runner.get_valid_tactics([torch.randn(9, 64), w, None, None, False], None) == []
    # Same operand rules as the tiled GEMM: one dtype, a contiguous residual.
    mixed = [torch.randn(2, 64), w.double(), None, None, False]
    strided = [torch.randn(2, 64), w, None, torch.randn(40, 2).T, False]
    assert runner.get_valid_tactics(mixed, None) == []
    assert runner.get_valid_tactics(strided, None) == []


def test_bad_gemv_tactics_raise_config_error_naming_the_rule():
    good = {"bn": 16, "bk": 128, "warps": 4, "split_k": 2}
    assert check_gemv_tactic(good, 256) is None
    cases = {
        "keys": {"bn": 16, "bk": 128, "warps": 4},
        "positive int": {**good, "warps": True},
        "powers of two": {**good, "bn": 24},
        "divisible by 512": {**good, "split_k": 4},
    }
    runner = TritonGemvRunner()
    inputs = [torch.randn(2, 256), torch.randn(40, 256), None, None, False]
    for rule, tactic in cases.items():
        assert rule in check_gemv_tactic(tactic, 256), rule
        with pytest.raises(ConfigError, match=rule):
            runner.forward(inputs, tactic)


def test_gemm_runners_list_the_gemv_last_and_ids_name_their_modules():
    names = [type(r).__name__ for r in gemm_runners()]
    if _triton.triton_available():
        # The GEMV, then the swapped-operand tensor-core GEMM of graphtune.ops.fused.
        assert names == [
            "TorchGemmRunner",
            "TritonGemmRunner",
            "TritonGemvRunner",
            "TritonSkinnyGemmRunner",
        ]
    else:
        assert names == ["TorchGemmRunner"]
    assert [runner_id(r) for r in (TorchGemmRunner(), TritonGemmRunner(), TritonGemvRunner())] == [
        "graphtune.ops.gemm.common.TorchGemmRunner",
        "graphtune.ops.gemm.tiled.TritonGemmRunner",
        "graphtune.ops.gemm.gemv.TritonGemvRunner",
    ]  # the configuration is the default, so no extras
    assert runner_id(TritonGemvRunner(sm_count=8)) != runner_id(TritonGemvRunner())


def test_untuned_gemm_still_falls_back_to_torch():
    a, w = torch.randn(3, 64), torch.randn(40, 64)
    tuner = AutoTuner(show_progress=False)
    assert torch.equal(gemm(a, w, tuner=tuner), torch.nn.functional.linear(a, w))
