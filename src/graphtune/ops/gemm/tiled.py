"""The tiled Triton GEMM runner (``tl.dot`` tiles, optional split-K) of the ``graphtune.gemm`` op.

Tactics are dicts ``{"bm", "bn", "bk", "warps", "stages", "split_k"}``. For decode the batch is
skinny (``M`` of 1..64), so one row of output tiles gives too few programs to fill the GPU;
split-K cuts the K loop into ``split_k`` slices run by separate programs of one launch (see
:mod:`graphtune.ops._split_k`).

Pruning rules of :func:`gemm_tactics` (a pruned config is never timed):

* a block never exceeds the next power of two of its dimension (it is clamped, duplicates dropped);
* split-K only for skinny ``M`` (``<= 64``), and only when ``K`` splits into whole ``bk`` blocks
  (``K % (split_k * bk) == 0``); split counts near ``SMs / output tiles`` only. A split adds no
  launch: the last split of a tile to finish sums the partials in the same kernel
  (:mod:`graphtune.ops._split_k`). 128 rows get none: measured there, no split tactic won
  (benchmarks/results/README.md, "The tiled GEMM's split-K in one launch");
* the pipelined operand tiles ``stages * (bm + bn) * bk * itemsize`` fit the shared-memory budget;
* measured losers are not offered: no tactics for one row (the GEMV runner and cuBLAS), split-K
  of at most 8, and no split-K for the ``(32, 128, 4, 4)`` tile up to 16 rows. Over every GEMM
  case of the committed tuning-quality runs (``benchmarks/results/tuning-*.json``: Llama-1B's five
  decode GEMMs at buckets 1 to 128, 182 observations of 35 cases) none of these came within 5.8%
  of the case's best under either truth (CUPTI kernel time, or replayed back to back in a graph);
  the graph timer read the split-K ``(32, 128, 4, 4)`` tiles about 10% faster than both truths
  and picked them at 8 and 16 rows, 11 to 18% from the best.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from graphtune.autotuner.config import next_power_of_two
from graphtune.errors import ConfigError
from graphtune.ops import _pruned
from graphtune.ops._counters import arrival_counters, split_fits
from graphtune.ops._split_k import split_partials
from graphtune.ops._triton import KERNELS_SOURCES, device_limits, kernels, run_kernel
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.gemm.common import (
    kernel_operands,
    result_tensor,
    torch_gemm,
    triton_gemm_supports,
    unpack_gemm_inputs,
)
from graphtune.ops.gemm.skinny import skinny_supports, skinny_tactics

# (bn, bk, warps, stages): tiles that suit skinny-M GEMMs with large N and K; bm follows M.
BASE_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (32, 128, 4, 4),
    (64, 64, 4, 4),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (128, 64, 4, 4),
    (128, 128, 8, 3),
)
SPLIT_K_CHOICES = (2, 4, 8)
#: The tile whose split-K tactics are not offered up to :data:`NO_SPLIT_TILE_MAX_M` rows.
NO_SPLIT_TILE = (32, 128, 4, 4)
NO_SPLIT_TILE_MAX_M = 16
SKINNY_M = 64
TACTIC_KEYS = ("bm", "bn", "bk", "warps", "stages", "split_k")


def _block_ok(block: int) -> bool:
    return block >= 16 and block & (block - 1) == 0


def check_gemm_tactic(tactic: Any, k: int) -> str | None:
    """Why ``tactic`` cannot run a GEMM with inner size ``k``, or ``None`` when it can.

    These are the rules a tactic must satisfy on every ``M`` (a bucket's pick also runs the sizes
    that map to the bucket): known keys, power-of-two blocks ``>= 16`` (``tl.dot``), and split-K
    slices of whole ``bk`` blocks.
    """
    if not isinstance(tactic, dict) or set(tactic) != set(TACTIC_KEYS):
        return f"a Triton GEMM tactic is a dict with keys {TACTIC_KEYS}, got {tactic!r}"
    values = [tactic[key] for key in TACTIC_KEYS]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        return f"every value of a GEMM tactic must be a positive int, got {tactic!r}"
    if not all(_block_ok(tactic[key]) for key in ("bm", "bn", "bk")):
        return f"bm, bn and bk must be powers of two >= 16 (tl.dot), got {tactic!r}"
    split = tactic["split_k"]
    if split > 1 and k % (split * tactic["bk"]):
        return (
            f"split_k={split} with bk={tactic['bk']} needs K divisible by "
            f"{split * tactic['bk']}, but K={k}"
        )
    return None


def gemm_tactics(
    m: int,
    n: int,
    k: int,
    *,
    itemsize: int,
    smem_bytes: int,
    sm_count: int,
    max_tactics: int = 20,
) -> list[dict[str, int]]:
    """Triton GEMM tactics worth timing for one ``(M, N, K)`` (see the module's pruning rules).

    Args:
        m: Rows of ``a`` (the bucket).
        n: Output features.
        k: Inner size.
        itemsize: Bytes per operand element.
        smem_bytes: Shared memory one program may use.
        sm_count: Streaming multiprocessors (sizes the split-K candidates).
        max_tactics: Upper bound on the list; when more are valid, those that fill the GPU's
            SMs best in whole waves are kept.

    Returns:
        Tactic dicts in a fixed order (base config, then split count), so ties in tuning go to
        the simpler config.
    """
    if m <= 1:
        return []
    bm = min(max(16, next_power_of_two(m)), 128)
    bms = [bm] if m <= SKINNY_M else sorted({min(bm, 64), bm})
    # Blocks larger than their dimension only compute padding: clamp them to the dimension
    # (>= 16 for tl.dot) and drop the duplicates this creates.
    bn_cap, bk_cap = max(16, next_power_of_two(n)), max(16, next_power_of_two(k))
    found: list[tuple[float, int, dict[str, int]]] = []
    seen: set[tuple[int, ...]] = set()
    for bm_value in bms:
        for bn_base, bk_base, warps, stages in BASE_CONFIGS:
            bn, bk = min(bn_base, bn_cap), min(bk_base, bk_cap)
            if stages * (bm_value + bn) * bk * itemsize > smem_bytes:
                continue
            tiles = math.ceil(m / bm_value) * math.ceil(n / bn)
            splits = [1]
            no_split = (
                m <= NO_SPLIT_TILE_MAX_M and (bn_base, bk_base, warps, stages) == NO_SPLIT_TILE
            )
            if m <= SKINNY_M and not no_split:
                target = sm_count / tiles
                splits += [s for s in SPLIT_K_CHOICES if target / 2 <= s <= target * 2]
            for split in splits:
                tactic = {
                    "bm": bm_value,
                    "bn": bn,
                    "bk": bk,
                    "warps": warps,
                    "stages": stages,
                    "split_k": split,
                }
                ident = tuple(tactic.values())
                if ident in seen or check_gemm_tactic(tactic, k) is not None:
                    continue
                seen.add(ident)
                programs = tiles * split
                waves = math.ceil(programs / sm_count)
                fill = programs / (waves * sm_count)
                found.append((fill, len(found), tactic))
    if len(found) > max_tactics:
        keep = sorted(found, key=lambda item: (-item[0], item[1]))[:max_tactics]
        found = sorted(keep, key=lambda item: item[1])
    return [tactic for _, _, tactic in found]


class TritonGemmRunner(TritonRunner):
    """Triton GEMM with block / warp / stage / split-K tactics; tactic ``-1`` is ``F.linear``.

    Args:
        max_tactics: Upper bound on tactics per bucket.
        sm_count: Override the device's SM count (tests, or to tune for another GPU's split-K).
        smem_bytes: Override the shared-memory budget per program.
        min_rows: Smallest bucket offered tactics when the skinny GEMM takes the inputs
            (``None``: :data:`graphtune.ops._pruned.TILED_GEMM_MIN_ROWS`; 1 offers every
            bucket).
        compile_workers: Threads for ahead-of-time compilation.
    """

    # The pruning rule reads the limits and the skinny GEMM's coverage: both change the candidates.
    source_modules = (*KERNELS_SOURCES, "graphtune.ops._pruned", "graphtune.ops.gemm.skinny")
    _DEFAULTS = {"sm": None, "smem": None, "max": 20, "min": None}

    def __init__(
        self,
        *,
        max_tactics: int = 20,
        sm_count: int | None = None,
        smem_bytes: int | None = None,
        min_rows: int | None = None,
        compile_workers: int | None = None,
    ) -> None:
        super().__init__(compile_workers=compile_workers)
        self.max_tactics = max_tactics
        self.sm_count = sm_count
        self.smem_bytes = smem_bytes
        self.min_rows = min_rows

    def cache_key_extras(self) -> tuple[Any, ...]:
        """Overrides change the candidate set, so they are part of the runner's identity."""
        extras = {
            "sm": self.sm_count,
            "smem": self.smem_bytes,
            "max": self.max_tactics,
            "min": self.min_rows,
        }
        return () if extras == self._DEFAULTS else (extras,)

    def supports(self, inputs: list[Any]) -> bool:
        """See :func:`triton_gemm_supports`."""
        return triton_gemm_supports(inputs)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`gemm_tactics`; device limits come from the inputs' device. None below
        ``min_rows`` rows where the skinny GEMM (``graphtune.ops.gemm.skinny``) takes the inputs
        and offers tactics for them: it covers those rows."""
        a, weight = inputs[0], inputs[1]
        smem, sms = device_limits(a.device)
        min_rows = _pruned.TILED_GEMM_MIN_ROWS if self.min_rows is None else self.min_rows
        few_rows = a.shape[0] < min_rows
        if few_rows and skinny_supports(inputs) and skinny_tactics(a, weight, self.sm_count or sms):
            return []  # the skinny GEMM covers these rows
        return list(
            gemm_tactics(
                a.shape[0],
                weight.shape[0],
                a.shape[1],
                itemsize=a.element_size(),
                smem_bytes=self.smem_bytes or smem,
                sm_count=self.sm_count or sms,
                max_tactics=self.max_tactics,
            )
        )

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """:func:`torch_gemm`: the fallback tactic."""
        return torch_gemm(inputs)

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs the Triton GEMM for ``tactic`` (one launch, split-K included).

        Raises:
            ConfigError: ``tactic`` breaks a rule of :func:`check_gemm_tactic` for this K.
        """
        a, weight, bias, residual, inplace = unpack_gemm_inputs(inputs)
        m, k = a.shape
        n = weight.shape[0]
        problem = check_gemm_tactic(tactic, k)
        if problem is not None:
            raise ConfigError(f"TritonGemmRunner: {problem}; pick a tactic from get_valid_tactics.")
        out = result_tensor(inputs, a, n, residual, inplace)
        if m == 0:
            return out
        launch_tiled_gemm(a, weight, bias, residual, out, tactic, warmup=warmup)
        return out


def launch_tiled_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    tactic: dict[str, int],
    *,
    silu_pairs: bool = False,
    warmup: bool = False,
) -> None:
    """Launches (or with ``warmup`` compiles) ``gemm_kernel`` for a checked ``tactic`` into
    ``out`` (``[M, N]``; a split-K tactic reduces its splits in the same launch), or with
    ``silu_pairs`` (one split, no bias or residual) ``silu(a @ weight[:N].T) *
    (a @ weight[N:].T)`` for a ``[2 * N, K]`` weight (see the kernel).

    A split-K tactic launches unsplit when its tiles outnumber the arrival counters
    (:func:`graphtune.ops._counters.split_fits`).
    """
    m, k = a.shape
    n = weight.shape[0] // 2 if silu_pairs else weight.shape[0]
    bm, bn, bk = tactic["bm"], tactic["bn"], tactic["bk"]
    tiles = math.ceil(m / bm) * math.ceil(n / bn)
    split = tactic["split_k"] if split_fits(tiles) else 1  # more tiles than counters: unsplit
    k_per_split = k // split if split > 1 else k
    grid = (tiles, split)
    pointers, strides = kernel_operands(a, weight, bias, residual)
    ws = counters = a  # unread placeholders without a split
    if split > 1:
        ws = split_partials(tiles, split, bm * bn, False, a.device)
        counters = arrival_counters(
            a.device, tiles, user="Triton GEMM split-K", fix="use a tactic with split_k 1"
        )
    args = (*pointers, out, ws, counters, m, n, k, k_per_split, *strides, *out.stride())
    meta = dict(
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        SPLIT_K=split,
        EVEN_K=k_per_split % bk == 0,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SILU_PAIRS=silu_pairs,
        num_warps=tactic["warps"],
        num_stages=tactic["stages"],
    )
    run_kernel(kernels().gemm_kernel, grid, args, meta, warmup)
