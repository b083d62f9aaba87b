"""Tactics and launch of the fused decode GEMV kernel shared by every op of this package.

Tactics are dicts ``{"bn", "bk", "warps", "dot", "stages", "split"}``: ``bn`` output columns per
program (column *pairs* in the SiLU and RoPE modes, whose tiles hold ``2 * bn`` weight rows),
``bk`` the ``K`` chunk, ``warps``, ``dot`` 0 (CUDA cores, one row per program) or 1 (tensor cores
with swapped operands, up to 16 rows per program), ``stages`` the chunks Triton's pipeliner keeps
in flight (``dot=1``; the CUDA-core loop prefetches in registers and has 1), and ``split`` the
``K`` slices of a split-K launch (1: none; see :mod:`graphtune.ops._split_k`). Pruning
rules of :func:`fused_gemv_tactics`:

* only buckets of ``M <= 16`` get tactics (beyond, the unfused path's tiled GEMMs win); ``dot=0``
  only for ``M == 1`` (a CUDA-core program re-reads the weights for every further row);
* ``dot=0``: ``bn`` in 2..32, ``bk`` in 128..1024, warps such that each thread loads 16 to 64
  bytes of each weight chunk (one to four 16-byte vectors); ``dot=1``: ``bn`` in 16..128,
  ``bk`` in 64..256 (``tl.dot`` needs 16), 4 warps and 4 stages (3 measured slower on the H200,
  5 no faster), the shared-memory tiles (:func:`pipeline_bytes`) within :data:`DOT_SMEM_BYTES`;
* blocks are clamped to the next power of two of their dimension (``HALF`` for RoPE tiles, which
  never cross a head), duplicates dropped;
* tactics giving fewer than half as many programs as the GPU has SMs are dropped while any
  tactic reaches that (a decode GEMV needs every SM streaming);
* at most ``max_tactics`` (16), a third of them for ``dot=1`` when both kinds apply; each kind
  keeps its longest ``K`` chunks (fewest dependent round trips);
* besides those, up to :data:`MAX_SPLIT_TACTICS` split-K variants of ``dot=1`` tiles of at least
  :data:`SPLIT_MIN_ROWS` weight rows (wide enough for the tensor cores to stream well) whose
  grid has fewer programs than the GPU has SMs, in tile order: ``split`` is the largest power of
  two whose programs fit in one wave (one per SM) and twice that, each at most :data:`MAX_SPLIT`
  and at most the tile's ``K`` chunks. Narrow tiles fill the GPU without a split but measured
  slower than cuBLAS at 2 to 16 rows; a split gives the wide tiles the programs. In the sweep of
  the whole space at 8 and 16 rows (``benchmarks/results/gemv-sweep-llama-1b-shape-h200-*.json``)
  one wave was the fastest split of the O and down projections of Llama-1B, 12 to 16% ahead of
  the split that first fills every SM.

With ``whole_columns`` (the per-head q/k norm of a RoPE tile needs all of a head's columns in one
program) only tiles of ``bn = next_power_of_two(columns)`` are offered, of both kinds by the rules
above (CUDA-core chunks from ``bk`` 64: such a tile is wide, so a short chunk still gives each
thread 16 bytes or more), each also split in ``K`` into the largest power of two of programs per
head that fits in one wave, and twice and four times that (at most :data:`MAX_SPLIT` and the
tile's ``K`` chunks): a tile per head alone leaves most SMs idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from graphtune.autotuner.config import last_power_of_two, next_power_of_two
from graphtune.errors import ConfigError
from graphtune.ops._counters import arrival_counters, split_fits
from graphtune.ops._split_k import keys_per_split, split_partials
from graphtune.ops._triton import device_supported, kernel_module, run_kernel

TACTIC_KEYS = ("bn", "bk", "warps", "dot", "stages", "split")
_TACTIC_KEY_SET = frozenset(TACTIC_KEYS)
MAX_M = 16
"""Largest bucket that gets fused tactics; also the padded row count of a ``dot=1`` program."""
PLAIN, SILU, ROPE = 0, 1, 2
"""Kernel modes: plain GEMV (+ residual), gate/up + SiLU-and-mul, QKV + RoPE + K/V write."""
CORE_BN = (2, 4, 8, 16, 32)
CORE_BK = (128, 256, 512, 1024)
CORE_WARPS = (1, 2, 4, 8)
DOT_BN = (16, 32, 64, 128)
DOT_BK = (64, 128, 256)
DOT_STAGES = (4,)
MAX_SPLIT = 16
"""Most ``K`` slices of a split-K tactic (``split``)."""
SPLIT_MIN_ROWS = 64
"""Weight rows a tile needs (``bn``, twice for paired tiles) to be offered split-K."""
MAX_SPLIT_TACTICS = 4
"""Split-K tactics a profile is offered at most, besides the whole-``K`` ones."""
DOT_SMEM_BYTES = 160 * 1024
"""Shared memory the pipelined tiles of a ``dot=1`` program may take (an H200 SM has 228 KiB)."""
THREAD_BYTES = (16, 64)
DEFER_REGISTERS = 32
"""float32 registers per thread that deferred product accumulators may take (both halves)."""
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def gemv_kernels() -> ModuleType:
    """The module of the fused GEMV kernel (imported on first use; needs Triton)."""
    return kernel_module(
        "graphtune.ops.fused_gemv._kernels", "graphtune's fused Triton GEMV kernel"
    )


def check_fused_tactic(tactic: Any) -> str | None:
    """Why ``tactic`` is not a fused GEMV tactic, or ``None`` when it is one (every launch checks
    its tactic, so this is written as plain tests, without sets or generators)."""
    if not isinstance(tactic, dict) or tactic.keys() != _TACTIC_KEY_SET:
        return f"a fused GEMV tactic is a dict with keys {TACTIC_KEYS} (or -1), got {tactic!r}"
    bn, bk, warps = tactic["bn"], tactic["bk"], tactic["warps"]
    dot, stages, split = tactic["dot"], tactic["stages"], tactic["split"]
    for v in (bn, bk, warps, dot, stages, split):
        if isinstance(v, bool) or not isinstance(v, int):
            return f"every value of a fused GEMV tactic must be an int, got {tactic!r}"
    powers = bn >= 1 and bk >= 1 and warps >= 1 and not (bn & (bn - 1) or bk & (bk - 1))
    if dot not in (0, 1) or not powers or warps & (warps - 1) or warps > 16:
        return f"bn, bk, warps must be powers of two (warps <= 16) and dot 0 or 1, got {tactic!r}"
    if dot and (bn < 16 or bk < 16):
        return f"a dot=1 tactic needs bn and bk >= 16 (tl.dot), got {tactic!r}"
    if not 1 <= stages <= 8 or (not dot and stages != 1):
        return f"stages must be 1 for dot=0 and 1..8 for dot=1, got {tactic!r}"
    if not 1 <= split <= MAX_SPLIT or split & (split - 1):
        return f"split must be a power of two in 1..{MAX_SPLIT}, got {tactic!r}"
    return None


def pipeline_bytes(bn: int, bk: int, stages: int, paired: bool, itemsize: int) -> int:
    """Shared memory of a ``dot=1`` program's pipelined tiles: ``stages`` copies of its weight
    tile(s) and of the ``[bk, 16]`` activation tile."""
    return stages * ((2 if paired else 1) * bn + MAX_M) * bk * itemsize


def defer_products(bn: int, bk: int, warps: int, paired: bool) -> bool:
    """Whether the CUDA-core path keeps per-element product accumulators (see the kernel)."""
    per_thread = max(1, bn * bk // (32 * warps))
    return per_thread * (2 if paired else 1) <= DEFER_REGISTERS


@dataclass(frozen=True)
class GemvShape:
    """What the tactic list of one fused GEMV depends on.

    Attributes:
        mode: :data:`PLAIN`, :data:`SILU` or :data:`ROPE`.
        m: Rows (the bucket).
        columns: Output columns per head (RoPE: ``HALF``) or in all (plain, SiLU).
        heads: RoPE heads (``NUM_HEADS + 2 * NUM_KV``); 1 otherwise.
        k: Inner size.
        itemsize: Bytes per weight element.
    """

    mode: int
    m: int
    columns: int
    heads: int
    k: int
    itemsize: int

    @property
    def paired(self) -> bool:
        """Whether a tile holds two weight rows per column (SiLU and RoPE)."""
        return self.mode != PLAIN

    def programs(self, bn: int) -> int:
        """Column tiles of width ``bn`` (the grid's first axis)."""
        return self.heads * math.ceil(self.columns / bn)


def fused_gemv_tactics(
    shape: GemvShape,
    *,
    sm_count: int,
    max_tactics: int = 16,
    split_k: bool = True,
    whole_columns: bool = False,
) -> list[dict[str, int]]:
    """Tactics worth timing for one fused GEMV (see the module's pruning rules), simplest first;
    no split-K variants with ``split_k`` false (the in-loop RMSNorm needs whole rows); only tiles
    holding all ``shape.columns`` with ``whole_columns``."""
    if shape.m < 1 or shape.m > MAX_M or shape.columns < 1 or shape.k < 1:
        return []
    if whole_columns:
        return _whole_column_tactics(shape, sm_count, split_k)
    n_cap = next_power_of_two(shape.columns)
    core = _core_tiles(shape, sorted({min(b, n_cap) for b in CORE_BN}))
    dot = _dot_tiles(shape, sorted({min(b, n_cap) for b in DOT_BN}))
    kinds = [_prune(core, shape, sm_count), _prune(dot, shape, sm_count)]
    # Each kind keeps its share of max_tactics; the CUDA-core kind (M == 1 only) the larger one.
    dot_share = min(len(kinds[1]), max_tactics // 3 if kinds[0] else max_tactics)
    kept = _longest_chunks(kinds[0], shape, max_tactics - dot_share)
    kept += _longest_chunks(kinds[1], shape, dot_share)
    return kept + _split_tactics(dot, shape, sm_count) if split_k else kept


def _whole_column_tactics(shape: GemvShape, sm_count: int, split_k: bool) -> list[dict[str, int]]:
    """Tiles of all the columns, whole-``K`` and split (the module's ``whole_columns`` rule)."""
    bn = next_power_of_two(shape.columns)
    core = _core_tiles(shape, [bn], (64, *CORE_BK))
    tiles = _prune(core + _dot_tiles(shape, [bn]), shape, sm_count)
    wave = last_power_of_two(max(1, sm_count // shape.programs(bn)))
    found: list[dict[str, int]] = []
    for t in tiles:
        most = min(MAX_SPLIT, last_power_of_two(math.ceil(shape.k / t["bk"])))
        splits = {min(s, most) for s in (wave, 2 * wave, 4 * wave)} if split_k else set()
        found += [{**t, "split": s} for s in sorted(splits | {1})]
    return found


def _core_tiles(
    shape: GemvShape, widths: list[int], chunks: tuple[int, ...] = CORE_BK
) -> list[dict[str, int]]:
    """CUDA-core tiles (one row: ``M == 1`` only) of the given ``bn`` and ``bk`` (module
    rules)."""
    if shape.m != 1:
        return []
    k_cap = next_power_of_two(shape.k)
    low, high = THREAD_BYTES
    core: list[dict[str, int]] = []
    for bn in widths:
        for bk in sorted({min(b, k_cap) for b in chunks}):
            chunk = bn * bk * shape.itemsize  # bytes of one weight tile (each of a pair)
            warps = [w for w in CORE_WARPS if low <= chunk // (32 * w) <= high]
            if not warps and chunk < 32 * low:
                warps = [1]  # a tile under one warp's share (tiny shapes): one warp
            core += [
                {"bn": bn, "bk": bk, "warps": w, "dot": 0, "stages": 1, "split": 1} for w in warps
            ]
    return core


def _dot_tiles(shape: GemvShape, widths: list[int]) -> list[dict[str, int]]:
    """Tensor-core tiles of the given ``bn`` whose pipeline fits (module rules)."""
    if shape.columns < 16 or shape.k < 16:
        return []
    k_cap = next_power_of_two(shape.k)
    dot: list[dict[str, int]] = []
    for bn in widths:
        for bk in sorted({min(b, k_cap) for b in DOT_BK}):
            for stages in DOT_STAGES:
                if pipeline_bytes(bn, bk, stages, shape.paired, shape.itemsize) <= DOT_SMEM_BYTES:
                    dot.append(
                        {"bn": bn, "bk": bk, "warps": 4, "dot": 1, "stages": stages, "split": 1}
                    )
    return dot


def _split_tactics(
    dot: list[dict[str, int]], shape: GemvShape, sm_count: int
) -> list[dict[str, int]]:
    """Split-K variants of the wide tensor-core tiles that leave SMs idle (module rules)."""
    found: list[dict[str, int]] = []
    for t in dot:
        programs = shape.programs(t["bn"])
        rows = t["bn"] * (2 if shape.paired else 1)
        if rows < SPLIT_MIN_ROWS or programs >= sm_count:
            continue
        wave = last_power_of_two(sm_count // programs)  # the most that fit in one wave
        most = min(MAX_SPLIT, last_power_of_two(math.ceil(shape.k / t["bk"])))
        for split in sorted({min(wave, most), min(2 * wave, most)} - {1}):
            if len(found) < MAX_SPLIT_TACTICS:
                found.append({**t, "split": split})
    return found


def _prune(found: list[dict[str, int]], shape: GemvShape, sm_count: int) -> list[dict[str, int]]:
    unique = {tuple(t[key] for key in TACTIC_KEYS): t for t in found}
    tactics = [t for t in unique.values() if check_fused_tactic(t) is None]
    enough = [t for t in tactics if shape.programs(t["bn"]) >= sm_count // 2]
    return enough or tactics


def _longest_chunks(
    tactics: list[dict[str, int]], shape: GemvShape, limit: int
) -> list[dict[str, int]]:
    """At most ``limit`` of ``tactics`` (in their order), the fewest ``K`` chunks first."""
    if len(tactics) <= limit:
        return tactics
    ranked = sorted(range(len(tactics)), key=lambda i: (math.ceil(shape.k / tactics[i]["bk"]), i))
    keep = set(ranked[:limit])
    return [t for i, t in enumerate(tactics) if i in keep]


def fused_supports(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """One float dtype for activations and weights, unit last strides, a Triton device."""
    if x.dim() != 2 or weight.dim() != 2 or x.dtype not in DTYPES or weight.dtype != x.dtype:
        return False
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        return False
    for t in others:
        if t is not None and (t.dtype != x.dtype or t.stride(-1) != 1):
            return False
    return device_supported(x.device)


def norm_weight_supported(norm_weight: torch.Tensor) -> bool:
    """Whether the fused kernels can read this RMSNorm weight: one float dim of unit stride (they
    index it by the feature alone)."""
    return (
        norm_weight.dtype.is_floating_point
        and norm_weight.dim() == 1
        and norm_weight.stride(0) == 1
    )


def launch_fused_gemv(
    mode: int,
    tactic: Any,
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    n: int,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    rope: tuple[Any, ...] | None = None,
    norm_in_loop: bool = False,
    head_norm: torch.Tensor | None = None,
    warmup: bool = False,
) -> None:
    """Runs (or with ``warmup`` compiles) :func:`fused_gemv_kernel` for one op call.

    Args:
        mode: :data:`PLAIN`, :data:`SILU` or :data:`ROPE`.
        tactic: A tactic of :func:`fused_gemv_tactics`.
        x: ``[M, K]`` activations (raw rows when ``norm_weight`` is given).
        weight: ``[rows, K]``.
        out: Where the result goes (``residual`` itself for an in-place residual add).
        n: Output width (plain: features, SiLU: intermediate size; RoPE: ignored).
        norm_weight: ``[K]`` RMSNorm weight, or ``None`` for no norm.
        eps: RMSNorm epsilon.
        bias: Optional ``[rows]``.
        residual: Optional ``[M, N]`` added in float32 (plain mode).
        rope: ``(positions, cos, sin, write_rows, k_cache, v_cache, num_heads, num_kv_heads,
            signed_sin)`` for RoPE mode.
        norm_in_loop: Apply ``norm_weight`` in the main loop and the row's ``rsqrt(mean(x^2) +
            eps)`` in the epilogue (kernel ``NORM`` 2) instead of a prologue (``NORM`` 1).
        head_norm: RoPE mode: ``[num_heads + num_kv_heads, D]`` weights of a per-head RMSNorm of
            q and k before the rotation (Qwen3; with ``eps``), or ``None``.

    Raises:
        ConfigError: ``tactic`` is not a fused GEMV tactic, or its tiles split a head while
            ``head_norm`` is given.
    """
    problem = check_fused_tactic(tactic)
    if problem is not None:
        raise ConfigError(f"fused GEMV: {problem}; pick a tactic from get_valid_tactics.")
    m, k = x.shape
    bn, bk, warps = tactic["bn"], tactic["bk"], tactic["warps"]
    dot, stages, split = tactic["dot"], tactic["stages"], tactic["split"]
    if split > 1 and norm_in_loop:
        raise ConfigError(
            f"fused GEMV: tactic {tactic!r} splits K, but the in-loop RMSNorm needs the whole "
            "row in one program; use a tactic with split 1."
        )
    block_m = MAX_M if dot else 1
    placeholder = x
    if mode == ROPE:
        assert rope is not None
        positions, cos, sin, write_rows, k_cache, v_cache, heads, kv_heads, signed = rope
        half = cos.shape[-1] // 2
        if head_norm is not None and bn < half:
            raise ConfigError(
                f"fused GEMV: tactic {tactic!r} splits a head of {2 * half} features, but the "
                "per-head q/k norm needs the whole head in one program; use a tactic with bn >= "
                f"{half} (fused_gemv_tactics(..., whole_columns=True))."
            )
        tiles = (heads + 2 * kv_heads) * -(-half // bn)
        rope_args: tuple[Any, ...] = (positions, cos, sin, write_rows, k_cache, v_cache)
        rope_strides = (cos.stride(0), sin.stride(0), k_cache.stride(0), v_cache.stride(0))
    else:
        heads, kv_heads, signed, half = 1, 1, False, 1
        tiles = -(-n // bn)
        rope_args = (placeholder,) * 6
        rope_strides = (0, 0, 0, 0)
    res = residual if residual is not None else placeholder
    if not split_fits(tiles * -(-m // block_m)):
        split = 1  # more programs than arrival counters (a pick serving many more rows): unsplit
    grid = (tiles, -(-m // block_m), split)
    ws, counters, k_split, ws_pair = placeholder, placeholder, k, 0
    if split > 1:
        programs = grid[0] * grid[1]
        ws = split_partials(programs, split, bn * block_m, mode != PLAIN, x.device)
        counters = arrival_counters(
            x.device, programs, user="fused GEMV split-K", fix="use a tactic with split 1"
        )
        k_split, ws_pair = keys_per_split(k, split, bk), programs * split * bn * block_m
    args = (
        x,
        norm_weight if norm_weight is not None else placeholder,
        weight,
        bias if bias is not None else placeholder,
        res,
        out,
        *rope_args,
        head_norm if head_norm is not None else placeholder,
        ws,
        counters,
        m,
        n,
        k,
        k_split,
        ws_pair,
        float(eps),
        x.stride(0),
        weight.stride(0),
        res.stride(0),
        out.stride(0),
        *rope_strides,
    )
    meta = dict(
        MODE=mode,
        NORM=0 if norm_weight is None else 2 if norm_in_loop else 1,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        DOT=bool(dot),
        DEFER=not dot and defer_products(bn, bk, warps, mode != PLAIN),
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        NUM_HEADS=heads,
        NUM_KV=kv_heads,
        HALF=half,
        SIGNED_SIN=bool(signed),
        HEAD_NORM=mode == ROPE and head_norm is not None,
        SPLIT=split,
        num_warps=warps,
        num_stages=stages,
    )
    run_kernel(gemv_kernels().fused_gemv_kernel, grid, args, meta, warmup)
