"""Triton GEMV kernel for skinny decode GEMMs. Imported only through
``graphtune.ops.gemm.gemv.gemv_kernels()``.

At batch 1..8 a decode GEMM ``out [M, N] = a [M, K] @ w [N, K].T`` reads ``N * K`` weights once
and does ``2 * M`` flops per weight: it is a memory-bound stream over ``w``, and ``tl.dot`` tiles
(16 rows at least) would mostly multiply padding. This kernel streams ``[BLOCK_N, BLOCK_K]``
weight tiles (contiguous along ``K``: 16-byte vector loads) and multiplies each tile by every
activation row on the CUDA cores, so the weights are read from memory once for up to 8 rows.

Why the rows are written out (``acc0`` .. ``acc7`` under ``constexpr`` guards on ``BLOCK_M``)
instead of one 3-D ``[BLOCK_M, BLOCK_N, BLOCK_K]`` broadcast: the broadcast leaves the layout of
the row dimension to the compiler (rows spread over warps would load the weight tile once per
warp, and the 2-D weight load would be converted to a 3-D slice layout through shared memory),
while per-row accumulators keep the weight tile in its own 2-D layout, loaded once and reused by
every row. Compiled for sm_90 (Triton 3.9), the loop then has no layout conversion and no register
spills for any tactic of ``graphtune.ops.gemm.gemv``. Rows past ``BLOCK_M`` compile to nothing.

Only stable ``tl.`` APIs are used (Triton 3.0 .. 3.9); ``griddepcontrol`` only under ``USE_PDL``.
The loop is a plain ``range`` without ``tl.dot``: Triton would pipeline it only through shared
memory (``cp.async``), which measured slower for this stream on the H200, so the kernel loads each
weight chunk one iteration ahead in registers, and the bytes in flight come from those vector
loads and from the programs resident per SM, which is how the tactics are sized. No helper
``@triton.jit`` functions are called per row: Triton's CPU interpreter (the tests) pays
milliseconds per nested call, and the code is as short written out.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphtune._split_k_jit import last_to_arrive, sum_partials


@triton.jit(do_not_specialize=["M"])
def gemv_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    ws_ptr,
    count_ptr,
    M,
    N,
    K_PER_SPLIT,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_rm,
    stride_rn,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DEFER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out = a @ w.T (+ bias) (+ res)`` for ``a [M, K]``, ``w [N, K]``, without ``tl.dot``.

    Program ``(m * cdiv(N, BLOCK_N) + n, s)`` owns output features ``[n * BLOCK_N, ...)``, rows
    ``[m * BLOCK_M, ...)`` (``BLOCK_M <= 8``) and ``K`` slice ``s`` of ``K_PER_SPLIT`` columns
    (a multiple of ``BLOCK_K`` when ``EVEN_K``, which drops every mask from the loop). Each weight
    chunk is loaded once and multiplied by all ``BLOCK_M`` rows, accumulating in float32.

    Rows ``>= M`` and features ``>= N`` are *clamped* to the last valid one for loading (their
    results are discarded by the store masks), so partial tiles need no load masks.

    ``DEFER``: each row accumulates the whole ``[BLOCK_N, BLOCK_K]`` tile of products and sums it
    over ``K`` once, after the loop (a chunk costs only multiply-adds: no cross-thread and, when
    ``K`` spans warps, no shared-memory reduction). Otherwise each chunk is summed at once into
    ``[BLOCK_N]``, which holds far fewer registers per row.

    Epilogue as :func:`graphtune.ops._kernels.gemm_kernel`: bias and residual are added in float32
    and rounded once; ``out`` may be ``res`` (each element is read, then written, by the same
    program). With ``SPLIT_K > 1`` the splits of a tile meet in this launch, as the tiled GEMM's
    do (``graphtune.ops._split_k``): each stores its float32 ``[BLOCK_M, BLOCK_N]`` partial in
    ``ws``, counts itself in the tile's counter (``count``, zero between launches), and the split
    that counts last sums the partials in split order (deterministic), runs the epilogue and
    resets the counter.
    """
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    # Row blocks share axis 0 with feature blocks (axis 2 would cap them at 65535); features vary
    # fastest, so the programs running together read the same activation rows.
    grid_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // grid_n
    pid_n = pid % grid_n
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # 64-bit offsets: an LM-head weight (128256 x 8192) has over 2^30 elements.
    n_safe = tl.minimum(offs_n, N - 1).to(tl.int64)
    k_first = pid_s.to(tl.int64) * K_PER_SPLIT
    w_ptrs = w_ptr + n_safe[:, None] * stride_wn + (k_first + offs_k)[None, :] * stride_wk
    # The activation chunk is addressed as a [BLOCK_N, BLOCK_K] tile whose rows all point at the
    # same K columns: shaped like the weight tile, it gets the weight tile's register layout, so
    # the product needs no layout conversion (a [BLOCK_K] load gets a 1-D layout, converted
    # through shared memory for every row and chunk). Repeated addresses cost one transaction.
    a_rows = (n_safe * 0)[:, None]
    row0 = pid_m * BLOCK_M
    a_row0 = a_ptr + tl.minimum(row0, M - 1).to(tl.int64) * stride_am
    if BLOCK_M > 1:
        a_row1 = a_ptr + tl.minimum(row0 + 1, M - 1).to(tl.int64) * stride_am
    if BLOCK_M > 2:
        a_row2 = a_ptr + tl.minimum(row0 + 2, M - 1).to(tl.int64) * stride_am
        a_row3 = a_ptr + tl.minimum(row0 + 3, M - 1).to(tl.int64) * stride_am
    if BLOCK_M > 4:
        a_row4 = a_ptr + tl.minimum(row0 + 4, M - 1).to(tl.int64) * stride_am
        a_row5 = a_ptr + tl.minimum(row0 + 5, M - 1).to(tl.int64) * stride_am
        a_row6 = a_ptr + tl.minimum(row0 + 6, M - 1).to(tl.int64) * stride_am
        a_row7 = a_ptr + tl.minimum(row0 + 7, M - 1).to(tl.int64) * stride_am
    if DEFER:
        acc0 = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    else:
        acc0 = tl.full((BLOCK_N,), 0.0, tl.float32)
    acc1 = acc0  # the same zeros; rows past BLOCK_M are neither updated nor stored
    acc2 = acc0
    acc3 = acc0
    acc4 = acc0
    acc5 = acc0
    acc6 = acc0
    acc7 = acc0
    # The first weight chunk depends on no earlier kernel: with PDL it is issued before waiting
    # for one (graphtune.ops._pdl), and each chunk after it is loaded one iteration ahead.
    if EVEN_K:
        w_next = tl.load(w_ptrs)
    else:
        w_next = tl.load(w_ptrs, mask=(offs_k < K_PER_SPLIT)[None, :], other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + n_safe)  # a weight too: before the wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # The epilogue's tiles are [BLOCK_N, BLOCK_M], features by rows: a row's [BLOCK_N] sum
    # expands along axis 1 back into the weight tile's register layout, so assembling the tile
    # needs no layout conversion through shared memory.
    lines = tl.arange(0, BLOCK_M)[None, :]
    # The residual is the epilogue's one read of an earlier kernel's output: issued here, it
    # arrives during the main loop instead of costing a round trip after it. Nothing uses it
    # before the loop (not even a cast): a warp stops at the first use of a load, and the loop's
    # loads would wait behind it. Rows and features are clamped like the loads above (the store
    # masks drop them).
    if HAS_RES:
        res_rows = tl.minimum(row0 + lines, M - 1).to(tl.int64) * stride_rm
        res_tile = tl.load(res_ptr + res_rows + (n_safe * stride_rn)[:, None])
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:
            k_mask = None
            k_other = None
        else:
            k_mask = (k + offs_k < K_PER_SPLIT)[None, :]
            k_other = 0.0
        a_offs = (k_first + k + offs_k)[None, :] * stride_ak + a_rows
        w = w_next.to(tl.float32)  # shared by every row
        w_ptrs += BLOCK_K * stride_wk
        w_next = tl.load(w_ptrs, mask=(k + BLOCK_K + offs_k < K_PER_SPLIT)[None, :], other=0.0)
        prod = w * tl.load(a_row0 + a_offs, mask=k_mask, other=k_other).to(tl.float32)
        acc0 += prod if DEFER else tl.sum(prod, axis=1)
        if BLOCK_M > 1:
            prod = w * tl.load(a_row1 + a_offs, mask=k_mask, other=k_other).to(tl.float32)
            acc1 += prod if DEFER else tl.sum(prod, axis=1)
        if BLOCK_M > 2:
            prod = w * tl.load(a_row2 + a_offs, mask=k_mask, other=k_other).to(tl.float32)
            acc2 += prod if DEFER else tl.sum(prod, axis=1)
            prod = w * tl.load(a_row3 + a_offs, mask=k_mask, other=k_other).to(tl.float32)
            acc3 += prod if DEFER else tl.sum(prod, axis=1)
        if BLOCK_M > 4:
            prod = w * tl.load(a_row4 + a_offs, mask=k_mask, other=k_other).to(tl.float32)
            acc4 += prod if DEFER else tl.sum(prod, axis=1)
            prod = w * tl.load(a_row5 + a_offs, mask=k_mask, other=k_other).to(tl.float32)
            acc5 += prod if DEFER else tl.sum(prod, axis=1)
            prod = w * tl.load(a_row6 + a_offs, mask=k_mask, other=k_other).to(tl.float32)
            acc6 += prod if DEFER else tl.sum(prod, axis=1)
            prod = w * tl.load(a_row7 + a_offs, mask=k_mask, other=k_other).to(tl.float32)
            acc7 += prod if DEFER else tl.sum(prod, axis=1)

    tile = tl.where(lines == 0, (tl.sum(acc0, axis=1) if DEFER else acc0)[:, None], 0.0)
    if BLOCK_M > 1:
        tile = tl.where(lines == 1, (tl.sum(acc1, axis=1) if DEFER else acc1)[:, None], tile)
    if BLOCK_M > 2:
        tile = tl.where(lines == 2, (tl.sum(acc2, axis=1) if DEFER else acc2)[:, None], tile)
        tile = tl.where(lines == 3, (tl.sum(acc3, axis=1) if DEFER else acc3)[:, None], tile)
    if BLOCK_M > 4:
        tile = tl.where(lines == 4, (tl.sum(acc4, axis=1) if DEFER else acc4)[:, None], tile)
        tile = tl.where(lines == 5, (tl.sum(acc5, axis=1) if DEFER else acc5)[:, None], tile)
        tile = tl.where(lines == 6, (tl.sum(acc6, axis=1) if DEFER else acc6)[:, None], tile)
        tile = tl.where(lines == 7, (tl.sum(acc7, axis=1) if DEFER else acc7)[:, None], tile)
    if SPLIT_K > 1:
        # The splits' tiles meet as every split-K kernel's do (graphtune/_split_k_jit.py).
        cells = BLOCK_M * BLOCK_N
        cell = lines * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        first = ws_ptr + (pid * SPLIT_K).to(tl.int64) * cells
        tl.store(first + pid_s * cells + cell, tile)
        is_last = last_to_arrive(count_ptr + pid, SPLIT_K)
        tile = sum_partials(first, cell, is_last, SPLIT_K, cells)
        rows_bound = tl.where(is_last, M, 0)  # only the last split stores
    else:
        rows_bound = M
    rows = (row0 + lines).to(tl.int64)
    mask = (rows < rows_bound) & (offs_n < N)[:, None]
    if HAS_BIAS:
        tile += bias.to(tl.float32)[:, None]
    if HAS_RES:
        tile += res_tile.to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows * stride_om + (offs_n * stride_on)[:, None], tile.to(out_ty), mask=mask)
