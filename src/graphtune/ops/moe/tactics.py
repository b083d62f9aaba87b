"""Tactics of the Triton fused-MoE runner and the rules that prune them.

A tactic is ``{"block_m", "block_n", "block_k", "group_m", "warps", "stages"}``, shared by both
grouped GEMMs (gate/up and down) so that the space stays one list the tuner can time in full.
``block_m`` is also the padding unit of the sort step, so the sort depends on the tactic.

Pruning rules of :func:`moe_tactics` (a pruned config is never timed):

* ``block_m`` follows the rows an expert gets on average, ``ceil(T * k / E)`` under balanced
  routing: its next power of two clamped to ``[16, 128]`` and that value halved (``>= 16``, the
  smallest ``tl.dot`` tile). Decode batches (a row or a few per expert) get 16 only, since a
  larger block would be mostly padding;
* small blocks (``block_m <= 32``: the GEMMs stream the selected experts' weights) take the
  :data:`STREAMING_CONFIGS`, large ones the :data:`TILED_CONFIGS` (compute-bound tiles);
* ``block_n`` and ``block_k`` never exceed the next power of two of ``min(H, I)`` (clamped,
  duplicates dropped);
* shared memory: the gate/up kernel pipelines one activation tile and two weight tiles,
  ``stages * (block_m + 2 * block_n) * block_k * itemsize <= `` the device's budget;
* registers: the gate/up kernel holds two float32 accumulators, ``2 * block_m * block_n /
  (32 * warps) <= 128`` per thread (more spills);
* ``group_m = 8`` (program-id swizzle, see ``_kernels._tile_of``) only for large blocks when an
  expert spans at least two blocks on average; otherwise only ``group_m = 1``.
"""

from __future__ import annotations

import math
from typing import Any

from graphtune.autotuner.config import next_power_of_two

TACTIC_KEYS = ("block_m", "block_n", "block_k", "group_m", "warps", "stages")
BLOCK_M_RANGE = (16, 128)
#: (block_n, block_k, warps, stages) for blocks of <= 32 rows: wide K steps, many column tiles.
STREAMING_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (32, 64, 4, 4),
    (32, 128, 4, 4),
    (64, 64, 4, 4),
    (64, 128, 4, 3),
    (128, 64, 4, 3),
    (64, 256, 8, 2),
    (128, 128, 8, 3),
    (128, 64, 8, 4),
    (256, 64, 8, 3),
)
#: (block_n, block_k, warps, stages) for blocks of >= 64 rows: compute-bound tiles.
TILED_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (64, 64, 4, 4),
    (128, 64, 8, 3),
    (128, 32, 8, 4),
    (64, 128, 4, 3),
    (256, 64, 8, 3),
    (128, 64, 4, 4),
)
GROUP_M = 8
MAX_ACCUMULATORS_PER_THREAD = 128


def _power_of_two(value: Any, low: int, high: int) -> bool:
    ok = isinstance(value, int) and not isinstance(value, bool)
    return ok and low <= value <= high and value & (value - 1) == 0


def check_moe_tactic(tactic: Any) -> str | None:
    """Why ``tactic`` cannot run the fused-MoE kernels, or ``None`` when it can.

    Rules that hold on every shape: the six keys, power-of-two ``block_*`` of 16 .. 256
    (``block_m`` up to 128), ``warps`` a power of two up to 16, ``group_m`` and ``stages`` ints
    ``>= 1``.
    """
    if not isinstance(tactic, dict) or set(tactic) != set(TACTIC_KEYS):
        return f"a fused-MoE tactic is a dict with keys {TACTIC_KEYS}, got {tactic!r}"
    if not _power_of_two(tactic["block_m"], *BLOCK_M_RANGE):
        return f"block_m must be a power of two in {list(BLOCK_M_RANGE)}, got {tactic!r}"
    if not all(_power_of_two(tactic[key], 16, 256) for key in ("block_n", "block_k")):
        return f"block_n and block_k must be powers of two in [16, 256], got {tactic!r}"
    if not _power_of_two(tactic["warps"], 1, 16):
        return f"warps must be a power of two <= 16, got {tactic!r}"
    for key in ("group_m", "stages"):
        value = tactic[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{key} must be an int >= 1, got {tactic!r}"
    return None


def rows_per_expert(tokens: int, experts: int, top_k: int) -> int:
    """Rows an expert gets on average under balanced routing, ``ceil(T * k / E)`` (>= 1)."""
    return max(1, math.ceil(tokens * top_k / experts))


def block_m_choices(tokens: int, experts: int, top_k: int) -> list[int]:
    """The ``block_m`` values worth timing (the first pruning rule), largest first."""
    low, high = BLOCK_M_RANGE
    cap = min(high, max(low, next_power_of_two(rows_per_expert(tokens, experts, top_k))))
    return sorted({cap, max(low, cap // 2)}, reverse=True)


def moe_tactics(
    tokens: int,
    experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    *,
    itemsize: int,
    smem_bytes: int,
) -> list[dict[str, int]]:
    """Triton fused-MoE tactics worth timing for one bucket (see the module's pruning rules).

    Args:
        tokens: ``T``, the bucket.
        experts: ``E``.
        top_k: ``k``.
        hidden: ``H``.
        inter: ``I``, the expert width.
        itemsize: Bytes per activation/weight element.
        smem_bytes: Shared memory one program may use.

    Returns:
        Tactic dicts in a fixed order (by ``block_m``, then config, then ``group_m``), so ties
        in tuning go to the earlier-listed one.
    """
    cap = max(16, next_power_of_two(min(hidden, inter)))
    per_expert = rows_per_expert(tokens, experts, top_k)
    found: list[dict[str, int]] = []
    seen: set[tuple[int, ...]] = set()
    for block_m in block_m_choices(tokens, experts, top_k):
        configs = STREAMING_CONFIGS if block_m <= 32 else TILED_CONFIGS
        groups = (1, GROUP_M) if block_m >= 64 and per_expert >= 2 * block_m else (1,)
        for block_n_base, block_k_base, warps, stages in configs:
            block_n, block_k = min(block_n_base, cap), min(block_k_base, cap)
            if stages * (block_m + 2 * block_n) * block_k * itemsize > smem_bytes:
                continue
            if 2 * block_m * block_n > MAX_ACCUMULATORS_PER_THREAD * 32 * warps:
                continue
            for group_m in groups:
                tactic = {
                    "block_m": block_m,
                    "block_n": block_n,
                    "block_k": block_k,
                    "group_m": group_m,
                    "warps": warps,
                    "stages": stages,
                }
                ident = tuple(tactic[key] for key in TACTIC_KEYS)
                if ident not in seen:
                    seen.add(ident)
                    found.append(tactic)
    return found
