"""benchmarks/gemv_sweep.py's tactic space and arguments, without a GPU."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import gemv_sweep  # noqa: E402

from graphtune.ops.fused_gemv.family import (  # noqa: E402
    PLAIN,
    ROPE,
    SILU,
    GemvShape,
    check_fused_tactic,
    fused_gemv_tactics,
)

SHAPES = [  # Llama-1B: QKV (RoPE tiles), O, gate/up, down
    (ROPE, 32, 48, 2048),
    (PLAIN, 2048, 1, 2048),
    (SILU, 8192, 1, 2048),
    (PLAIN, 2048, 1, 8192),
]


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("mode,columns,heads,k", SHAPES)
def test_space_holds_every_offered_tactic_and_only_valid_ones(m, mode, columns, heads, k):
    shape = GemvShape(mode, m, columns, heads, k, 2)
    space = gemv_sweep.space_for(shape, 132)
    keys = [gemv_sweep.tactic_key(t) for t in space]
    assert len(keys) == len(set(keys))
    assert all(check_fused_tactic(t) is None for t in space)
    assert all(t["split"] <= math.ceil(k / t["bk"]) for t in space)
    assert {t["dot"] for t in space} == ({0, 1} if m == 1 else {1})
    offered = fused_gemv_tactics(shape, sm_count=132)
    assert {gemv_sweep.tactic_key(t) for t in offered} <= set(keys)
