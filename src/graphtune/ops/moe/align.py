"""Sort the routed (token, slot) pairs by expert and pad each expert to whole blocks, on the GPU.

The grouped GEMMs run one program per ``block_m`` rows of one expert, so the pairs are laid out
by expert, each expert's rows padded to a multiple of ``block_m``. A CUDA graph needs that layout
without knowing the counts on the host, so the buffers have their worst-case size (computed from
shapes only, :func:`max_sorted_rows`) and the real counts stay on the device:

* ``sorted_pairs [rows]`` (int32): the pair id ``token * k + slot`` of each row, grouped by
  expert in increasing expert order and by pair id inside an expert (deterministic); padding rows
  hold ``P = T * k``;
* ``block_expert [rows / block_m]`` (int32): the expert of each block, ``-1`` for the blocks past
  the last expert's rows, whose GEMM programs exit at once.

Two small kernels do it (``_kernels.moe_histogram_kernel`` then ``moe_align_kernel``), one program
per chunk of pairs (:func:`pairs_per_program`: up to :data:`CHUNK`, fewer so that about
:data:`PROGRAMS` programs share the work, since one program's steps run one after another);
when all pairs fit one chunk the second kernel alone runs, as one program. No ``.item()``, no
``nonzero``, no data-dependent shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphtune.autotuner.config import next_power_of_two
from graphtune.errors import ConfigError
from graphtune.ops._triton import run_kernel
from graphtune.ops.moe._loader import moe_kernels

#: Most pairs per program of the sort kernels.
CHUNK = 1024
#: Programs the sort kernels aim for (:func:`pairs_per_program`).
PROGRAMS = 64
#: One-hot elements (pairs x experts) a sort program compares per step (registers).
STEP_ELEMENTS = 4096


def pairs_per_program(pairs: int, sub: int) -> int:
    """Pairs one sort program takes: enough programs (about :data:`PROGRAMS`) that none walks
    long serial loops (each step of a program is a few block-wide reductions), at least one
    step of ``sub`` pairs and at most :data:`CHUNK` (each program reads every earlier chunk's
    counts, so many tiny chunks cost more than they save); a power of two."""
    wanted = next_power_of_two(max(1, math.ceil(pairs / PROGRAMS)))
    return min(CHUNK, max(sub, wanted))


def max_sorted_rows(pairs: int, experts: int, block_m: int) -> int:
    """Worst-case rows of the sorted layout: every expert that can be hit (at most
    ``min(E, P)``) padded by up to ``block_m - 1`` rows, rounded down to whole blocks (the real
    total is a whole number of blocks no larger than ``P + hit * (block_m - 1)``)."""
    hit = min(experts, pairs)
    return (pairs + hit * (block_m - 1)) // block_m * block_m


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class ExpertBlocks:
    """The sorted, padded layout of one routing (see the module docstring).

    Attributes:
        sorted_pairs: ``[rows]`` int32 pair ids, ``P`` on padding rows.
        block_expert: ``[rows // block_m]`` int32 expert per block, ``-1`` past the end.
        block_m: Rows per block.
        pairs: ``P = T * k``.
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    pairs: int

    @property
    def num_blocks(self) -> int:
        """Blocks in the layout (the GEMM grid's first factor)."""
        return int(self.block_expert.shape[0])


def sort_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, *, warmup: bool = False
) -> ExpertBlocks:
    """Lays the pairs of ``topk_ids [T, k]`` out by expert in blocks of ``block_m`` rows.

    Args:
        topk_ids: ``[T, k]`` int32/int64 expert ids; an id outside ``[0, E)`` gets no row.
        num_experts: ``E``.
        block_m: Rows per block, a power of two >= 16.
        warmup: Only compile the kernels (``kernel.warmup``); the buffers stay uninitialised.

    Raises:
        ConfigError: ``block_m`` is not a power of two >= 16, or ``num_experts < 1``.
    """
    if block_m < 16 or block_m & (block_m - 1) or num_experts < 1:
        raise ConfigError(
            f"sort_by_expert: block_m must be a power of two >= 16 and num_experts >= 1, got "
            f"block_m={block_m}, num_experts={num_experts}."
        )
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    pairs = flat.numel()
    rows = max_sorted_rows(pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    blocks = ExpertBlocks(sorted_pairs, block_expert, block_m, pairs)
    if pairs == 0:
        return blocks
    block_e = max(16, next_power_of_two(num_experts))
    sub = max(1, min(CHUNK, STEP_ELEMENTS // block_e))
    chunk = pairs_per_program(pairs, sub)
    chunks = math.ceil(pairs / chunk)
    one_chunk = chunks == 1
    hist = sorted_pairs  # unread placeholder when one program counts the pairs itself
    kernels = moe_kernels()
    if not one_chunk:
        hist = torch.empty((chunks, block_e), dtype=torch.int32, device=device)
        meta = dict(CHUNK=chunk, SUB=sub, BLOCK_E=block_e, num_warps=4)
        run_kernel(
            kernels.moe_histogram_kernel, (chunks,), (flat, hist, pairs, num_experts), meta, warmup
        )
    args = (
        flat,
        hist,
        sorted_pairs,
        block_expert,
        pairs,
        num_experts,
        chunks,
        rows,
        math.ceil(rows / chunks),
    )
    meta = dict(
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        CHUNK=chunk,
        SUB=sub,
        SUB_ROWS=sub,
        ONE_CHUNK=one_chunk,
        num_warps=4,
    )
    run_kernel(kernels.moe_align_kernel, (chunks,), args, meta, warmup)
    return blocks
