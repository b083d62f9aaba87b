"""Triton kernels of graphtune.ops. Imported only through ``graphtune.ops._triton.kernels()``.

Only stable ``tl.`` APIs are used (Triton 3.0 .. 3.9). Elementwise kernels reproduce the rounding
of the unfused torch code they replace: torch computes a bf16/fp16 elementwise op in float32 and
rounds its result to the tensor dtype, so every intermediate that torch materialises as a tensor
is rounded here too (``.to(dtype).to(tl.float32)``). That makes the fused kernels agree with the
engine's torch math up to reduction order (RMSNorm's mean) and transcendental implementations.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemm_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
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
    stride_os,
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
):
    """``out = a @ w.T (+ bias) (+ res)`` for ``a [M, K]``, ``w [N, K]``; split ``s``.

    The epilogue adds bias and residual in float32 and rounds once (``torch.addmm``'s
    ``beta = 1`` semantics); ``out`` may be ``res`` itself (each element is read, then written,
    by the same program).

    With ``SPLIT_K > 1`` each program accumulates ``K_PER_SPLIT`` columns of K and writes a float32
    partial tile to ``out[s]`` (``[SPLIT_K, M, N]``); :func:`splitk_reduce_kernel` sums them. This
    keeps split-K deterministic (no atomics) and capturable (no zero-fill).
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
    k_start = pid_s * K_PER_SPLIT
    a_ptrs = a_ptr + rows[:, None] * stride_am + (k_start + offs_k)[None, :] * stride_ak
    w_ptrs = w_ptr + cols[None, :] * stride_wn + (k_start + offs_k)[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = (k + offs_k) < K_PER_SPLIT
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        if IEEE:
            # float32 inputs: full precision, as torch's default (TF32 off) matmul.
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = (
        out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    )
    if SPLIT_K == 1:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        if HAS_RES:
            res_ptrs = res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn
            acc += tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, acc, mask=mask)


@triton.jit
def splitk_reduce_kernel(
    part_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    MN,
    N,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out = sum_s part[s] (+ bias) (+ res)``; ``part [SPLIT_K, M, N]`` float32, ``res`` and
    ``out`` contiguous ``[M, N]`` (``out`` may be ``res``)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
):
    """One row: ``s = x (+ res)``; ``out = to_dtype(s * rsqrt(mean(s^2) + eps) * w)``.

    ``s`` is rounded to the input dtype (a residual add in torch produces a bf16 tensor) and written
    to ``res_out`` when there is a residual. Statistics and the weight product in float32 with one
    rounding at the end, as ``F.rms_norm`` (``engine.model.rms_norm``). With ``ONE_PASS`` the row
    fits one block; otherwise the row is walked twice (sum of squares, then normalise), recomputing
    ``s`` instead of re-reading ``res_out``, so no thread reads what another thread of the program
    wrote.
    """
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
):
    """``out[:, j] = silu(x[:, j]) * x[:, INTER + j]`` with torch's two roundings."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


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
    """
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
    if SIGNED_SIN:
        # sin's first half holds -sin (engine.model.apply_rope_signed): x * cos is one rounded
        # tensor, then addcmul adds swap(x) * signed_sin with one more rounding.
        o1 = ((x1 * c1[None, :]).to(dtype).to(tl.float32) + x2 * s1[None, :]).to(dtype)
        o2 = ((x2 * c2[None, :]).to(dtype).to(tl.float32) + x1 * s2[None, :]).to(dtype)
    else:
        o1 = (
            (x1 * c1[None, :]).to(dtype).to(tl.float32)
            + (-x2 * s1[None, :]).to(dtype).to(tl.float32)
        ).to(dtype)
        o2 = (
            (x2 * c2[None, :]).to(dtype).to(tl.float32)
            + (x1 * s2[None, :]).to(dtype).to(tl.float32)
        ).to(dtype)
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


@triton.jit
def decode_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    out_ptr,
    ws_ptr,
    KV,
    G,
    S,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_qg,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_mb,
    stride_ms,
    SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCAN_BLOCK: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Flash-decoding: program ``(b * KV + h, split)`` attends ``G`` query rows of one KV head.

    ``scores = q . k * qk_scale + mask * log2(e)`` in float32 (``qk_scale`` is
    ``log2(e) / sqrt(D)``: the softmax runs in base 2, ``exp2`` being the hardware instruction),
    with an online softmax over ``BLOCK_N``-key tiles (running max ``m``, sum ``l``, ``acc``).
    The ``G`` rows are padded to ``BLOCK_G >= 16`` rows so both products are ``tl.dot`` tiles.

    The mask row is scanned first for its visible keys (bias ``> -inf``): only ``[lo, hi)`` is
    walked, split evenly between the ``SPLITS`` programs of the row. Keys outside it have weight
    exactly 0, so skipping their K/V bytes changes no result, and a decode mask (keys up to the
    position) makes the kernel read only the keys that exist. ``m`` starts at a finite -1e30, so a
    tile or a split with no visible key adds ``l = 0`` and never a NaN; a row with no visible key
    at all writes 0 (as torch's SDPA does).

    With ``SPLITS == 1`` the normalised rows go to ``out`` (contiguous ``[B, KV, G, D]``);
    otherwise float32 partials go to ``ws`` (contiguous ``[B * KV, SPLITS, G, D + 2]``: ``acc``,
    then ``m``, then ``l``) and :func:`decode_attention_combine_kernel` merges them.
    """
    bh = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a long KV cache exceeds 2^31 elements
    split = tl.program_id(1)
    b = bh // KV
    h = bh % KV
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < G
    mask_row = mask_ptr + b * stride_mb

    # Visible span [lo, hi) of this batch row; every program of the row computes the same one.
    hi_vec = tl.zeros((SCAN_BLOCK,), dtype=tl.int32)
    lo_vec = tl.zeros((SCAN_BLOCK,), dtype=tl.int32) + S
    for start in range(0, S, SCAN_BLOCK):
        idx = start + tl.arange(0, SCAN_BLOCK)
        bias = tl.load(mask_row + idx * stride_ms, mask=idx < S, other=float("-inf"))
        visible = bias.to(tl.float32) > float("-inf")
        hi_vec = tl.maximum(hi_vec, tl.where(visible, idx + 1, 0))
        lo_vec = tl.minimum(lo_vec, tl.where(visible, idx, S))
    hi = tl.max(hi_vec, axis=0)
    lo = tl.minimum(tl.min(lo_vec, axis=0), hi)
    per_split = ((hi - lo + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    begin = lo + split * per_split
    end = tl.minimum(begin + per_split, hi)

    q_ptrs = (
        q_ptr
        + b * stride_qb
        + h * stride_qh
        + rows[:, None] * stride_qg
        + dims[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    # Tile pointers start at `begin` and advance by BLOCK_N keys (fewer registers than
    # recomputing [D, BLOCK_N] 64-bit addresses per tile).
    tile = tl.arange(0, BLOCK_N)
    first = begin.to(tl.int64)
    k_ptrs = (
        k_ptr
        + b * stride_kb
        + h * stride_kh
        + dims[:, None] * stride_kd
        + (first + tile[None, :]) * stride_ks
    )
    v_ptrs = (
        v_ptr
        + b * stride_vb
        + h * stride_vh
        + dims[None, :] * stride_vd
        + (first + tile[:, None]) * stride_vs
    )
    m_ptrs = mask_row + (first + tile) * stride_ms
    m_i = tl.zeros((BLOCK_G,), dtype=tl.float32) - 1.0e30
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
    # Counting from 0 to the slice length (not from `begin` to `end`) lets Triton's software
    # pipeliner (num_stages) prefetch the masked K/V tiles; it leaves the other form unpipelined.
    count = end - begin
    for n in range(0, count, BLOCK_N):
        key_ok = n + tile < count
        k = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0)
        bias = tl.load(m_ptrs, mask=key_ok, other=float("-inf"))
        if IEEE:
            qk = tl.dot(q, k, input_precision="ieee")
        else:
            qk = tl.dot(q, k)
        s = qk * qk_scale + bias.to(tl.float32)[None, :] * 1.4426950408889634
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None]
        if IEEE:
            acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
        m_ptrs += BLOCK_N * stride_ms

    if SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        out_ptrs = out_ptr + ((bh * G + rows) * HEAD_DIM)[:, None] + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        ws_rows = ws_ptr + ((bh * SPLITS + split) * G + rows) * (HEAD_DIM + 2)
        tl.store(ws_rows[:, None] + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(ws_rows + HEAD_DIM, m_i, mask=row_ok)
        tl.store(ws_rows + HEAD_DIM + 1, l_i, mask=row_ok)


@triton.jit
def decode_attention_combine_kernel(
    ws_ptr,
    out_ptr,
    G,
    SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Merges the ``SPLITS`` partials of one query row (program ``(b * KV + h) * G + g``).

    Log-sum-exp merge in base 2: ``w_s = exp2(m_s - max m)``, ``out = sum w_s acc_s /
    sum w_s l_s``, written to contiguous ``out [B, KV, G, D]`` in its dtype. Splits without a
    visible key hold ``m = -1e30, l = 0, acc = 0`` and weigh nothing; a row without any writes 0.
    """
    pid = tl.program_id(0).to(tl.int64)
    bh = pid // G
    g = pid % G
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    rows = ws_ptr + ((bh * SPLITS + splits) * G + g) * (HEAD_DIM + 2)
    m = tl.load(rows + HEAD_DIM)
    l_s = tl.load(rows + HEAD_DIM + 1)
    acc = tl.load(rows[:, None] + dims[None, :])
    w = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(l_s * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + pid * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))
