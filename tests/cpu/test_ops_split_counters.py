"""A split tactic that meets more output tiles than arrival counters runs unsplit, correctly.

A bucket's pick serves every larger size mapped to it (every size past a capped bucket), so a
split-K tactic tuned on a few rows can be launched on a batch with more tiles than the device's
arrival counters (``graphtune.ops._counters.COUNTERS``). These tests lower the limit instead of
launching 65536 programs in the interpreter: each split runner must give the float64 answer, not
an error.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from graphtune.ops import _counters, _triton  # noqa: E402
from graphtune.ops.gemm import (  # noqa: E402
    TritonGemmRunner,
    TritonGemvRunner,
    TritonSkinnyGemmRunner,  # noqa: E402
)
from graphtune.ops.moe import TritonMoeRouter  # noqa: E402
from graphtune.ops.moe.router import router_tactics  # noqa: E402
from moe_routing_check import assert_routed_as_float64  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)


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
