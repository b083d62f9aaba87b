"""Triton GEMV runner for decode GEMMs of a few rows (the ``graphtune.gemm`` op).

At batch 1..8 ``out = a @ weight.T`` streams the whole weight once and is memory-bound; tiles for
``tl.dot`` (``BLOCK_M >= 16``) multiply padding and cuBLAS reaches only about half of the copy
bandwidth. :class:`TritonGemvRunner` runs ``graphtune.ops.gemm._gemv_kernels.gemv_kernel``: each
program streams ``[bn, bk]`` weight tiles along ``K`` and multiplies every tile by all activation
rows in float32, then adds bias / residual like :class:`~graphtune.ops.gemm.TritonGemmRunner`
(same inputs, ``out=`` and in-place semantics, and the same split-K in one launch: the last
split of a tile to finish sums the partials, :mod:`graphtune.ops._split_k`).

Tactics are dicts ``{"bn", "bk", "warps", "split_k"}``. Pruning rules of :func:`gemv_tactics`
(a pruned config is never timed):

* only buckets of ``M <= 8`` get tactics (the runner offers them up to
  :data:`graphtune.ops._pruned.GEMV_MAX_ROWS`, 2; larger batches are the skinny and tiled
  GEMMs'); ``bm``, the rows
  one program multiplies, is the next power of two of ``M``. A pick still runs *any* ``M``: the
  kernel takes more row blocks when a live ``M`` exceeds 8 (a bucket's pick runs every size that
  maps to it, up to ``2 * bucket - 1``, and larger ones when ``max_m`` caps the buckets);
* ``bn`` in 2..32 and ``bk`` in 128..1024 (powers of two), clamped to the next power of two of
  ``N`` and ``K``, duplicates dropped; ``bn >= bm / 2``, so the activation chunk each program
  re-reads (from L1/L2) is at most twice the weight chunk it streams from DRAM;
* ``warps`` in 1..8 such that each thread loads 16 to 64 bytes of weight per chunk (one to four
  16-byte vectors): less leaves load width unused, more costs registers that every row
  multiplies. The loop is not software-pipelined, so the bytes in flight come from these loads
  and from the programs resident per SM; the tuner picks the balance. A tile is therefore at
  most 16 KiB; one smaller than a warp's 16-byte share (tiny ``N`` and ``K``) runs on 1 warp;
* each program streams at least 4 KiB of weight (``bn * K / split_k * itemsize``), so its fixed
  costs (address set-up, the final reduction, the stores) hide behind the stream; decode shapes
  (``K >= 2048``) always pass, toy shapes keep only their longest-streaming tiles;
* split-K only when the grid without it is small (``programs < 2 * SMs``), ``K`` splits into
  whole ``bk`` blocks (``K % (split_k * bk) == 0``) and ``programs * split_k <= 4 * SMs``;
* at most ``max_tactics`` (16): when more pass, those with the shortest ``K`` loop
  (``K / (split_k * bk)`` chunks, each a dependent DRAM round trip) are kept;
* of those, measured losers are dropped (:func:`measured_loser`): split-K beyond 2, split-K for
  more than one row, ``bn`` 32, and ``bn`` 16 for more than one row. Over every GEMM case of the
  committed tuning-quality runs (``benchmarks/results/tuning-*.json``: Llama-1B's five decode
  GEMMs at buckets 1 to 128, 182 observations of 35 cases) no such tactic came within 5.8% of
  the case's best under either truth (CUPTI kernel time, or replayed back to back in a graph).
  They are dropped after the cap, so no tactic the runs never timed takes their place, and
  only when some tactic remains (toy shapes, outside that data, keep theirs).

The list is ordered simplest first: no split before split-K, then fewer warps, then smaller
``bn`` and ``bk``; the tuner gives ties to the earlier tactic. How the kernel reduces over ``K``
(once at the end, or per chunk when the rows' accumulators would not fit in registers) is not a
tactic: :func:`defer_reduction` derives it from the live row count.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch

from graphtune.autotuner.config import next_power_of_two
from graphtune.errors import ConfigError
from graphtune.ops import _pruned
from graphtune.ops._counters import arrival_counters, split_fits
from graphtune.ops._split_k import split_partials
from graphtune.ops._triton import device_limits, kernel_module, run_kernel
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.gemm.common import (
    kernel_operands,
    result_tensor,
    torch_gemm,
    triton_gemm_supports,
    unpack_gemm_inputs,
)

TACTIC_KEYS = ("bn", "bk", "warps", "split_k")
_TACTIC_KEY_SET = frozenset(TACTIC_KEYS)
MAX_M = 8
"""Largest bucket that gets GEMV tactics; also the most rows one program multiplies."""
BN_CHOICES = (2, 4, 8, 16, 32)
BK_CHOICES = (128, 256, 512, 1024)
SPLIT_K_CHOICES = (2, 4, 8)
WARP_CHOICES = (1, 2, 4, 8)
THREAD_BYTES = (16, 64)
"""Bounds of the weight bytes each thread loads per chunk: one to four 16-byte vectors."""
ACC_REGISTERS = 64
"""float32 registers per thread that deferred per-row accumulators may take."""
MIN_PROGRAM_BYTES = 4096
"""Weight bytes each program must stream (``bn * K / split_k * itemsize``), when any tile can."""
# Triton refuses tensors of more elements (TRITON_MAX_TENSOR_NUMEL).
_MAX_TILE_ELEMENTS = 1 << 20


def gemv_kernels() -> ModuleType:
    """The module of the GEMV kernel (imported on first use; needs Triton), so that importing
    :mod:`graphtune.ops` never imports Triton."""
    return kernel_module("graphtune.ops.gemm._gemv_kernels", "graphtune's Triton GEMV kernel")


def check_gemv_tactic(tactic: Any, k: int) -> str | None:
    """Why ``tactic`` cannot run a GEMV with inner size ``k``, or ``None`` when it can.

    Rules that hold for every ``M`` (a bucket's pick runs all the sizes mapped to it): the known
    keys, positive int values, power-of-two ``bn``, ``bk`` and ``warps`` (``tl.arange`` and
    Triton's warp counts), a tile Triton can hold, and split-K slices of whole ``bk`` blocks.
    Every launch checks its tactic, so this is written as plain tests (no sets or generators).
    """
    if not isinstance(tactic, dict) or tactic.keys() != _TACTIC_KEY_SET:
        return f"a Triton GEMV tactic is a dict with keys {TACTIC_KEYS}, got {tactic!r}"
    bn, bk, warps, split = tactic["bn"], tactic["bk"], tactic["warps"], tactic["split_k"]
    for v in (bn, bk, warps, split):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"every value of a GEMV tactic must be a positive int, got {tactic!r}"
    if bn & (bn - 1) or bk & (bk - 1) or warps & (warps - 1) or warps > 32:
        return f"bn, bk and warps must be powers of two (warps <= 32), got {tactic!r}"
    if bn * bk > _MAX_TILE_ELEMENTS:
        return f"bn * bk must be at most {_MAX_TILE_ELEMENTS} elements (Triton), got {tactic!r}"
    if split > 1 and k % (split * bk):
        return f"split_k={split} with bk={bk} needs K divisible by {split * bk}, but K={k}"
    return None


def rows_per_program(m: int) -> int:
    """``BLOCK_M`` for ``m`` rows: the next power of two, at most :data:`MAX_M`."""
    return min(MAX_M, next_power_of_two(max(m, 1)))


def defer_reduction(bm: int, bn: int, bk: int, warps: int) -> bool:
    """Whether the kernel keeps per-row ``[bn, bk]`` product accumulators and sums them once.

    Deferring saves a cross-thread (and, when ``bk`` spans warps, a shared-memory) reduction per
    row and chunk, but holds ``bm`` times the thread's share of the tile in float32 registers;
    beyond :data:`ACC_REGISTERS` (8 rows with more than 8 elements per thread, or a bucket-4
    pick run with 5..7 rows) each chunk is reduced at once instead. Compiled for sm_90, every
    tactic of :func:`gemv_tactics` then fits in registers without spilling.
    """
    per_thread = max(1, bn * bk // (32 * warps))
    return bm * per_thread <= ACC_REGISTERS


def gemv_tactics(
    m: int,
    n: int,
    k: int,
    *,
    itemsize: int,
    sm_count: int,
    max_tactics: int = 16,
) -> list[dict[str, int]]:
    """GEMV tactics worth timing for one ``(M, N, K)`` (see the module's pruning rules).

    Args:
        m: Rows of ``a`` (the bucket); above :data:`MAX_M` there are none.
        n: Output features.
        k: Inner size.
        itemsize: Bytes per operand element.
        sm_count: Streaming multiprocessors (decides when split-K is offered).
        max_tactics: Upper bound on the list.

    Returns:
        Tactic dicts, simplest first.
    """
    if m < 1 or m > MAX_M or n < 1 or k < 1:
        return []
    bm = rows_per_program(m)
    bn_cap, bk_cap = max(2, next_power_of_two(n)), next_power_of_two(k)
    low, high = THREAD_BYTES
    found: dict[tuple[int, int, int, int], dict[str, int]] = {}
    for bn in sorted({min(b, bn_cap) for b in BN_CHOICES}):
        if bn < min(bm // 2, bn_cap):
            continue  # the activation chunk would outweigh the weight chunk
        for bk in sorted({min(b, bk_cap) for b in BK_CHOICES}):
            tile = bn * bk * itemsize
            warps = [w for w in WARP_CHOICES if low <= tile // (32 * w) <= high]
            if not warps and tile < 32 * low:
                warps = [1]  # a tile under one warp's share (tiny N and K): one warp
            programs = math.ceil(n / bn) * math.ceil(m / bm)
            splits = [1]
            if programs < 2 * sm_count:
                splits += [
                    s for s in SPLIT_K_CHOICES if k % (s * bk) == 0 and programs * s <= 4 * sm_count
                ]
            for w in warps:
                for split in splits:
                    tactic = {"bn": bn, "bk": bk, "warps": w, "split_k": split}
                    if check_gemv_tactic(tactic, k) is None:
                        found[(split, w, bn, bk)] = tactic

    # Per-program fixed costs (address set-up, the final reduction, the stores) need a long
    # enough stream to hide behind; real decode shapes (K >= 2048) always pass this, toy ones
    # keep their longest-streaming tiles.
    def streamed(ident: tuple[int, int, int, int]) -> int:
        split, _, bn, _ = ident
        return bn * (k // split) * itemsize

    longest = max(map(streamed, found), default=0)
    order = sorted(i for i in found if streamed(i) >= min(MIN_PROGRAM_BYTES, longest))
    if len(order) > max_tactics:

        def loop_length(ident: tuple[int, int, int, int]) -> int:
            split, _, _, bk = ident
            return math.ceil(k / (split * bk))

        kept = sorted(order, key=lambda ident: (loop_length(ident), order.index(ident)))
        order = sorted(kept[:max_tactics])
    offered = [found[ident] for ident in order]
    return [t for t in offered if not measured_loser(t, m)] or offered


def measured_loser(tactic: dict[str, int], m: int) -> bool:
    """Whether the tuning-quality runs found ``tactic`` far from the best for ``m`` rows (see
    the module's pruning rules): split-K beyond 2 or for more than one row, ``bn`` 32, or ``bn``
    16 for more than one row."""
    split, bn = tactic["split_k"], tactic["bn"]
    return split > 2 or (split > 1 and m > 1) or bn > 16 or (bn > 8 and m > 1)


class TritonGemvRunner(TritonRunner):
    """Triton GEMV for skinny ``M``; tactic ``-1`` is ``F.linear``.

    Offers tactics only for buckets of ``M <= 2`` (:data:`graphtune.ops._pruned.GEMV_MAX_ROWS`;
    :func:`gemv_tactics` itself goes to 8), but a tactic runs every ``M``, so a bucket's pick is
    valid for all the live sizes that map to it.

    Args:
        max_tactics: Upper bound on tactics per bucket.
        sm_count: Override the device's SM count (tests, or to tune for another GPU's split-K).
        max_rows: Largest bucket offered tactics (``None``:
            :data:`graphtune.ops._pruned.GEMV_MAX_ROWS`, measured losers above; :data:`MAX_M`
            offers every bucket :func:`gemv_tactics` has).
        compile_workers: Threads for ahead-of-time compilation.
    """

    source_modules = (
        "graphtune.ops.gemm._gemv_kernels",
        "graphtune._split_k_jit",
        "graphtune.ops._pruned",
    )

    def __init__(
        self,
        *,
        max_tactics: int = 16,
        sm_count: int | None = None,
        max_rows: int | None = None,
        compile_workers: int | None = None,
    ) -> None:
        super().__init__(compile_workers=compile_workers)
        self.max_tactics = max_tactics
        self.sm_count = sm_count
        self.max_rows = max_rows

    def cache_key_extras(self) -> tuple[Any, ...]:
        """Overrides change the candidate set, so they are part of the runner's identity."""
        extras = {"sm": self.sm_count, "max": self.max_tactics, "rows": self.max_rows}
        return () if extras == {"sm": None, "max": 16, "rows": None} else (extras,)

    def supports(self, inputs: list[Any]) -> bool:
        """The dtype, residual and device rules of the Triton GEMM
        (:func:`~graphtune.ops.gemm.common.triton_gemm_supports`)."""
        return triton_gemm_supports(inputs)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`gemv_tactics`, for buckets of at most ``max_rows`` rows; the SM count
        comes from the inputs' device."""
        a, weight = inputs[0], inputs[1]
        if a.shape[0] > (_pruned.GEMV_MAX_ROWS if self.max_rows is None else self.max_rows):
            return []
        _, sms = device_limits(a.device)
        return list(
            gemv_tactics(
                a.shape[0],
                weight.shape[0],
                a.shape[1],
                itemsize=a.element_size(),
                sm_count=self.sm_count or sms,
                max_tactics=self.max_tactics,
            )
        )

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """:func:`~graphtune.ops.gemm.common.torch_gemm`: the fallback tactic."""
        return torch_gemm(inputs)

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs the GEMV kernel for ``tactic`` (one launch, split-K included).

        Raises:
            ConfigError: ``tactic`` breaks a rule of :func:`check_gemv_tactic` for this K.
        """
        a, weight, bias, residual, inplace = unpack_gemm_inputs(inputs)
        m, k = a.shape
        n = weight.shape[0]
        problem = check_gemv_tactic(tactic, k)
        if problem is not None:
            raise ConfigError(f"TritonGemvRunner: {problem}; pick a tactic from get_valid_tactics.")
        bn, bk, warps, split = tactic["bn"], tactic["bk"], tactic["warps"], tactic["split_k"]
        out = result_tensor(inputs, a, n, residual, inplace)
        if m == 0:
            return out
        bm = rows_per_program(m)
        tiles = -(-m // bm) * -(-n // bn)
        split = split if split_fits(tiles) else 1  # more tiles than counters: unsplit
        k_per_split = k // split
        pointers, strides = kernel_operands(a, weight, bias, residual)
        ws = counters = a  # unread placeholders without a split
        if split > 1:
            ws = split_partials(tiles, split, bm * bn, False, a.device)
            counters = arrival_counters(
                a.device, tiles, user="Triton GEMV split-K", fix="use a tactic with split_k 1"
            )
        args = (*pointers, out, ws, counters, m, n, k_per_split, *strides, *out.stride())
        meta = dict(
            HAS_BIAS=bias is not None,
            HAS_RES=residual is not None,
            SPLIT_K=split,
            EVEN_K=k_per_split % bk == 0,
            DEFER=defer_reduction(bm, bn, bk, warps),
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            # No tl.dot and a plain range loop: nothing to pipeline, so no shared-memory stages.
            num_warps=warps,
            num_stages=1,
        )
        run_kernel(gemv_kernels().gemv_kernel, (tiles, split), args, meta, warmup)
        return out
