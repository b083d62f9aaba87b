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

Both route with :func:`_route_token`: the softmax's exponentials in float32 and each expert's
rank (how many logits are larger, or equal with a lower expert id: ties go to the lowest id),
which is its slot when below ``k``; then the weights over their sum (renormalised) or over the
sum of all (the probabilities). Ranking costs no reduction across warps per slot, where
selecting the largest value ``k`` times costs ``k`` of them. The fused kernel rounds its logits
to the activations' dtype first, as the router GEMM's output is.

PDL (``graphtune.ops._pdl``): the router's weight is read by no kernel of the step as an output,
so :func:`moe_router_kernel` loads its first chunk before ``gdc_wait()``; the activations after
it. The routing kernel reads only the logits, after its wait. Each lets its successor launch
right after its wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphtune._split_k_jit import last_to_arrive, sum_partials


@triton.jit
def _route_token(
    logits,
    row_ptr,
    lanes,
    valid,
    E,
    out_at,
    weights_ptr,
    ids_ptr,
    live,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Routes one token's float32 ``logits [BLOCK_E]`` (``-inf`` at lanes past ``E``, which are
    not ``valid``), whose ``E`` values are also at ``row_ptr`` (any float dtype, bitwise the
    same once converted): ``weights[out_at + j]`` and ``ids[out_at + j]`` for the ``TOP_K``
    largest, largest first, stored for slots below ``live`` (``TOP_K``, or 0 to store nothing).

    Each expert's slot is its rank: how many experts have a larger logit, or an equal one and a
    lower id, counted against ``CHUNK`` logits at a time read back from ``row_ptr``. So the
    whole top-k costs two reductions across the program's warps (the max and the sum), where
    selecting the largest k times costs k."""
    exps = tl.where(valid, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    rank = tl.zeros([BLOCK_E], dtype=tl.int32)
    for first in tl.static_range(0, BLOCK_E, CHUNK):
        others = first + tl.arange(0, CHUNK)
        theirs = tl.load(row_ptr + others, mask=others < E, other=float("-inf")).to(tl.float32)
        larger = theirs[None, :] > logits[:, None]
        tied_lower = (theirs[None, :] == logits[:, None]) & (others[None, :] < lanes[:, None])
        rank += tl.sum((larger | tied_lower).to(tl.int32), axis=1)
    chosen = valid & (rank < TOP_K)
    if RENORMALIZE:
        total = tl.sum(tl.where(chosen, exps, 0.0), axis=0)
    else:
        total = tl.sum(exps, axis=0)
    keep = chosen & (rank < live)
    # A program that stores nothing (live 0) may rank stale logits: no division by zero there.
    weight = (exps / tl.where(total > 0.0, total, 1.0)).to(weights_ptr.dtype.element_ty)
    tl.store(weights_ptr + out_at + rank, weight, mask=keep)
    tl.store(ids_ptr + out_at + rank, lanes.to(tl.int64), mask=keep)


@triton.jit
def moe_route_top_k_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    E,
    stride_t,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
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
    lanes = tl.arange(0, BLOCK_E)
    valid = lanes < E
    logits = tl.load(logits_ptr + token * stride_t + lanes, mask=valid, other=float("-inf"))
    _route_token(
        logits.to(tl.float32),
        logits_ptr + token * stride_t,
        lanes,
        valid,
        E,
        token * TOP_K,
        weights_ptr,
        ids_ptr,
        TOP_K,
        TOP_K,
        BLOCK_E,
        CHUNK,
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
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
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
    scratch = first + SPLITS * BLOCK_E  # the token's routed logits, for the ranks to read back
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
    tl.debug_barrier()  # every thread's logits stored before any thread reads them back
    _route_token(
        logits,
        scratch,
        lanes,
        valid,
        E,
        token * TOP_K,
        weights_ptr,
        ids_ptr,
        live,
        TOP_K,
        BLOCK_E,
        CHUNK,
        RENORMALIZE,
    )
