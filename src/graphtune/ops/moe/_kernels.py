"""Triton kernels of the fused-MoE op. Imported only through ``graphtune.ops.moe._loader``.

A *pair* is one (token, slot) of the routing, numbered ``p = token * k + slot`` (the order of a
contiguous ``topk_ids [T, k]``). The sort step (:func:`moe_histogram_kernel`,
:func:`moe_align_kernel`) lays the pairs out by expert in a buffer of ``MAX_ROWS`` rows, each
expert's rows padded to a multiple of ``BLOCK_M``, and names the expert of every ``BLOCK_M`` block
(``-1`` past the last expert's rows). The grouped GEMMs then run one program per (block, column
tile): :func:`moe_gate_up_kernel` gathers the block's token rows of ``x`` and writes
``silu(gate) * up`` per sorted row; :func:`moe_down_kernel` multiplies by the expert's down weight
and the routing weight and writes one row per pair; :func:`moe_sum_kernel` adds each token's k
rows. Padding rows hold the pair id ``P`` (one past the last), are never stored and never read
uninitialised memory.

Rounding follows the torch expert loop (``graphtune.ops.moe.reference``): every projection is
rounded to the dtype, then ``silu(gate)``, its product with ``up``, and the weighted down output
(as the kernels of ``graphtune.ops._kernels`` do). The k rows of a token are summed in float32,
in slot order, and rounded once: deterministic, no atomics.

PDL (``graphtune.ops._pdl``): everything these kernels read (ids, sorted rows, the expert each
block's weights come from) is written by the kernel before them, so each one waits first and
then lets its successor launch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_counts(ids_ptr, start, P, E, lanes, CHUNK: tl.constexpr, SUB: tl.constexpr):
    """Pairs per expert among pairs ``[start, start + CHUNK)`` (lanes past ``E`` stay 0)."""
    counts = tl.zeros_like(lanes)
    for s in range(0, CHUNK, SUB):
        offs = start + s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
        hit = ((ids[:, None] == lanes[None, :]) & (lanes[None, :] < E)).to(tl.int32)
        counts += tl.sum(hit, axis=0)
    return counts


@triton.jit(do_not_specialize=["P"])
def moe_histogram_kernel(
    ids_ptr,
    hist_ptr,
    P,
    E,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``hist[c, e]``: pairs of chunk ``c`` (``CHUNK`` pairs) routed to expert ``e``."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_E)
    counts = _chunk_counts(ids_ptr, pid * CHUNK, P, E, lanes, CHUNK, SUB)
    tl.store(hist_ptr + pid * BLOCK_E + lanes, counts)


@triton.jit(do_not_specialize=["P", "NUM_CHUNKS", "MAX_ROWS", "ROWS_PER_PROGRAM"])
def moe_align_kernel(
    ids_ptr,
    hist_ptr,
    sorted_ptr,
    block_expert_ptr,
    P,
    E,
    NUM_CHUNKS,
    MAX_ROWS,
    ROWS_PER_PROGRAM,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    SUB_ROWS: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Places chunk ``pid``'s pairs in expert order and fills its share of the padding.

    Expert ``e`` owns rows ``[start_e, start_e + padded_e)``, ``padded_e = ceil(count_e /
    BLOCK_M) * BLOCK_M``, in expert order; its pairs take the first ``count_e`` rows in pair order
    (a pair's rank is the count of same-expert pairs in earlier chunks, from ``hist``, plus those
    before it in its chunk). Rows ``[pid * ROWS_PER_PROGRAM, ...)`` that no pair takes get ``P``,
    and each block start among them gets its expert (``-1`` past the last expert's rows). The two
    sets of rows are disjoint, so no program reads what another writes. With ``ONE_CHUNK`` (one
    program) the counts are computed here and ``hist`` is not read.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_E)
    if ONE_CHUNK:
        totals = _chunk_counts(ids_ptr, 0, P, E, lanes, CHUNK, SUB)
        before = tl.zeros_like(lanes)
    else:
        totals = tl.zeros_like(lanes)
        before = tl.zeros_like(lanes)
        for c in range(0, NUM_CHUNKS):
            row = tl.load(hist_ptr + c * BLOCK_E + lanes)
            totals += row
            before += tl.where(c < pid, row, 0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    running = starts + before
    for s in range(0, CHUNK, SUB):
        offs = pid * CHUNK + s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
        hit = ((ids[:, None] == lanes[None, :]) & (lanes[None, :] < E)).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit + running[None, :]
        dest = tl.sum(hit * rank, axis=1)
        tl.store(sorted_ptr + dest, offs, mask=tl.sum(hit, axis=1) > 0)
        running += tl.sum(hit, axis=0)
    first = pid * ROWS_PER_PROGRAM
    for r in range(0, ROWS_PER_PROGRAM, SUB_ROWS):
        rows = first + r + tl.arange(0, SUB_ROWS)
        inside = (rows < MAX_ROWS) & (r + tl.arange(0, SUB_ROWS) < ROWS_PER_PROGRAM)
        expert = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        mine = lanes[None, :] == expert[:, None]
        e_start = tl.sum(tl.where(mine, starts[None, :], 0), axis=1)
        e_count = tl.sum(tl.where(mine, totals[None, :], 0), axis=1)
        pad = (expert >= E) | (rows - e_start >= e_count)
        sentinel = tl.zeros_like(rows) + P
        tl.store(sorted_ptr + rows, sentinel, mask=inside & pad)
        block_start = inside & (rows % BLOCK_M == 0)
        tl.store(block_expert_ptr + rows // BLOCK_M, tl.where(expert < E, expert, -1), block_start)


@triton.jit
def _tile_of(pid, num_blocks_m, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(block, column tile) of program ``pid``: ``GROUP_M`` consecutive blocks (mostly one
    expert's) walk each column tile together, so the expert's weight tile is read once from DRAM
    for all of them."""
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["P", "NUM_BLOCKS_M"])
def moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    sorted_ptr,
    block_expert_ptr,
    P,
    TOP_K,
    N,
    K,
    NUM_BLOCKS_M,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_am,
    stride_an,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``act[row, n] = silu(x[tok] . gate[e, n]) * (x[tok] . up[e, n])`` for the rows of one block.

    ``w [E, 2N, K]`` holds the gate rows ``[0, N)`` then the up rows ``[N, 2N)``; ``tok`` is the
    row's pair id divided by ``TOP_K``. Padding rows gather token 0 (unmasked loads) and are not
    stored; blocks whose expert is ``-1`` exit at once.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_m, pid_n = _tile_of(tl.program_id(0), NUM_BLOCKS_M, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    valid = pairs < P
    tokens = tl.where(valid, pairs // TOP_K, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (offs_n % N).to(tl.int64)  # wrapped, not masked: unmasked loads, masked store
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk
    g_ptrs = w_base + cols[None, :] * stride_wn
    u_ptrs = w_base + (cols + N)[None, :] * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_mask = (k + offs_k) < K
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_mask[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_mask[:, None], other=0.0)
        if IEEE:
            acc_g += tl.dot(a, g, input_precision="ieee")
            acc_u += tl.dot(a, u, input_precision="ieee")
        else:
            acc_g += tl.dot(a, g)
            acc_u += tl.dot(a, u)
        a_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    dtype = act_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    out_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_n[None, :] * stride_an
    tl.store(out_ptrs, act.to(dtype), mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["P", "NUM_BLOCKS_M"])
def moe_down_kernel(
    act_ptr,
    w_ptr,
    route_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    P,
    N,
    K,
    NUM_BLOCKS_M,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out[pair, n] = route[pair] * (act[row] . down[e, n])`` for the rows of one block.

    ``w [E, N, K]``; ``route`` is the flat ``[P]`` routing weights. The product is rounded to the
    dtype before the routing weight is applied in float32 (torch's ``linear`` then ``mul``).
    Padding rows, whose ``act`` row was never written, load zeros and are not stored.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_m, pid_n = _tile_of(tl.program_id(0), NUM_BLOCKS_M, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    valid = pairs < P
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = (
        w_ptr
        + expert.to(tl.int64) * stride_we
        + cols[None, :] * stride_wn
        + offs_k[:, None] * stride_wk
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_mask = (k + offs_k) < K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    dtype = out_ptr.dtype.element_ty
    route = tl.load(route_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    y = acc.to(dtype).to(tl.float32) * route[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, y.to(dtype), mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit
def moe_sum_kernel(
    pair_ptr,
    ids_ptr,
    out_ptr,
    N,
    E,
    TOP_K,
    stride_p,
    stride_o,
    BLOCK: tl.constexpr,
    HAS_RES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out[t] = sum_j pair[t * TOP_K + j]`` in float32, slot order, one rounding; with
    ``HAS_RES`` ``out`` is the residual and the rounded sum is added to it (a second rounding,
    as ``residual.add_``; each element is read and written by the same program).

    A slot whose expert id is outside ``[0, E)`` got no row from the sort step (its ``pair`` row
    was never written) and adds nothing.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair)
        # Compared as a vector: the interpreter mistypes a bool vector & a loaded bool scalar.
        per_col = tl.zeros_like(cols) + expert
        routed = (per_col >= 0) & (per_col < E)
        row = tl.load(pair_ptr + pair * stride_p + cols, mask=mask & routed, other=0.0)
        acc += row.to(tl.float32)
    total = acc.to(out_ptr.dtype.element_ty)
    if HAS_RES:
        res = tl.load(out_ptr + token * stride_o + cols, mask=mask, other=0.0)
        total = (total.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_o + cols, total, mask=mask)
