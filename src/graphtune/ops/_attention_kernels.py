"""Triton kernels of decode attention (``graphtune.ops.attention``). Imported only through
``graphtune.ops.attention.attention_kernels()`` (needs Triton).

:func:`decode_attention_kernel` is flash-decoding over the visible keys of a static KV cache.
With several splits per (request, KV head) its float32 partials are merged either by the second
kernel, :func:`decode_attention_combine_kernel`, or (``INLINE_COMBINE``) by whichever split
program of the row finishes last: each program stores its partial, then takes a ticket from a
per-row arrival counter; the program holding the last ticket resets the counter to 0 for the
next call, reads every partial in split order (so the result does not depend on which program
came last: deterministic) and writes the output (``graphtune/_split_k_jit.py``). That removes
the combine kernel and its kernel boundary while keeping the split's parallelism. The counters
live in a persistent zeroed buffer (``graphtune.ops._counters``), so nothing is zero-filled per
call and the launch is capturable.

PDL (``graphtune.ops._pdl``): :func:`decode_attention_kernel` scans the mask before
``gdc_wait()``, and when each split's slice is a single tile (``ONE_TILE``: short contexts
split many ways, the small-batch case) it loads that tile before the wait too, so those loads
overlap the kernel before it (the QKV stage or the RoPE kernel that writes q and the step's new
K/V rows). Everything else it reads was written by kernels that have completed when it starts
(the kernel before it has passed its own wait), except the new K/V row of each request, which
that kernel may still be writing. The new row is the last key the mask leaves visible (a
request's own token is the newest key it sees), so after the wait the program whose tile holds
that key reads it again and puts it into the tile; q is read after the wait, and so are all
tiles of a slice of several (their pipelined loop). Only stable ``tl.`` APIs;
``griddepcontrol`` only under ``USE_PDL``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphtune._split_k_jit import last_to_arrive


@triton.jit
def decode_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
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
    INLINE_COMBINE: tl.constexpr,
    ONE_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
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

    ``ONE_TILE``: no split's slice is longer than one tile (the launcher knows it from ``S``,
    ``SPLITS`` and ``BLOCK_N``), so the tile is read before the wait and there is no loop.

    With ``SPLITS == 1`` the normalised rows go to ``out`` (contiguous ``[B, KV, G, D]``);
    otherwise float32 partials go to ``ws`` (contiguous ``[B * KV, SPLITS, G, D + 2]``: ``acc``,
    then ``m``, then ``l``) and :func:`decode_attention_combine_kernel` merges them, or with
    ``INLINE_COMBINE`` the last split program of the row does (``cnt [B * KV]`` int32 arrival
    counters, zero between calls; see the module docstring).
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

    # Tile pointers start at `begin` and advance by BLOCK_N keys (fewer registers than
    # recomputing [D, BLOCK_N] 64-bit addresses per tile).
    tile = tl.arange(0, BLOCK_N)
    first = begin.to(tl.int64)
    k_row = k_ptr + b * stride_kb + h * stride_kh
    v_row = v_ptr + b * stride_vb + h * stride_vh
    k_ptrs = k_row + dims[:, None] * stride_kd + (first + tile[None, :]) * stride_ks
    v_ptrs = v_row + dims[None, :] * stride_vd + (first + tile[:, None]) * stride_vs
    m_ptrs = mask_row + (first + tile) * stride_ms
    count = end - begin
    if ONE_TILE:
        # The slice is one tile: read it before the wait (see the module docstring). Only its
        # newest key can be the predecessor's, and that one is read again after the wait.
        first_ok = tile < count
        k_first = tl.load(k_ptrs, mask=first_ok[None, :], other=0.0)
        v_first = tl.load(v_ptrs, mask=first_ok[:, None], other=0.0)
        bias_first = tl.load(m_ptrs, mask=first_ok, other=float("-inf"))
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # q and the new K/V row come from the kernel before
        if SPLITS > 1 and not INLINE_COMBINE:
            tl.extra.cuda.gdc_launch_dependents()  # the successor is the small combine kernel

    q_ptrs = (
        q_ptr
        + b * stride_qb
        + h * stride_qh
        + rows[:, None] * stride_qg
        + dims[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    m_i = tl.zeros((BLOCK_G,), dtype=tl.float32) - 1.0e30
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
    if ONE_TILE:
        newest = hi - 1 - begin  # the newest key's place in the tile
        newest_d = newest + dims * 0  # a vector: the interpreter takes no scalar load mask
        is_new = (newest_d >= 0) & (newest_d < tl.minimum(count, BLOCK_N))
        newest_at = (hi - 1).to(tl.int64)
        k_new = tl.load(k_row + newest_at * stride_ks + dims * stride_kd, mask=is_new, other=0.0)
        v_new = tl.load(v_row + newest_at * stride_vs + dims * stride_vd, mask=is_new, other=0.0)
        k_first = tl.where((tile == newest)[None, :], k_new[:, None], k_first)
        v_first = tl.where((tile == newest)[:, None], v_new[None, :], v_first)
        m_i, l_i, acc = _attend_tile(q, k_first, v_first, bias_first, m_i, l_i, acc, qk_scale, IEEE)
    else:
        # Counting from 0 to the slice length (not from `begin` to `end`) lets Triton's
        # software pipeliner (num_stages) prefetch the masked K/V tiles; it leaves the other
        # form unpipelined. Only a one-tile slice reads early: a first tile read before the
        # wait, then this loop from the second, leaves the pipeliner's first loads waiting
        # for that tile's products.
        for n in range(0, count, BLOCK_N):
            key_ok = n + tile < count
            k = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0)
            bias = tl.load(m_ptrs, mask=key_ok, other=float("-inf"))
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
            m_i, l_i, acc = _attend_tile(q, k, v, bias, m_i, l_i, acc, qk_scale, IEEE)
            k_ptrs += BLOCK_N * stride_ks
            v_ptrs += BLOCK_N * stride_vs
            m_ptrs += BLOCK_N * stride_ms

    if USE_PDL and (SPLITS == 1 or INLINE_COMBINE):
        # The successor is the output projection, a GEMM whose programs, launched while these
        # fill the SMs, land on the few SMs with room left (graphtune.ops._pdl).
        tl.extra.cuda.gdc_launch_dependents()
    out_ptrs = out_ptr + ((bh * G + rows) * HEAD_DIM)[:, None] + dims[None, :]
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        ws_rows = ws_ptr + ((bh * SPLITS + split) * G + rows) * (HEAD_DIM + 2)
        tl.store(ws_rows[:, None] + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(ws_rows + HEAD_DIM, m_i, mask=row_ok)
        tl.store(ws_rows + HEAD_DIM + 1, l_i, mask=row_ok)
        if INLINE_COMBINE:
            # The one-kernel split exchange (graphtune/_split_k_jit.py), with a softmax merge.
            if last_to_arrive(cnt_ptr + bh, SPLITS):
                # A helper of its own: the branch then rebinds no name of this kernel (Triton's
                # code generator requires a name bound before a runtime `if` to keep its type).
                _merge_partials(
                    ws_ptr, out_ptrs, bh, rows, dims, row_ok, G, SPLITS, BLOCK_G, HEAD_DIM
                )


@triton.jit
def _attend_tile(q, k, v, bias, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    """One ``BLOCK_N``-key tile of the online softmax: the updated ``(m, l, acc)``."""
    if IEEE:
        qk = tl.dot(q, k, input_precision="ieee")
    else:
        qk = tl.dot(q, k)
    s = qk * qk_scale + bias.to(tl.float32)[None, :] * 1.4426950408889634
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _merge_partials(
    ws_ptr,
    out_ptrs,
    bh,
    rows,
    dims,
    row_ok,
    G,
    SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """The inline merge of one row's ``SPLITS`` float32 partials, in split order, into ``out``.

    Partials are read from L2 (``.cg``): other SMs wrote them, and this SM's L1 may hold lines of
    the same workspace from an earlier call.
    """
    row_base = ws_ptr + (bh * SPLITS * G + rows) * (HEAD_DIM + 2)
    m_max = tl.zeros((BLOCK_G,), dtype=tl.float32) - 1.0e30
    for s in range(0, SPLITS):
        part = row_base + s * G * (HEAD_DIM + 2)
        m_s = tl.load(part + HEAD_DIM, mask=row_ok, other=-1.0e30, cache_modifier=".cg")
        m_max = tl.maximum(m_max, m_s)
    total = tl.zeros((BLOCK_G,), dtype=tl.float32)
    merged = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
    for s in range(0, SPLITS):
        part = row_base + s * G * (HEAD_DIM + 2)
        m_s = tl.load(part + HEAD_DIM, mask=row_ok, other=-1.0e30, cache_modifier=".cg")
        l_s = tl.load(part + HEAD_DIM + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
        a_s = tl.load(
            part[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0, cache_modifier=".cg"
        )
        w = tl.exp2(m_s - m_max)
        total += l_s * w
        merged += a_s * w[:, None]
    out = merged / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def decode_attention_combine_kernel(
    ws_ptr,
    out_ptr,
    G,
    SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Merges the ``SPLITS`` partials of one query row (program ``(b * KV + h) * G + g``).

    Log-sum-exp merge in base 2: ``w_s = exp2(m_s - max m)``, ``out = sum w_s acc_s /
    sum w_s l_s``, written to contiguous ``out [B, KV, G, D]`` in its dtype. Splits without a
    visible key hold ``m = -1e30, l = 0, acc = 0`` and weigh nothing; a row without any writes 0.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the partials come from the attention kernel before
        tl.extra.cuda.gdc_launch_dependents()
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
