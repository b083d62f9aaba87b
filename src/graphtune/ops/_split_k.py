"""Split-K in one kernel: a launch's partials workspace and its slices of ``K``.

A split-K launch of the fused GEMV (``graphtune.ops.fused_gemv._kernels.fused_gemv_kernel``), of
the tiled GEMM (``graphtune.ops._kernels.gemm_kernel``) or of the CUDA-core GEMV
(``graphtune.ops.gemm._gemv_kernels.gemv_kernel``) runs ``split`` programs per output tile, each
over one slice of ``K``. Each stores its float32 partial tile into a per-launch
workspace (:func:`split_partials`) and counts its arrival in the tile's counter
(``graphtune.ops._counters``); the program that arrives last sums the partials in split order,
runs the epilogue and sets the counter back to zero (the device functions of
``graphtune._split_k_jit``). So one kernel does the whole product, and the result does not depend
on the order in which the splits finish.
"""

from __future__ import annotations

import math

import torch


def split_partials(
    tiles: int, split: int, tile_cells: int, paired: bool, device: torch.device
) -> torch.Tensor:
    """The float32 workspace of one split-K launch: ``tiles * split`` partial tiles of
    ``tile_cells`` cells, twice over for paired tiles (SiLU, RoPE). Uninitialised on purpose:
    every cell is written before it is read, so there is no fill kernel (and nothing that would
    have to run before a graph replay)."""
    cells = tiles * split * tile_cells * (2 if paired else 1)
    return torch.empty(cells, dtype=torch.float32, device=device)


def keys_per_split(k: int, split: int, bk: int) -> int:
    """``K`` columns of each split: whole ``bk`` chunks, shared out evenly (the last split may get
    fewer; a split past ``K`` stores a zero partial)."""
    return math.ceil(math.ceil(k / bk) / split) * bk
