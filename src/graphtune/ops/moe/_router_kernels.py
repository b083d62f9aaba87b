"""Triton kernels of a mixture-of-experts router. Imported only through
``graphtune.ops.moe._loader.moe_router_kernels()``.

* :func:`moe_route_top_k_kernel` (``graphtune.ops.moe.routing``): one program per token turns its
  router logits into the top-k experts and their weights.
* :func:`moe_router_kernel` (``graphtune.ops.moe.router``): the router GEMV and the routing in
  one launch. Program ``(block, token)`` computes ``ROWS`` logits of one token (a dot product
  over the hidden size per expert, CUDA cores, float32), rounds them to the activations' dtype
  (as the router GEMM's output is) and stores them to a float32 workspace ``[T, E]``; then it
  takes a ticket from the token's arrival counter, and the program holding the last ticket reads
  the token's ``E`` logits back and routes them, then sets the counter back to 0 for the next
  call (the counters: ``graphtune.ops._counters``). One kernel instead of the GEMV, its split-K
  reduction and the routing kernel: two kernel boundaries fewer per MoE layer.

Both route through :func:`_route_token`: the ``K`` largest of the softmax over the ``E`` logits
in float32 (ties to the lowest expert id), optionally renormalised, weights stored in the output's
dtype and ids as int64, largest first. So both give the same experts for the same logits.

PDL (``graphtune.ops._pdl``): the router weights are never written by an earlier kernel, so
:func:`moe_router_kernel` loads its first weight chunk before ``gdc_wait()``; the activations, the
workspace and the counters are touched only after it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _route_token(
    logits,
    valid,
    lanes,
    weights_ptr,
    ids_ptr,
    token,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Routes one token's float32 ``logits [BLOCK_E]`` (``valid``: lanes below ``E``).

    The top k are chosen among ``exp(logit - max)`` (the probabilities times one positive
    number, so in their order). Each round is one max over int64 keys that hold the value's
    float32 bits (a non-negative float orders like its bit pattern) above ``BLOCK_E - 1 - lane``,
    so the largest key is the largest value and, among equal values, the lowest expert id: one
    reduction per round instead of a max and an arg-max. The weights are those values over
    their sum (renormalised) or over the sum of all (the probabilities).
    """
    logits = tl.where(valid, logits, float("-inf"))
    exps = tl.where(valid, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    bits = exps.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(valid, (bits << 32) | (BLOCK_E - 1 - lanes).to(tl.int64), -1)
    slots = tl.arange(0, BLOCK_K)
    top = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(keys, axis=0)
        at = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        value = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        top = tl.where(slots == j, value, top)
        top_ids = tl.where(slots == j, at, top_ids)
        keys = tl.where(lanes == at, -1, keys)  # below every valid key (which is >= 0)
    if RENORMALIZE:
        top = top / tl.sum(tl.where(slots < K, top, 0.0), axis=0)
    else:
        top = top / tl.sum(exps, axis=0)
    out = token * K + slots
    tl.store(weights_ptr + out, top.to(weights_ptr.dtype.element_ty), mask=slots < K)
    tl.store(ids_ptr + out, top_ids.to(tl.int64), mask=slots < K)


@triton.jit
def moe_route_top_k_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    E,
    stride_t,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One token's routing from its ``E`` logits (see the module docstring), written as
    ``weights [T, K]`` (the output's dtype) and ``ids [T, K]`` (int64)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_E)
    valid = lanes < E
    logits = tl.load(logits_ptr + token * stride_t + lanes, mask=valid, other=float("-inf"))
    _route_token(
        logits.to(tl.float32),
        valid,
        lanes,
        weights_ptr,
        ids_ptr,
        token,
        K,
        BLOCK_K,
        BLOCK_E,
        RENORMALIZE,
    )


@triton.jit
def _route_from_workspace(
    ws_row,
    weights_ptr,
    ids_ptr,
    token,
    E,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """The last program of a token: its logits from the workspace, then :func:`_route_token`.

    Read from L2 (``.cg``): other programs on other SMs wrote them, and this SM's L1 may hold
    lines of the same workspace from an earlier call.
    """
    tl.debug_barrier()
    lanes = tl.arange(0, BLOCK_E)
    valid = lanes < E
    logits = tl.load(ws_row + lanes, mask=valid, other=float("-inf"), cache_modifier=".cg")
    _route_token(
        logits, valid, lanes, weights_ptr, ids_ptr, token, K, BLOCK_K, BLOCK_E, RENORMALIZE
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
    H,
    stride_xt,
    stride_we,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Router logits of ``ROWS`` experts for one token, and that token's routing by its last
    program (see the module docstring).

    ``x [T, H]`` and ``w [E, H]`` have unit stride along ``H``; ``ws`` is float32 ``[T, E]``
    (contiguous); ``cnt [T]`` int32 counters, zero between calls. Expert rows past ``E`` are
    clamped to the last one for loading and never stored. Each program sums its products over
    ``[ROWS, BLOCK_H]`` tiles and reduces them once after the loop.
    """
    block = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    rows = block * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    w_ptrs = w_ptr + tl.minimum(rows, E - 1).to(tl.int64)[:, None] * stride_we + cols[None, :]
    # The router weights depend on no earlier kernel: the first chunk is issued before waiting.
    w_next = tl.load(w_ptrs, mask=(cols < H)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # The activation chunk addressed as a [ROWS, BLOCK_H] tile whose rows all point at the same
    # columns, so it has the weight tile's register layout (as in graphtune.ops.gemm's GEMV).
    x_row = x_ptr + token * stride_xt + (rows * 0)[:, None]
    acc = tl.zeros((ROWS, BLOCK_H), dtype=tl.float32)
    for k in range(0, H, BLOCK_H):
        w = w_next.to(tl.float32)
        w_ptrs += BLOCK_H
        w_next = tl.load(w_ptrs, mask=(k + BLOCK_H + cols < H)[None, :], other=0.0)
        x = tl.load(x_row + (k + cols)[None, :], mask=(k + cols < H)[None, :], other=0.0)
        acc += w * x.to(tl.float32)
    logits = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)
    ws_row = ws_ptr + token * E
    tl.store(ws_row + rows, logits, mask=rows < E)
    # Every thread's logits are stored before the ticket is taken (the release of the acq_rel
    # atomic then publishes them at GPU scope).
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + token, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        # A helper of its own: the branch then rebinds no name of this kernel (Triton's code
        # generator requires a name bound before a runtime `if` to keep its type).
        _route_from_workspace(
            ws_row, weights_ptr, ids_ptr, token, E, K, BLOCK_K, BLOCK_E, RENORMALIZE
        )
        tl.atomic_xchg(cnt_ptr + token, 0)  # ready for the next call
