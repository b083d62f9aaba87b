"""The tuning config of ``rope_kv_cache``: which of its inputs' sizes are part of a tuning key.

The cache and the cos/sin tables are sized by the engine's ``max_seq_len`` and slot count, which
say nothing about the kernel's speed (it touches ``B * kv_heads`` rows). So the tuning config
pins their row counts to canonical sizes (:data:`TABLE_ROWS`, :data:`CACHE_ROWS`): a tuned pick
is reused for any cache size, and ``graphtune tune`` can tune ahead of the engine. A bucket that
writes more than :data:`CACHE_ROWS` rows (``B * kv_heads``) gets a cache of as many rows
(:func:`canonical_cache_rows`), since each write row must be a distinct cache row; every other
bucket keeps :data:`CACHE_ROWS`. Synthetic positions and write rows are made valid for those sizes
(:func:`canonical_rope_indices`); ``graphtune.ops.fused.qkv`` uses both.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from graphtune.autotuner.config import ConstraintSpec, DynamicTensorSpec, TuningConfig
from graphtune.errors import InputError

TABLE_ROWS = 4096
CACHE_ROWS = 65536


def canonical_cache_rows(write_rows: int) -> int:
    """Rows of the synthetic caches of a bucket that writes ``write_rows`` rows (``B *
    kv_heads``): :data:`CACHE_ROWS`, or ``write_rows`` when that is more (the rows written must
    be distinct rows of the cache)."""
    return max(CACHE_ROWS, write_rows)


def canonical_rope_indices(
    positions: torch.Tensor, write_rows: torch.Tensor, table_rows: int, cache_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic ``positions`` and ``write_rows`` that are valid for the given table and cache.

    Positions index the cos/sin tables; write rows must be distinct rows of the cache (two
    programs writing one row would race, which no real step does).

    Raises:
        InputError: There are more write rows than cache rows (size the cache with
            :func:`canonical_cache_rows`).
    """
    if write_rows.numel() > cache_rows:
        raise InputError(
            f"rope_kv_cache: {write_rows.numel()} write rows need as many distinct cache rows, "
            f"but the synthetic cache has {cache_rows}; size it with canonical_cache_rows."
        )
    device = positions.device
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    positions = torch.randint(
        0, table_rows, positions.shape, generator=gen, device=device, dtype=positions.dtype
    )
    perm = torch.randperm(cache_rows, generator=gen, device=device)
    return positions, perm[: write_rows.numel()].to(write_rows.dtype)


def _canonical_inputs(inputs: list[Any]) -> list[Any]:
    """Makes synthetic index inputs valid for the canonical table and cache sizes."""
    qkv, positions, cos, sin, k_cache, v_cache, rows = inputs[:7]
    positions, rows = canonical_rope_indices(positions, rows, cos.shape[0], k_cache.shape[0])
    return [qkv, positions, cos, sin, k_cache, v_cache, rows, *inputs[7:]]


@functools.lru_cache(maxsize=16)
def rope_config(num_kv_heads: int, max_m: int | None = None) -> TuningConfig:
    """Tuning config: tokens (qkv rows) bucketed; positions and write rows follow them; table
    and cache rows pinned to :data:`TABLE_ROWS` and :func:`canonical_cache_rows` (see the module
    doc)."""

    def batch(shapes: Any) -> int:
        return int(shapes[0][0])

    def rows(shapes: Any) -> int:
        return int(shapes[0][0]) * num_kv_heads

    def table(shapes: Any) -> int:
        return TABLE_ROWS

    def cache(shapes: Any) -> int:
        return canonical_cache_rows(rows(shapes))

    return TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0),),
        constraint_specs=(
            ConstraintSpec(1, 0, batch),
            ConstraintSpec(2, 0, table),
            ConstraintSpec(3, 0, table),
            ConstraintSpec(4, 0, cache),
            ConstraintSpec(5, 0, cache),
            ConstraintSpec(6, 0, rows),
        ),
        max_value=max_m,
        inputs_pre_hook=_canonical_inputs,
    )
