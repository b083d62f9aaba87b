"""Picks served outside the conditions they were tuned in still give the right answer.

Picks are tuned on contiguous synthetic inputs of the bucket's size and looked up by shape, dtype
and device only:

* a weight passed as a transposed view, a strided bias or a strided RMSNorm weight reaches the
  picked runner at serving time; the Triton kernels that assume unit strides must not read it
  wrongly (the runner runs torch);
* a bucket's pick serves every larger size mapped to it (every size past a capped bucket), so a
  split tactic tuned on a few rows can meet more output tiles than the device's arrival counters
  (``graphtune.ops._counters.COUNTERS``); it runs unsplit. These tests lower the limit instead of
  launching 65536 programs in the interpreter.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from fake_timers import last_wins_tuner  # noqa: E402

from graphtune.autotuner import autotune  # noqa: E402
from graphtune.ops import _counters, _triton  # noqa: E402
from graphtune.ops.gemm import (  # noqa: E402
    TritonGemmRunner,
    TritonGemvRunner,
    TritonSkinnyGemmRunner,
    gemm,
)
from graphtune.ops.moe import TritonMoeRouter  # noqa: E402
from graphtune.ops.moe.router import router_tactics  # noqa: E402
from moe_routing_check import assert_routed_as_float64  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def test_a_skinny_pick_served_a_transposed_weight_gives_the_right_product():
    gen = torch.Generator().manual_seed(11)
    a, w_t = torch.randn(4, 128, generator=gen), torch.randn(128, 64, generator=gen)
    tuner = last_wins_tuner()  # the skinny GEMM is the last runner with tactics at 4 rows
    with autotune(tuner=tuner):
        gemm(a, w_t.t().contiguous(), tuner=tuner, max_m=4)  # tuned on a contiguous weight
    picks = " ".join(row[2] for row in tuner.summary_rows())
    assert "TritonSkinnyGemmRunner" in picks
    got = gemm(a, w_t.t(), tuner=tuner, max_m=4)  # the same key, a transposed view
    assert _err(got, a.double() @ w_t.double()) < 1e-5


@pytest.mark.parametrize(
    "runner,tactic",
    [
        (
            TritonSkinnyGemmRunner(),
            {"bn": 16, "bk": 32, "warps": 4, "dot": 1, "stages": 2, "split": 1},
        ),
        (
            TritonGemmRunner(min_rows=1),
            {"bm": 16, "bn": 16, "bk": 32, "warps": 4, "stages": 2, "split_k": 1},
        ),
    ],
    ids=["skinny", "tiled"],
)
def test_a_tactic_on_inputs_its_kernel_cannot_take_runs_torch(runner, tactic):
    gen = torch.Generator().manual_seed(5)
    a, w = torch.randn(3, 64, generator=gen), torch.randn(32, 64, generator=gen)
    bias = torch.randn(32, 2, generator=gen)[:, 0]  # a strided bias: no Triton GEMM takes it
    inputs = [a, w, bias, None, False]
    assert not runner.supports(inputs)
    want = a.double() @ w.double().T + bias.double()
    assert _err(runner.forward(inputs, tactic), want) < 1e-5


def test_the_tiled_gemm_covers_the_few_rows_the_skinny_gemm_offers_nothing_for():
    # A router of 8 experts: N = 8 is too narrow for the skinny GEMM's 64-row weight tiles at 4
    # rows, so the tiled GEMM keeps its tactics there; a wide projection is the skinny GEMM's.
    tiled, skinny = TritonGemmRunner(), TritonSkinnyGemmRunner()
    a = torch.randn(4, 2048)
    router = [a, torch.randn(8, 2048), None, None, False]
    assert skinny.get_valid_tactics(router, None) == []
    assert tiled.get_valid_tactics(router, None)
    wide = [a, torch.randn(3072, 2048), None, None, False]
    assert skinny.get_valid_tactics(wide, None) and tiled.get_valid_tactics(wide, None) == []


@pytest.fixture
def few_counters(monkeypatch):
    """Two arrival counters: the buffer itself keeps its full size (made before the limit)."""
    _counters.arrival_counters(torch.device("cpu"), 1, user="test", fix="none")
    monkeypatch.setattr(_counters, "COUNTERS", 2)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _gemm_inputs(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    return a, w, a.double() @ w.double().T


@pytest.mark.parametrize(
    "runner,tactic",
    [
        (TritonGemvRunner(), {"bn": 4, "bk": 64, "warps": 1, "split_k": 2}),
        (
            TritonGemmRunner(min_rows=1),
            {"bm": 16, "bn": 16, "bk": 32, "warps": 4, "stages": 2, "split_k": 2},
        ),
        (
            TritonSkinnyGemmRunner(),
            {"bn": 16, "bk": 32, "warps": 4, "dot": 1, "stages": 2, "split": 2},
        ),
    ],
    ids=["gemv", "tiled", "skinny"],
)
def test_split_k_beyond_the_counters_runs_unsplit(few_counters, runner, tactic):
    a, w, want = _gemm_inputs(3, 40, 128)  # 3 or more output tiles: more than 2 counters
    got = runner.forward([a, w, None, None, False], tactic)
    assert _rel(got, want) < 1e-5


def test_router_split_beyond_the_counters_runs_unsplit(few_counters):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(5, 256, generator=gen)
    weight = torch.randn(8, 256, generator=gen) / 16
    runner = TritonMoeRouter(2, True, True)
    # The bucket of one token offers split tactics; 5 tokens need 5 counters.
    split = next(t for t in router_tactics(1, 8, 256) if t["splits"] > 1)
    got_w, got_ids = runner.forward([h, weight], split)
    assert_routed_as_float64(got_w, got_ids, h, weight, 2, True, "split past the counters")


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("runner_name", ["norm_linear", "norm_gate_up_silu"])
def test_a_fused_norm_pick_served_a_strided_norm_weight_gives_the_right_result(runner_name):
    from graphtune.ops.fused.mlp import TritonGateUpSiluNormInLoop
    from graphtune.ops.fused.projection import TritonNormLinearInLoop

    gen = torch.Generator().manual_seed(3)
    x, eps = torch.randn(5, 32, generator=gen), 1e-6
    strided = torch.randn(32, 2, generator=gen)[:, 0]  # a column: stride 2
    if runner_name == "norm_linear":
        runner, w = TritonNormLinearInLoop(), torch.randn(16, 32, generator=gen)
        inputs = [x, strided.contiguous(), w, None, eps]
        want = _rms(x, strided, eps) @ w.double().t()
    else:
        runner, w = TritonGateUpSiluNormInLoop(), torch.randn(32, 32, generator=gen)
        inputs = [x, strided.contiguous(), w, eps]
        gate, up = (_rms(x, strided, eps) @ w.double().t()).chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
    tactic = runner.get_valid_tactics(inputs, None)[0]  # listed for a contiguous weight
    inputs[1] = strided
    assert not runner.supports(inputs)
    assert _err(runner.forward(inputs, tactic=tactic), want) < 1e-5
