"""The fused-MoE op's GEMV runner for decode sizes: two kernels, no sort step.

At a few tokens each selected expert gets one row (or none), and the grouped GEMMs of
:class:`~graphtune.ops.moe.runners.TritonFusedMoeRunner` pay for what that size does not need:
the sort step (a kernel that costs as much as a GEMV of the experts at one token), ``tl.dot``
tiles of 16 rows holding one real row, and a per-pair buffer plus a kernel that sums it.
:class:`TritonMoeGemvRunner` runs, per call, two kernels with fixed grids (capturable):

1. ``moe_gemv_gate_up_kernel``: one program per (pair, ``bn`` features of the expert width),
   streaming the pair's expert's gate and up rows (``graphtune.ops.moe._gemv_kernels``);
2. ``moe_gemv_down_kernel``: one program per (token, a few features of the hidden size: see
   :func:`down_tile`), streaming the down rows of all of the token's experts side by side and
   summing the weighted, rounded products in the program.

The runner reads each selected expert's weights once per pair that selects it, where the grouped
GEMMs read them once per expert: the same bytes while the pairs' experts are distinct, more when
tokens share experts. So it is offered only to buckets of at most :data:`MAX_PAIRS` pairs and
the tuner decides per bucket, against the grouped GEMMs and the torch fallback.

Tactics are dicts ``{"bn", "bk", "warps"}``: the gate/up kernel streams ``[bn, bk]`` tiles of
one expert, and the down kernel, unless given a tile of its own (``down_tile``, tuned by
:mod:`graphtune.ops.moe.gemv_down`), ``[max(bn, slots), bk]`` tiles of all the token's experts
at once (:func:`down_tile`). Pruning rules of
:func:`moe_gemv_tactics` (a pruned config is never timed):

* only buckets with ``T * k <= MAX_PAIRS`` get tactics;
* ``bn`` in 2..16 and ``bk`` in 128..512 (powers of two), clamped to the next power of two of
  ``min(H, I)``, duplicates dropped;
* ``warps`` in 2..8 such that each thread loads 16 or 32 bytes of one weight tile per chunk (one
  or two 16-byte vectors; the gate/up kernel holds a gate and an up tile, each loaded one chunk
  ahead, so more costs registers); a tile smaller than a warp's 16-byte share (toy shapes) runs
  on 1 warp;
* the down kernel's tile (``max(bn, slots)`` rows of ``bk``, :func:`down_tile`) holds at most
  :data:`DOWN_THREAD_BYTES` per thread (eight vectors: more spills registers), which prunes the
  widest ``bk`` when a token has many slots.

The list is ordered fewer warps first, then smaller ``bn`` and ``bk``; the tuner gives ties to
the earlier tactic.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from graphtune.autotuner import FALLBACK_TACTIC
from graphtune.autotuner.config import next_power_of_two
from graphtune.errors import ConfigError
from graphtune.ops._triton import device_supported, run_kernel
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.moe._loader import moe_gemv_kernels
from graphtune.ops.moe.reference import (
    add_to_residual,
    has_residual,
    moe_output,
    torch_fused_moe,
    unpack_moe_inputs,
)

TACTIC_KEYS = ("bn", "bk", "warps")
MAX_PAIRS = 64
"""Largest ``T * k`` of a bucket that gets GEMV tactics (a pick still runs any ``T``)."""
BN_CHOICES = (2, 4, 8, 16)
BK_CHOICES = (128, 256, 512)
WARP_CHOICES = (2, 4, 8)
THREAD_BYTES = (16, 32)
"""Bounds of the bytes of one weight tile each thread loads per chunk."""
DOWN_THREAD_BYTES = 128
"""Most bytes of the down kernel's tile (all slots side by side) per thread and chunk."""
# Triton refuses tensors of more elements (TRITON_MAX_TENSOR_NUMEL).
_MAX_TILE_ELEMENTS = 1 << 20


def _pow2(value: Any) -> bool:
    ok = isinstance(value, int) and not isinstance(value, bool)
    return ok and value >= 1 and value & (value - 1) == 0


def check_moe_gemv_tactic(tactic: Any) -> str | None:
    """Why ``tactic`` cannot run the GEMV kernels, or ``None`` when it can: the three keys,
    power-of-two ints, ``warps <= 32`` and a tile Triton can hold (rules of every shape)."""
    if not isinstance(tactic, dict) or set(tactic) != set(TACTIC_KEYS):
        return f"a fused-MoE GEMV tactic is a dict with keys {TACTIC_KEYS}, got {tactic!r}"
    if not all(_pow2(tactic[key]) for key in TACTIC_KEYS) or tactic["warps"] > 32:
        return f"bn, bk and warps must be powers of two (warps <= 32), got {tactic!r}"
    if tactic["bn"] * tactic["bk"] > _MAX_TILE_ELEMENTS:
        return f"bn * bk must be at most {_MAX_TILE_ELEMENTS} elements (Triton), got {tactic!r}"
    return None


def moe_gemv_tactics(
    tokens: int, top_k: int, hidden: int, inter: int, *, itemsize: int
) -> list[dict[str, int]]:
    """GEMV tactics worth timing for one bucket of ``tokens`` (the module's pruning rules)."""
    if tokens * top_k > MAX_PAIRS or tokens < 1 or top_k < 1:
        return []
    cap = next_power_of_two(max(1, min(hidden, inter)))
    found: list[dict[str, int]] = []
    seen: set[tuple[int, int, int]] = set()
    low, high = THREAD_BYTES
    for warps in WARP_CHOICES:
        for bn_base in BN_CHOICES:
            for bk_base in BK_CHOICES:
                bn, bk = min(bn_base, cap), min(bk_base, cap)
                tile = bn * bk * itemsize
                if tile < 32 * low:
                    use = 1  # smaller than one warp's 16-byte share
                elif low <= tile / (32 * warps) <= high:
                    use = warps
                else:
                    continue
                down_rows = max(bn, down_tile(top_k, bn)[0])
                if down_rows * bk * itemsize > DOWN_THREAD_BYTES * 32 * use:
                    continue
                if (bn, bk, use) not in seen:
                    seen.add((bn, bk, use))
                    found.append({"bn": bn, "bk": bk, "warps": use})
    return found


DOWN_KEYS = ("features", "bk", "warps")
"""Keys of a down tile tuned on its own (:mod:`graphtune.ops.moe.gemv_down`): ``features`` of
the hidden size per program (all slots side by side), ``bk`` of the expert width per chunk,
``warps``."""


def check_down_tile(tile: Any) -> str | None:
    """Why ``tile`` cannot run the down kernel, or ``None``: a dict of :data:`DOWN_KEYS`, each
    a power-of-two int, ``warps <= 32``."""
    if not isinstance(tile, dict) or set(tile) != set(DOWN_KEYS):
        return f"a down tile is a dict with keys {DOWN_KEYS}, got {tile!r}"
    if not all(_pow2(tile[key]) for key in DOWN_KEYS) or tile["warps"] > 32:
        return f"a down tile's features, bk and warps must be powers of two, got {tile!r}"
    return None


def gemv_shape(inputs: list[Any]) -> tuple[int, int, int, int]:
    """``(tokens, top_k, hidden, inter)`` of the op's inputs: what the tactic rules read."""
    x, _, down, _, ids = unpack_moe_inputs(inputs)
    return x.shape[0], ids.shape[1], x.shape[1], down.shape[2]


def down_tile(top_k: int, bn: int) -> tuple[int, int]:
    """(slots, features) of one down-kernel program: all ``top_k`` slots (padded to a power of
    two) side by side, and ``bn / slots`` features (at least one), so its tile has ``max(bn,
    slots)`` rows of ``bk``: the gate/up tile's size unless the slots alone are more."""
    slots = next_power_of_two(max(1, top_k))
    return slots, max(1, bn // slots)


class TritonMoeGemvRunner(TritonRunner):
    """The GEMV path of the fused-MoE op (see the module docstring); tactic ``-1`` is the torch
    fallback.

    Args:
        compile_workers: Threads for ahead-of-time compilation.
    """

    source_modules = ("graphtune.ops.moe._gemv_kernels", "graphtune.ops.moe.reference")

    def supports(self, inputs: list[Any]) -> bool:
        """Float16/bfloat16/float32 on one Triton device."""
        x, gate_up, down, weights, ids = unpack_moe_inputs(inputs)
        devices = {t.device for t in (x, gate_up, down, weights, ids)}
        return len(devices) == 1 and device_supported(x.device)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`moe_gemv_tactics`."""
        return moe_gemv_tactics(*gemv_shape(inputs), itemsize=inputs[0].element_size())

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """The torch fallback (``reference.torch_fused_moe``, then the residual add)."""
        return add_to_residual(torch_fused_moe(*unpack_moe_inputs(inputs)), inputs)

    def forward(
        self,
        inputs: list[Any],
        tactic: Any = FALLBACK_TACTIC,
        *,
        down_tile: dict[str, int] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Runs tactic ``-1`` with torch, any other with the two kernels; ``down_tile`` (the
        pick of :mod:`graphtune.ops.moe.gemv_down`) replaces the down kernel's tile that
        :func:`down_tile` derives from the tactic."""
        if tactic == FALLBACK_TACTIC:
            return self.torch_forward(inputs)
        return self.launch(inputs, tactic, down=down_tile)

    def launch(
        self,
        inputs: list[Any],
        tactic: Any,
        *,
        warmup: bool = False,
        down: dict[str, int] | None = None,
    ) -> torch.Tensor:
        """Runs (or with ``warmup`` only compiles) the two GEMV kernels; the down kernel adds the
        residual in place, when the call has one, and it is returned. ``down``: the down
        kernel's tile; ``None``: derived from ``tactic`` (:func:`down_tile`).

        Raises:
            ConfigError: ``tactic`` breaks a rule of :func:`check_moe_gemv_tactic`, or ``down``
                one of :func:`check_down_tile`.
        """
        problem = check_moe_gemv_tactic(tactic)
        if problem is None and down is not None:
            problem = check_down_tile(down)
        if problem is not None:
            raise ConfigError(f"TritonMoeGemvRunner: {problem}; pick one from get_valid_tactics.")
        x, gate_up, down_proj, weights, ids = unpack_moe_inputs(inputs)
        tokens, hidden = x.shape
        experts, two_inter, _ = gate_up.shape
        inter, top_k = two_inter // 2, ids.shape[1]
        out, work = moe_output(inputs)
        if not work:
            return out
        pairs = tokens * top_k
        flat_ids = ids.reshape(-1)
        flat_ids = flat_ids if flat_ids.is_contiguous() else flat_ids.contiguous()
        route = weights.reshape(-1)
        route = route if route.is_contiguous() else route.contiguous()
        bn, bk = tactic["bn"], tactic["bk"]
        kernels = moe_gemv_kernels()
        act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
        args: tuple[Any, ...] = (
            x,
            gate_up,
            flat_ids,
            act,
            top_k,
            experts,
            inter,
            hidden,
            *x.stride(),
            *gate_up.stride(),
            *act.stride(),
        )
        meta = dict(EVEN_K=hidden % bk == 0, BLOCK_N=bn, BLOCK_K=bk, num_warps=tactic["warps"])
        grid = (pairs * math.ceil(inter / bn),)
        run_kernel(kernels.moe_gemv_gate_up_kernel, grid, args, meta, warmup)
        args = (
            act,
            down_proj,
            flat_ids,
            route,
            out,
            top_k,
            experts,
            hidden,
            inter,
            *act.stride(),
            *down_proj.stride(),
            *out.stride(),
        )
        slots, features = down_tile(top_k, bn)
        down_bk, down_warps = bk, tactic["warps"]
        if down is not None:
            features, down_bk, down_warps = down["features"], down["bk"], down["warps"]
        meta = dict(
            EVEN_K=inter % down_bk == 0,
            BLOCK_S=slots,
            BLOCK_F=features,
            BLOCK_K=down_bk,
            HAS_RES=has_residual(inputs),
            num_warps=down_warps,
        )
        grid = (tokens * math.ceil(hidden / features),)
        run_kernel(kernels.moe_gemv_down_kernel, grid, args, meta, warmup)
        return out
