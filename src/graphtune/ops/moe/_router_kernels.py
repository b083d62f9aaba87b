"""Triton kernels of a mixture-of-experts router. Imported only through
``graphtune.ops.moe._loader``.

* :func:`moe_route_top_k_kernel` (``graphtune.ops.moe.routing``): one program per token routes
  its ``E`` logits, written by the router GEMM before it.
* :func:`moe_router_kernel` (``graphtune.ops.moe.router``): the router GEMM and the routing in
  one launch. At decode sizes the router product ``[T, K] @ [E, K].T`` is a small stream of
  weights (``E * K``, 0.5 MiB for 128 experts of width 2048) that needs many programs to be read
  at bandwidth, and the routing needs every logit of a token in one program. So programs
  ``(token, split)`` each stream one slice of ``K`` for all experts, store their float32 partial
  logits, and the one that counts last in the token's arrival counter sums the partials in split
  order (``graphtune/_split_k_jit.py``: deterministic) and routes the token. That removes the
  routing kernel and its kernel boundary from each MoE layer of a decode step.

Both route with :func:`_route_token`: the softmax's exponentials in float32, ``k`` rounds of one
max over int64 keys that hold the value's float32 bits (a non-negative float orders like its bit
pattern) above ``BLOCK_E - 1 - lane``, so the largest key is the largest value and, among equal
values, the lowest expert id: one reduction per round instead of a max and an arg-max; then the
weights over their sum (renormalised) or over the sum of all (the probabilities). The token's
logits are read as a ``[ROWS, BLOCK_E]`` tile of ``ROWS`` copies, one per warp (the kernels pass
their warp count), which Triton lays out a row per warp, so each warp reduces its own copy: a
round then exchanges nothing between warps (no shared memory, no barrier), where one vector of
logits spread over the warps needs both each round. The fused kernel rounds its logits to the
activations' dtype first, as the router GEMM's output is, and stores them for that read.

PDL (``graphtune.ops._pdl``): no kernel of the step writes the router's weight, so
:func:`moe_router_kernel` loads its first chunk before ``gdc_wait()``; the activations after it.
The routing kernel reads only the logits, after its wait. Each lets its successor launch right
after its wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphtune._split_k_jit import last_to_arrive, sum_partials


@triton.jit
def _route_token(
    row_ptr,
    E,
    out_at,
    weights_ptr,
    ids_ptr,
    live,
    TOP_K: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ROWS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Routes the token whose ``E`` logits (any float dtype) are at ``row_ptr``:
    ``weights[out_at + j]`` and ``ids[out_at + j]`` for the ``TOP_K`` largest probabilities,
    largest first, stored for slots below ``live`` (``TOP_K``, or 0 to store nothing). The
    logits are read as ``[ROWS, BLOCK_E]``, the same row ``ROWS`` times (see the module
    docstring); only row 0 stores."""
    lanes = tl.arange(0, BLOCK_E)[None, :]
    copies = tl.arange(0, ROWS)[:, None]
    valid = (lanes < E) & (copies >= 0)
    logits = tl.load(row_ptr + lanes + copies * 0, mask=valid, other=float("-inf"))
    logits = logits.to(tl.float32)
    exps = tl.where(valid, tl.exp(logits - tl.max(logits, axis=1)[:, None]), 0.0)
    bits = exps.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(valid, (bits << 32) | (BLOCK_E - 1 - lanes).to(tl.int64), -1)
    slots = tl.arange(0, BLOCK_TOP)[None, :]
    top = tl.zeros([ROWS, BLOCK_TOP], dtype=tl.float32)
    top_ids = tl.zeros([ROWS, BLOCK_TOP], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, axis=1)[:, None]
        at = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        value = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        top = tl.where(slots == j, value, top)
        top_ids = tl.where(slots == j, at, top_ids)
        keys = tl.where(lanes == at, -1, keys)  # below every valid key (which is >= 0)
    if RENORMALIZE:
        top = top / tl.sum(tl.where(slots < TOP_K, top, 0.0), axis=1)[:, None]
    else:
        top = top / tl.sum(exps, axis=1)[:, None]
    keep = (slots < live) & (copies == 0)
    out = out_at + slots + copies * 0
    tl.store(weights_ptr + out, top.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + out, top_ids.to(tl.int64), mask=keep)


@triton.jit
def moe_route_top_k_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    E,
    stride_t,
    TOP_K: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ROWS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One token's routing from its ``E`` logits (program ``t``: row ``t``), as
    :func:`_route_token`: ``weights [T, TOP_K]`` (the output's dtype) and ``ids [T, TOP_K]``
    (int64), largest first."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0)
    _route_token(
        logits_ptr + token * stride_t,
        E,
        token * TOP_K,
        weights_ptr,
        ids_ptr,
        TOP_K,
        TOP_K,
        BLOCK_TOP,
        BLOCK_E,
        ROWS,
        RENORMALIZE,
    )


@triton.jit
def moe_router_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    cnt_ptr,
    weights_ptr,
    ids_ptr,
    E,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_we,
    TOP_K: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr,
    EVEN_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``route(round(x[t] @ w.T))`` for token ``t``: program ``(t, s)`` multiplies columns
    ``[s * K_PER_SPLIT, ...)`` of ``x [T, K]`` and ``w [E, K]`` (unit last strides) on the
    CUDA cores, ``[BLOCK_E, BLOCK_K]`` weights at a time, the next chunk loaded one iteration
    ahead. ``EVEN_K``: the splits tile ``K`` exactly in whole chunks (no masks). With
    ``SPLITS > 1`` the partial logits meet in ``ws [T, SPLITS + 1, BLOCK_E]`` (float32; the last
    row of a token holds its routed logits) and the token's counter ``cnt[t]`` (zero between
    launches); the last program routes. Experts past
    ``E`` are clamped to ``E - 1`` for loading and are never routed to."""
    token = tl.program_id(0)
    split = tl.program_id(1)
    lanes = tl.arange(0, BLOCK_E)
    valid = lanes < E
    rows = tl.minimum(lanes, E - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    k_first = split.to(tl.int64) * K_PER_SPLIT
    w_ptrs = w_ptr + rows[:, None] * stride_we + (k_first + offs_k)[None, :]
    # The activation chunk as a [BLOCK_E, BLOCK_K] tile whose rows repeat the same columns: it
    # gets the weight tile's register layout (see graphtune.ops.gemm._gemv_kernels).
    x_ptrs = (
        x_ptr + token.to(tl.int64) * stride_xm + (k_first + offs_k)[None, :] + rows[:, None] * 0
    )
    k_end = tl.minimum(K - k_first, K_PER_SPLIT)  # this split's columns
    if EVEN_K:
        w_next = tl.load(w_ptrs)
    else:
        w_next = tl.load(w_ptrs, mask=(offs_k < k_end)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        w = w_next.to(tl.float32)
        w_ptrs += BLOCK_K
        w_next = tl.load(w_ptrs, mask=(k + BLOCK_K + offs_k < k_end)[None, :], other=0.0)
        if EVEN_K:
            a = tl.load(x_ptrs + k)
        else:
            a = tl.load(x_ptrs + k, mask=(k + offs_k < k_end)[None, :], other=0.0)
        acc += tl.sum(w * a.to(tl.float32), axis=1)
    first = ws_ptr + (token * (SPLITS + 1)).to(tl.int64) * BLOCK_E
    scratch = first + SPLITS * BLOCK_E  # the token's logits, for _route_token to read
    if SPLITS > 1:
        tl.store(first + split * BLOCK_E + lanes, acc)
        is_last = last_to_arrive(cnt_ptr + token, SPLITS)
        acc = sum_partials(first, lanes, is_last, SPLITS, BLOCK_E)
        live = tl.where(is_last, TOP_K, 0)  # only the last program stores
        lanes_stored = tl.where(is_last, BLOCK_E, 0)
    else:
        live = TOP_K
        lanes_stored = BLOCK_E
    # Rounded as the router GEMM's output is, then routed in float32.
    logits = tl.where(valid, acc.to(x_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
    tl.store(scratch + lanes, logits, mask=lanes < lanes_stored)
    tl.debug_barrier()  # every thread's logits stored before any warp reads them
    _route_token(
        scratch,
        E,
        token * TOP_K,
        weights_ptr,
        ids_ptr,
        live,
        TOP_K,
        BLOCK_TOP,
        BLOCK_E,
        ROWS,
        RENORMALIZE,
    )
