"""The fused decode GEMV kernel of :mod:`graphtune.ops.fused`. Imported only through
``graphtune.ops.fused_gemv.family.gemv_kernels()`` (needs Triton).

One kernel, specialised by ``constexpr`` switches into the stages of a decode layer, so the
weight-streaming loop (the part that decides the step's speed) exists once:

* ``NORM`` 1, a prologue: RMSNorm of the activation rows, recomputed by every program (a row of
  2048 to 4096 elements is read from L2 in well under a microsecond) before its first product;
  the normalised activations are rounded to the dtype before the product, as the unfused
  ``rms_norm`` output is;
* ``NORM`` 2, in the loop: the main loop multiplies ``x * norm_weight`` and sums ``x^2`` from the
  chunks it loads anyway, and the epilogue scales the sums by ``rsqrt(mean(x^2) + eps)``, so no
  pass over ``x`` precedes the stream; the normalised activations are never rounded (on the
  tensor-core path ``x * norm_weight`` is rounded once, for ``tl.dot``);
* ``MODE`` 0 (plain): ``out = x @ w.T (+ bias) (+ res)``, in place when ``out`` is ``res``;
* ``MODE`` 1 (SiLU-and-mul): a program owns gate rows ``j`` and the matching up rows ``N + j``,
  ``out[:, j] = silu(gate) * up`` with the roundings of ``graphtune.ops.activation``;
* ``MODE`` 2 (RoPE + K/V write): tiles lie inside one head of the fused ``[q | k | v]`` rows and
  hold both halves' rows ``j`` and ``HALF + j``; q heads are rotated into ``out``, k heads rotated
  into the K cache, v heads copied into the V cache, with the roundings of
  ``graphtune.ops._kernels.rope_kv_kernel``; with ``HEAD_NORM`` a tile holds a whole head and q
  and k heads are first RMS-normalised over it (Qwen3's q/k norm, same ``eps``).

The product runs on the CUDA cores for one row (``DOT`` false: every weight element is used once,
so there is nothing for a tensor core to reuse) or on the tensor cores with swapped operands for
up to 16 rows (``DOT`` true: ``acc [BLOCK_N, 16] += w [BLOCK_N, BLOCK_K] @ x.T [BLOCK_K, 16]``, so
the weight rows fill the MMA's M side and the few activation rows are padded to 16 in N). Both
stream the weight once and accumulate in float32; bias, residual and the epilogue's roundings
follow the unfused ops exactly, so only the summation order of the dot products differs.

The CUDA-core loop keeps one weight chunk in flight ahead of the one being multiplied
(``w_next``) in registers: Triton would pipeline a loop of plain loads only through shared memory
(``cp.async``), which measured slower for this stream on the H200. With ``USE_PDL`` that loop's
first chunk is loaded before ``gdc_wait()`` (weights are never written by an earlier kernel),
which overlaps its DRAM latency with the predecessor's tail (see ``graphtune.ops._pdl`` for the
contract). The tensor-core loop is pipelined by Triton (the tactic's ``stages``).

With ``SPLIT > 1`` the grid's third axis splits ``K``: program ``s`` streams ``K_SPLIT`` columns
from ``s * K_SPLIT``, and the epilogue runs once per tile, in the split that arrives last, on the
sum of the float32 partials in split order (``graphtune.ops._split_k``); the RMSNorm in
the loop (``NORM`` 2) needs whole rows and is never split.

Rows past ``M`` and columns past the tile are clamped to valid addresses for loading and masked
at the store, so loads need masks only along ``K``. Only stable ``tl.`` APIs are used, and the
``griddepcontrol`` calls only under ``USE_PDL``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphtune._rope_jit import head_rms_norm_halves, rotate_halves
from graphtune._split_k_jit import last_to_arrive, sum_partials


@triton.jit(do_not_specialize=["M"])
def fused_gemv_kernel(
    x_ptr,
    nw_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    rows_ptr,
    k_ptr,
    v_ptr,
    hn_ptr,
    ws_ptr,
    count_ptr,
    M,
    N,
    K,
    K_SPLIT,
    WS_PAIR,
    eps,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_om,
    stride_cos,
    stride_sin,
    stride_kc,
    stride_vc,
    MODE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    DOT: tl.constexpr,
    DEFER: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV: tl.constexpr,
    HALF: tl.constexpr,
    SIGNED_SIN: tl.constexpr,
    HEAD_NORM: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program ``(tile, row block)``; see the module docstring for the modes.

    ``x [M, K]``, ``w [rows, K]`` and ``res`` / ``out`` have unit stride along their last axis.
    ``N`` is the output width: features (mode 0), the intermediate size (mode 1, ``w`` has
    ``2 * N`` rows), or unused (mode 2, where ``w`` has ``(NUM_HEADS + 2 * NUM_KV) * 2 * HALF``
    rows, ``out`` is ``q [M, NUM_HEADS, 2 * HALF]`` and ``rows[m * NUM_KV + h]`` is the cache row
    of token ``m``'s KV head ``h``; with ``HEAD_NORM``, ``hn [NUM_HEADS + NUM_KV, 2 * HALF]``
    holds the q and k heads' norm weights and ``BLOCK_N >= HALF``). ``DEFER`` (CUDA-core path
    only) keeps ``[BLOCK_N, BLOCK_K]`` product accumulators and sums them once after the loop.
    """
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    lanes = tl.arange(0, BLOCK_N)
    if SPLIT > 1:
        pid_s = tl.program_id(2)
        k_lo = pid_s * K_SPLIT
        k_hi = tl.minimum(K, k_lo + K_SPLIT)
    else:
        k_lo = 0
        k_hi = K
    if MODE == 2:
        tiles_per_head = (HALF + BLOCK_N - 1) // BLOCK_N
        head = pid // tiles_per_head
        col = (pid % tiles_per_head) * BLOCK_N + lanes  # column j of the head's first half
        col_ok = col < HALF
        rows_a = head * (2 * HALF) + tl.minimum(col, HALF - 1)
        rows_b = rows_a + HALF
    else:
        col = pid * BLOCK_N + lanes
        col_ok = col < N
        rows_a = tl.minimum(col, N - 1)
        rows_b = rows_a + N  # mode 1: the up row of gate row j; unused in mode 0
    wa_ptrs = w_ptr + rows_a.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    wb_ptrs = w_ptr + rows_b.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    kk = tl.arange(0, BLOCK_K)
    if not DOT:
        # The first weight chunk depends on no earlier kernel: issue it before waiting for one.
        k_ok = (k_lo + kk < k_hi)[None, :]
        wa = tl.load(wa_ptrs + k_lo, mask=k_ok, other=0.0)
        if MODE != 0:
            wb = tl.load(wb_ptrs + k_lo, mask=k_ok, other=0.0)
    # The epilogue's weights (bias, q/k norm) are read before the wait as well, and its reads of
    # earlier kernels' outputs that need nothing else (the residual, the positions, the cache
    # rows) right after it: issued before the main loop, they arrive during it instead of costing
    # round trips after it. Nothing uses them before the loop (not even a cast): a warp stops at
    # the first use of a load, and the loop's loads would wait behind it. The cos/sin rows need
    # the positions, so they are read after the loop.
    if HAS_BIAS:
        bias_a = tl.load(bias_ptr + rows_a)
        if MODE != 0:
            bias_b = tl.load(bias_ptr + rows_b)
    if MODE == 2:
        jc = tl.minimum(col, HALF - 1)[:, None]
        if HEAD_NORM:
            w_row = hn_ptr + tl.minimum(head, NUM_HEADS + NUM_KV - 1) * (2 * HALF) + jc
            w1 = tl.load(w_row)
            w2 = tl.load(w_row + HALF)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if MODE != 2:
            tl.extra.cuda.gdc_launch_dependents()

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    dtype = w_ptr.dtype.element_ty
    if MODE == 0 and HAS_RES:
        res = tl.load(
            res_ptr + rows64[None, :] * stride_rm + col[:, None],
            mask=col_ok[:, None] & row_ok[None, :],
        )
    if MODE == 2:
        is_q = head < NUM_HEADS
        is_k = (head >= NUM_HEADS) & (head < NUM_HEADS + NUM_KV)
        is_v = head >= NUM_HEADS + NUM_KV
        safe_rows = tl.minimum(rows, M - 1).to(tl.int64)
        pos = tl.load(pos_ptr + safe_rows)
        kv_head = tl.where(is_k, head - NUM_HEADS, tl.where(is_v, head - NUM_HEADS - NUM_KV, 0))
        cache_row = tl.load(rows_ptr + safe_rows * NUM_KV + kv_head)
    if DOT:
        # x.T tile [BLOCK_K, BLOCK_M]; rows past M are clamped (their results are not stored).
        x_ptrs = x_ptr + tl.minimum(rows, M - 1).to(tl.int64)[None, :] * stride_xm + kk[:, None]
        if NORM == 2:
            sq = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)  # summed over the main loop
        if NORM == 1:
            sq = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xt = tl.load(x_ptrs + k0, mask=(k0 + kk < K)[:, None], other=0.0).to(tl.float32)
                sq += xt * xt
            rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        acc_a = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        # One row; the activation chunk is addressed as a [BLOCK_N, BLOCK_K] tile whose rows
        # all point at the same columns, so it gets the weight tile's layout (see
        # graphtune.ops.gemm._gemv_kernels) and the product needs no layout conversion.
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        same = (lanes * 0)[:, None]
        if NORM == 1:
            sq1 = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xv = tl.load(x_row + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)
                sq1 += xv * xv
            rstd1 = tl.rsqrt(tl.sum(sq1, axis=0) / K + eps)
        if DEFER:
            acc_a = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        else:
            acc_a = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_b = acc_a
        sq_n = acc_a  # NORM == 2: the row's squares, the same in every lane of the tile

    if DOT:
        # Triton's pipeliner (the launch's num_stages) keeps the weight tiles of the next chunks
        # in flight through shared memory, as for any tl.dot loop.
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kmask = (k0 + kk < k_hi)[:, None]
            wa = tl.load(wa_ptrs + k0, mask=(k0 + kk < k_hi)[None, :], other=0.0)
            xt = tl.load(x_ptrs + k0, mask=kmask, other=0.0)
            if NORM == 1:
                nw = tl.load(nw_ptr + k0 + kk, mask=k0 + kk < k_hi, other=0.0).to(tl.float32)
                xt = (xt.to(tl.float32) * rstd[None, :] * nw[:, None]).to(dtype)
            if NORM == 2:
                nw = tl.load(nw_ptr + k0 + kk, mask=k0 + kk < k_hi, other=0.0).to(tl.float32)
                x32 = xt.to(tl.float32)
                sq += x32 * x32
                xt = (x32 * nw[:, None]).to(dtype)
            if IEEE:
                acc_a += tl.dot(wa, xt, input_precision="ieee")
            else:
                acc_a += tl.dot(wa, xt)
            if MODE != 0:
                wb = tl.load(wb_ptrs + k0, mask=(k0 + kk < k_hi)[None, :], other=0.0)
                if IEEE:
                    acc_b += tl.dot(wb, xt, input_precision="ieee")
                else:
                    acc_b += tl.dot(wb, xt)
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            next_ok = (k0 + BLOCK_K + kk < k_hi)[None, :]
            wa_next = tl.load(wa_ptrs + (k0 + BLOCK_K), mask=next_ok, other=0.0)
            if MODE != 0:
                wb_next = tl.load(wb_ptrs + (k0 + BLOCK_K), mask=next_ok, other=0.0)
            kmask = (k0 + kk < k_hi)[None, :]
            xt = tl.load(x_row + same + (k0 + kk)[None, :], mask=kmask, other=0.0)
            if NORM == 1:
                nw = tl.load(nw_ptr + same + (k0 + kk)[None, :], mask=kmask, other=0.0)
                xt = (xt.to(tl.float32) * rstd1 * nw.to(tl.float32)).to(dtype)
            xf = xt.to(tl.float32)
            if NORM == 2:
                nw = tl.load(nw_ptr + same + (k0 + kk)[None, :], mask=kmask, other=0.0)
                sq_n += xf * xf if DEFER else tl.sum(xf * xf, axis=1)
                xf = xf * nw.to(tl.float32)
            prod = wa.to(tl.float32) * xf
            acc_a += prod if DEFER else tl.sum(prod, axis=1)
            if MODE != 0:
                prod = wb.to(tl.float32) * xf
                acc_b += prod if DEFER else tl.sum(prod, axis=1)
            wa = wa_next
            if MODE != 0:
                wb = wb_next

    if USE_PDL and MODE == 2:
        # The QKV stage's successor is decode attention, a small grid that ran slower when
        # launched while this kernel's programs fill the SMs (graphtune.ops._pdl).
        tl.extra.cuda.gdc_launch_dependents()

    # Epilogue on [BLOCK_N, BLOCK_M] tiles (column, row): float32 sums, one rounding per tensor
    # the unfused ops materialise.
    if DOT:
        t_a = acc_a
        t_b = acc_b
    else:
        t_a = (tl.sum(acc_a, axis=1) if DEFER else acc_a)[:, None]
        t_b = (tl.sum(acc_b, axis=1) if DEFER else acc_b)[:, None]
    if SPLIT > 1:
        # Split-K without a second kernel: every split stores its float32 partial tile (two for
        # paired tiles), and the split that counts last in the tile's counter sums them in split
        # order and runs the epilogue (graphtune/_split_k_jit.py).
        tile = pid_m * tl.num_programs(0) + pid
        cells = BLOCK_N * BLOCK_M
        cell = lanes[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        first = ws_ptr + (tile * SPLIT).to(tl.int64) * cells
        tl.store(first + pid_s * cells + cell, t_a)
        if MODE != 0:
            tl.store(first + WS_PAIR + pid_s * cells + cell, t_b)
        is_last = last_to_arrive(count_ptr + tile, SPLIT)
        t_a = sum_partials(first, cell, is_last, SPLIT, cells)
        if MODE != 0:
            t_b = sum_partials(first + WS_PAIR, cell, is_last, SPLIT, cells)
        row_ok = rows < tl.where(is_last, M, 0)  # only the last split stores results
    if NORM == 2:
        # rms_norm(x) @ w.T == rsqrt(mean(x^2) + eps) * ((x * norm_weight) @ w.T)
        if DOT:
            rstd_t = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)[None, :]
        else:
            rstd_t = tl.rsqrt((tl.sum(sq_n, axis=1) if DEFER else sq_n) / K + eps)[:, None]
        t_a = t_a * rstd_t
        t_b = t_b * rstd_t
    if HAS_BIAS:
        t_a += bias_a.to(tl.float32)[:, None]
        if MODE != 0:
            t_b += bias_b.to(tl.float32)[:, None]
    out_ty = out_ptr.dtype.element_ty
    if MODE == 0:
        mask = col_ok[:, None] & row_ok[None, :]
        if HAS_RES:
            t_a += res.to(tl.float32)
        tl.store(out_ptr + rows64[None, :] * stride_om + col[:, None], t_a.to(out_ty), mask=mask)
    elif MODE == 1:
        mask = col_ok[:, None] & row_ok[None, :]
        gate = t_a.to(dtype).to(tl.float32)
        up = t_b.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(
            out_ptr + rows64[None, :] * stride_om + col[:, None], (act * up).to(out_ty), mask=mask
        )
    else:
        x1f = t_a.to(dtype).to(tl.float32)
        x2f = t_b.to(dtype).to(tl.float32)
        # The head kind is one scalar per program; it becomes a per-column bound (HALF, or 0)
        # because the interpreter rejects a block mask and-ed with a scalar one.
        if HEAD_NORM:
            # The tile is the whole head (columns past HALF are clamped copies, left out of the
            # sum): float32 statistics of the rounded projection, then the roundings of
            # graphtune.ops.rmsnorm.head_rms_norm_ (normalised, then times the weight).
            sq = tl.where(col_ok[:, None], x1f * x1f + x2f * x2f, 0.0)
            inv = tl.rsqrt(tl.sum(sq, axis=0) / (2 * HALF) + eps)[None, :]
            n1, n2 = head_rms_norm_halves(
                x1f, x2f, inv, w1.to(tl.float32), w2.to(tl.float32), dtype
            )
            normed = (col < tl.where(is_v, 0, HALF))[:, None]
            x1f = tl.where(normed, n1, x1f)
            x2f = tl.where(normed, n2, x2f)
        at_cos = cos_ptr + pos.to(tl.int64)[None, :] * stride_cos + jc
        at_sin = sin_ptr + pos.to(tl.int64)[None, :] * stride_sin + jc
        c1 = tl.load(at_cos).to(tl.float32)
        c2 = tl.load(at_cos + HALF).to(tl.float32)
        s1 = tl.load(at_sin).to(tl.float32)
        s2 = tl.load(at_sin + HALF).to(tl.float32)
        o1, o2 = rotate_halves(x1f, x2f, c1, c2, s1, s2, SIGNED_SIN, dtype)
        q_mask = (col < tl.where(is_q, HALF, 0))[:, None] & row_ok[None, :]
        q_dst = out_ptr + rows64[None, :] * stride_om + head * (2 * HALF) + col[:, None]
        tl.store(q_dst, o1, mask=q_mask)
        tl.store(q_dst + HALF, o2, mask=q_mask)
        k_mask = (col < tl.where(is_k, HALF, 0))[:, None] & row_ok[None, :]
        k_dst = k_ptr + cache_row.to(tl.int64)[None, :] * stride_kc + col[:, None]
        tl.store(k_dst, o1, mask=k_mask)
        tl.store(k_dst + HALF, o2, mask=k_mask)
        v_mask = (col < tl.where(is_v, HALF, 0))[:, None] & row_ok[None, :]
        v_dst = v_ptr + cache_row.to(tl.int64)[None, :] * stride_vc + col[:, None]
        tl.store(v_dst, x1f.to(dtype), mask=v_mask)
        tl.store(v_dst + HALF, x2f.to(dtype), mask=v_mask)
