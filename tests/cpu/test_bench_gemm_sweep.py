"""benchmarks/gemm_sweep.py's tactic space and its usage errors, without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import gemm_sweep  # noqa: E402

from graphtune.ops.gemm.tiled import check_gemm_tactic, gemm_tactics  # noqa: E402

SMEM = 227 * 1024


def _key(tactic: dict) -> tuple:
    return tuple(sorted(tactic.items()))


@pytest.mark.parametrize("m,n,k", [(128, 3072, 2048), (128, 2048, 8192), (64, 2048, 2048)])
def test_space_holds_every_offered_tactic_and_only_valid_ones(m, n, k):
    space = gemm_sweep.space_for(m, n, k, paired=False, smem=SMEM)
    keys = [_key(t) for t in space]
    assert len(keys) == len(set(keys))
    for t in space:
        assert check_gemm_tactic(t, k) is None
        assert t["stages"] * (t["bm"] + t["bn"]) * t["bk"] * 2 <= SMEM
        assert t["bm"] <= max(16, 1 << (m - 1).bit_length())
    offered = gemm_tactics(m, n, k, itemsize=2, smem_bytes=SMEM, sm_count=132)
    missing = [t for t in offered if t["bm"] >= 32 and _key(t) not in set(keys)]
    assert not missing  # every offered tile from bm 32 (the sweep's smallest) is swept


def test_paired_space_has_one_split_and_room_for_the_up_tile():
    space = gemm_sweep.space_for(128, 8192, 2048, paired=True, smem=SMEM)
    assert space and all(t["split_k"] == 1 for t in space)
    assert all(t["stages"] * (t["bm"] + 2 * t["bn"]) * t["bk"] * 2 <= SMEM for t in space)
