"""Triton kernels of graphtune.ops. Imported only through ``graphtune.ops._triton.kernels()``.

Only stable ``tl.`` APIs are used (Triton 3.0 .. 3.9); ``griddepcontrol`` only under ``USE_PDL``:
every kernel here waits for its predecessor before its first load and lets its successor launch
right after (``graphtune.ops._pdl``). Elementwise kernels reproduce the rounding
of the unfused torch code they replace: torch computes a bf16/fp16 elementwise op in float32 and
rounds its result to the tensor dtype, so every intermediate that torch materialises as a tensor
is rounded here too (``.to(dtype).to(tl.float32)``). That makes the fused kernels agree with the
engine's torch math up to reduction order (RMSNorm's mean) and transcendental implementations.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphtune._rope_jit import head_rms_norm_halves, rotate_halves
from graphtune._split_k_jit import last_to_arrive, sum_partials


@triton.jit(do_not_specialize=["M"])
def gemm_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    ws_ptr,
    count_ptr,
    M,
    N,
    K,
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
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SILU_PAIRS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out = a @ w.T (+ bias) (+ res)`` for ``a [M, K]``, ``w [N, K]``; split ``s``.

    With ``SILU_PAIRS`` (no bias, residual or split) ``w`` is ``[2 * N, K]``, gate rows first, and
    ``out [M, N] = silu(a @ w[:N].T) * (a @ w[N:].T)`` with the roundings of the unfused
    ``silu_and_mul`` (gate and up rounded, then SiLU, then the product): a tile streams gate
    columns ``j`` and up columns ``N + j`` together, so the ``[M, 2 * N]`` intermediate and the
    SiLU kernel are never needed.

    The epilogue adds bias and residual in float32 and rounds once (``torch.addmm``'s
    ``beta = 1`` semantics); ``out`` may be ``res`` itself (each element is read, then written,
    by the same program).

    With ``SPLIT_K > 1`` program ``(tile, s)`` accumulates ``K_PER_SPLIT`` columns of K from
    ``s * K_PER_SPLIT``, stores its float32 partial tile in the workspace ``ws`` (tile-major,
    ``BLOCK_M * BLOCK_N`` cells each) and counts its arrival in ``count[tile]`` (zero at launch,
    ``graphtune.ops._counters``). The split that arrives last sums the partials in split order
    (so the result does not depend on which split finished last), sets the counter back to zero
    and runs the epilogue: one kernel, no reduction launch, no zero-fill (capturable).
    """
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // grid_n
    pid_n = pid % grid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows/columns past the edge are wrapped instead of masked so the loads stay unmasked; the
    # store below is masked, so the duplicated rows are never written.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    # 64-bit K offsets too: a transposed a or weight has stride M or N along K, and K * M of a
    # long prefill passes 2^31. Cast once per tile; the loop only adds BLOCK_K * stride.
    offs_k64 = pid_s.to(tl.int64) * K_PER_SPLIT + offs_k
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k64[None, :] * stride_ak
    w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k64[:, None] * stride_wk
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # a comes from the kernel before (see graphtune.ops._pdl)
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_ptrs = w_ptrs + N * stride_wn  # the up rows of the tile's columns (SILU_PAIRS)
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
            if SILU_PAIRS:
                w_up = tl.load(up_ptrs)
        else:
            k_mask = (k + offs_k) < K_PER_SPLIT
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
            if SILU_PAIRS:
                w_up = tl.load(up_ptrs, mask=k_mask[:, None], other=0.0)
        if IEEE:
            # float32 inputs: full precision, as torch's default (TF32 off) matmul.
            acc += tl.dot(a, w, input_precision="ieee")
            if SILU_PAIRS:
                acc_up += tl.dot(a, w_up, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
            if SILU_PAIRS:
                acc_up += tl.dot(a, w_up)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk
    row_bound = M
    if SPLIT_K > 1:
        # The one-kernel split exchange (graphtune/_split_k_jit.py).
        cells = BLOCK_M * BLOCK_N
        cell = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        first = ws_ptr + (pid * SPLIT_K).to(tl.int64) * cells
        tl.store(first + pid_s * cells + cell, acc)
        is_last = last_to_arrive(count_ptr + pid, SPLIT_K)
        acc = sum_partials(first, cell, is_last, SPLIT_K, cells)
        row_bound = tl.where(is_last, M, 0)  # only the last split stores results
    mask = (offs_m[:, None] < row_bound) & (offs_n[None, :] < N)
    if SILU_PAIRS:
        dtype = out_ptr.dtype.element_ty
        acc = silu_times(acc.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32), dtype)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    # 64-bit row offsets, as the loads': a float16 LM head's [M, 128256] output passes 2^31
    # elements from about 16.7k rows, and an int32 offs_m * stride_om wraps (a store far away).
    rows_out = offs_m.to(tl.int64)[:, None]
    if HAS_RES:
        res_ptrs = res_ptr + rows_out * stride_rm + offs_n[None, :] * stride_rn
        acc += tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + rows_out * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    N,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One row: ``s = x (+ res)``; ``out = to_dtype(s * rsqrt(mean(s^2) + eps) * w)``.

    ``s`` is rounded to the input dtype (a residual add in torch produces a bf16 tensor) and written
    to ``res_out`` when there is a residual. Statistics and the weight product in float32 with one
    rounding at the end, as ``F.rms_norm`` (``engine.model.rms_norm``). With ``ONE_PASS`` the row
    fits one block; otherwise the row is walked twice (sum of squares, then normalise), recomputing
    ``s`` instead of re-reading ``res_out``, so no thread reads what another thread of the program
    wrote.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x and res come from the kernels before
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = res_ptr + row * stride_r
    o_row = out_ptr + row * stride_o
    ro_row = res_out_ptr + row * stride_ro
    dtype = x_ptr.dtype.element_ty
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        s = tl.load(x_row + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_row + cols, mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(ro_row + cols, s, mask=mask)
        sf = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + cols, (sf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            s = tl.load(x_row + cols, mask=mask, other=0.0)
            if HAS_RES:
                r = tl.load(r_row + cols, mask=mask, other=0.0)
                s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
                tl.store(ro_row + cols, s, mask=mask)
            sf = s.to(tl.float32)
            sq += sf * sf
        rstd = tl.rsqrt(tl.sum(sq, axis=0) / N + eps)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            s = tl.load(x_row + cols, mask=mask, other=0.0)
            if HAS_RES:
                r = tl.load(r_row + cols, mask=mask, other=0.0)
                s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = s.to(tl.float32) * rstd * w
            tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    INTER,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out[:, j] = silu(x[:, j]) * x[:, INTER + j]`` with torch's two roundings."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from the GEMM before
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    out = silu_times(gate, up, dtype)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_times(gate, up, DTYPE: tl.constexpr):
    """``silu(gate) * up`` in float32, with the SiLU output rounded to ``DTYPE`` as torch's
    ``F.silu`` tensor is (``gate`` and ``up`` come rounded already)."""
    act = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    return act * up


@triton.jit
def rope_kv_kernel(
    qkv_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    rows_ptr,
    q_out_ptr,
    k_ptr,
    v_ptr,
    norm_ptr,
    eps,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_k,
    stride_v,
    NUM_HEADS: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,
    SIGNED_SIN: tl.constexpr,
    HAS_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Rotary embedding of q and k for one token, and the K/V cache write, in one pass.

    Program ``(b, g)`` handles heads ``[g * HEADS_PER_PROG, ...)`` of token ``b`` among the
    ``NUM_HEADS`` query heads followed by the ``NUM_KV`` key heads (the order of the fused qkv
    row, so the source offset is ``head * HEAD_DIM`` for both). Query heads go to
    ``q_out [B, NUM_HEADS, HEAD_DIM]``; key heads, and the matching value heads copied as they
    are, go to cache row ``rows[b * NUM_KV + kv_head]``. cos/sin rows are gathered by
    ``pos[b]``; ``HALF == HEAD_DIM // 2``. Rotate-half: ``out = x * cos + cat(-x2, x1) * sin``,
    each product rounded to the dtype as torch does (``engine.model.apply_rope``); with
    ``SIGNED_SIN`` the table's first half is ``-sin`` and rounding follows ``apply_rope_signed``.

    ``HAS_NORM``: each q and k head is first RMS-normalised over its ``HEAD_DIM`` features
    (float32 statistics with ``eps``, rounded to the dtype) and multiplied by its row of
    ``norm [NUM_HEADS + NUM_KV, HEAD_DIM]`` (rounded again): Qwen3's q/k norm, rounded as
    ``graphtune.ops.rmsnorm.head_rms_norm_``.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # qkv and the positions come from the kernels before
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_PER_PROG + tl.arange(0, HEADS_PER_PROG)
    cols = tl.arange(0, HALF_BLOCK)
    col_ok = cols < HALF
    pos = tl.load(pos_ptr + b).to(tl.int64)
    c1 = tl.load(cos_ptr + pos * stride_cos + cols, mask=col_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_sin + cols, mask=col_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_sin + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    head_ok = heads < NUM_HEADS + NUM_KV
    mask = head_ok[:, None] & col_ok[None, :]
    src = qkv_ptr + b * stride_qkv + heads[:, None] * HEAD_DIM + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
        inv = tl.rsqrt(mean_sq + eps)[:, None]
        w_src = norm_ptr + heads[:, None] * HEAD_DIM + cols[None, :]
        w1 = tl.load(w_src, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_src + HALF, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = head_rms_norm_halves(x1, x2, inv, w1, w2, dtype)
    o1, o2 = rotate_halves(
        x1, x2, c1[None, :], c2[None, :], s1[None, :], s2[None, :], SIGNED_SIN, dtype
    )
    is_q = heads < NUM_HEADS
    q_dst = q_out_ptr + (b * NUM_HEADS + heads)[:, None] * HEAD_DIM + cols[None, :]
    q_mask = mask & is_q[:, None]
    tl.store(q_dst, o1, mask=q_mask)
    tl.store(q_dst + HALF, o2, mask=q_mask)
    is_k = head_ok & (heads >= NUM_HEADS)
    kv_head = tl.where(is_k, heads - NUM_HEADS, 0)
    row = tl.load(rows_ptr + b * NUM_KV + kv_head, mask=is_k, other=0).to(tl.int64)
    k_mask = mask & is_k[:, None]
    k_dst = k_ptr + row[:, None] * stride_k + cols[None, :]
    tl.store(k_dst, o1, mask=k_mask)
    tl.store(k_dst + HALF, o2, mask=k_mask)
    v_src = qkv_ptr + b * stride_qkv + (NUM_HEADS + NUM_KV + kv_head)[:, None] * HEAD_DIM
    v1 = tl.load(v_src + cols[None, :], mask=k_mask, other=0.0)
    v2 = tl.load(v_src + HALF + cols[None, :], mask=k_mask, other=0.0)
    v_dst = v_ptr + row[:, None] * stride_v + cols[None, :]
    tl.store(v_dst, v1, mask=k_mask)
    tl.store(v_dst + HALF, v2, mask=k_mask)
