"""Fused-MoE tactics (pure): every pruning rule of moe_tactics on the issue's expert shapes and
buckets, check_moe_tactic, and the worst-case size of the sorted layout."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtune.autotuner.config import power_of_two_buckets
from graphtune.ops.moe import check_moe_tactic, max_sorted_rows, moe_tactics
from graphtune.ops.moe.tactics import (
    GROUP_M,
    MAX_ACCUMULATORS_PER_THREAD,
    STREAMING_CONFIGS,
    TACTIC_KEYS,
    TILED_CONFIGS,
    block_m_choices,
    rows_per_expert,
)

SHAPES = {  # name: (E, k, H, I)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
H200_SMEM = 227 * 1024


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("itemsize", [2, 4])
def test_every_tactic_obeys_every_pruning_rule(name, itemsize):
    experts, top_k, hidden, inter = SHAPES[name]
    cap = 1 << (min(hidden, inter) - 1).bit_length()
    for tokens in power_of_two_buckets(4096):
        tactics = moe_tactics(
            tokens, experts, top_k, hidden, inter, itemsize=itemsize, smem_bytes=H200_SMEM
        )
        assert 4 <= len(tactics) <= 24, (name, tokens, len(tactics))
        idents = [tuple(t[key] for key in TACTIC_KEYS) for t in tactics]
        assert len(set(idents)) == len(idents)
        per_expert = rows_per_expert(tokens, experts, top_k)
        bms = block_m_choices(tokens, experts, top_k)
        assert {t["block_m"] for t in tactics} <= set(bms)
        for t in tactics:
            assert check_moe_tactic(t) is None
            bm, bn, bk = t["block_m"], t["block_n"], t["block_k"]
            assert bn <= cap and bk <= cap
            assert t["stages"] * (bm + 2 * bn) * bk * itemsize <= H200_SMEM
            assert 2 * bm * bn <= MAX_ACCUMULATORS_PER_THREAD * 32 * t["warps"]
            configs = STREAMING_CONFIGS if bm <= 32 else TILED_CONFIGS
            assert (bn, bk, t["warps"], t["stages"]) in configs
            if t["group_m"] != 1:
                assert t["group_m"] == GROUP_M and bm >= 64 and per_expert >= 2 * bm


def test_block_m_follows_the_rows_per_expert():
    qwen = SHAPES["qwen3-30b-a3b"][:2]
    mixtral = SHAPES["mixtral-8x7b"][:2]
    assert block_m_choices(1, *qwen) == [16]  # decode: a row or a few per selected expert
    assert block_m_choices(64, *qwen) == [16]
    assert block_m_choices(512, *qwen) == [32, 16]
    assert block_m_choices(4096, *qwen) == [128, 64]
    assert block_m_choices(1, *mixtral) == [16]
    assert block_m_choices(128, *mixtral) == [32, 16]
    assert block_m_choices(256, *mixtral) == [64, 32]
    assert block_m_choices(4096, *mixtral) == [128, 64]


def test_small_dimensions_clamp_the_blocks():
    tactics = moe_tactics(3, 4, 2, 40, 24, itemsize=4, smem_bytes=H200_SMEM)
    assert tactics and all(t["block_n"] == 32 and t["block_k"] == 32 for t in tactics)


def test_a_small_shared_memory_budget_prunes_deep_pipelines():
    big = moe_tactics(4096, 8, 2, 4096, 14336, itemsize=2, smem_bytes=H200_SMEM)
    small = moe_tactics(4096, 8, 2, 4096, 14336, itemsize=2, smem_bytes=99 * 1024)
    assert 0 < len(small) < len(big)
    assert all(
        t["stages"] * (t["block_m"] + 2 * t["block_n"]) * t["block_k"] * 2 <= 99 * 1024
        for t in small
    )


@pytest.mark.parametrize(
    "tactic",
    [
        None,
        -1,
        {"block_m": 16},
        {"block_m": 8, "block_n": 32, "block_k": 32, "group_m": 1, "warps": 4, "stages": 2},
        {"block_m": 256, "block_n": 32, "block_k": 32, "group_m": 1, "warps": 4, "stages": 2},
        {"block_m": 16, "block_n": 48, "block_k": 32, "group_m": 1, "warps": 4, "stages": 2},
        {"block_m": 16, "block_n": 32, "block_k": 32, "group_m": 0, "warps": 4, "stages": 2},
        {"block_m": 16, "block_n": 32, "block_k": 32, "group_m": 1, "warps": 3, "stages": 2},
        {"block_m": 16, "block_n": 32, "block_k": 32, "group_m": 1, "warps": 4, "stages": True},
    ],
)
def test_check_moe_tactic_names_the_broken_rule(tactic):
    assert check_moe_tactic(tactic) is not None


def _real_rows(ids: torch.Tensor, experts: int, block_m: int) -> int:
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    return int(sum(math.ceil(int(c) / block_m) * block_m for c in counts))


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.integers(0, 300),
    experts=st.integers(1, 40),
    top_k=st.integers(1, 8),
    block_m=st.sampled_from([16, 32, 64, 128]),
    seed=st.integers(0, 2**31),
    skew=st.booleans(),
)
def test_max_sorted_rows_bounds_every_routing(tokens, experts, top_k, block_m, seed, skew):
    gen = torch.Generator().manual_seed(seed)
    high = min(experts, 3) if skew else experts  # skewed: a few experts take everything
    ids = torch.randint(0, high, (tokens, top_k), generator=gen)
    rows = max_sorted_rows(tokens * top_k, experts, block_m)
    assert rows % block_m == 0
    assert _real_rows(ids, experts, block_m) <= rows
    # Tight: one pair per expert on min(E, P) experts needs exactly this many blocks.
    hit = min(experts, tokens * top_k)
    assert rows < tokens * top_k + hit * (block_m - 1) + block_m
