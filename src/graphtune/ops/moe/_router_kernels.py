"""The router GEMV and the routing in one Triton kernel (``graphtune.ops.moe.router``).
Imported only through ``graphtune.ops.moe._loader``.

The routing of a token is :func:`graphtune.ops.moe._kernels.route_and_store`, the body of the
separate routing kernel, so both runners route alike. Only stable ``tl.`` APIs; ``griddepcontrol``
only under ``USE_PDL`` (``graphtune.ops._pdl``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphtune.ops.moe._kernels import route_and_store


@triton.jit(do_not_specialize=["M"])
def moe_router_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    cnt_ptr,
    weights_ptr,
    ids_ptr,
    M,
    E,
    H,
    stride_xm,
    stride_we,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The router GEMV and the routing in one kernel (``graphtune.ops.moe.router``).

    Program ``(n, token)`` computes the logits of experts ``[n * BLOCK_N, ...)`` for one token
    (``x [M, H] @ w [E, H].T`` on the CUDA cores, float32 sums rounded to ``x``'s dtype as the
    router GEMM's output is), stores them as float32 in the token's workspace row ``ws [M,
    BLOCK_E]`` and takes a ticket from the token's arrival counter ``cnt [M]`` (zero between
    calls). The program holding the last ticket reads the whole row back (from L2: other SMs
    wrote it), routes it (:func:`route_and_store`) and resets the counter, so no kernel runs
    between the GEMV and the routing and the routing is computed once per token. Experts past
    ``E`` are clamped for loading and never stored.
    """
    pid = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    lanes = tl.arange(0, BLOCK_N)
    experts = pid * BLOCK_N + lanes
    kk = tl.arange(0, BLOCK_H)
    w_ptrs = w_ptr + tl.minimum(experts, E - 1).to(tl.int64)[:, None] * stride_we + kk[None, :]
    # The router weight is written by no kernel of the step: its first chunk is issued before the
    # PDL wait (graphtune.ops._pdl), and each chunk after it one iteration ahead.
    w = tl.load(w_ptrs, mask=(kk < H)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # The activation chunk as a [BLOCK_N, BLOCK_H] tile of one row repeated: it gets the weight
    # tile's layout (see graphtune.ops.gemm._gemv_kernels).
    x_row = x_ptr + token * stride_xm + (lanes * 0)[:, None]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        w_next = tl.load(w_ptrs + (k0 + BLOCK_H), mask=(k0 + BLOCK_H + kk < H)[None, :], other=0.0)
        xt = tl.load(x_row + (k0 + kk)[None, :], mask=(k0 + kk < H)[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xt.to(tl.float32), axis=1)
        w = w_next
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    ws_row = ws_ptr + token * BLOCK_E
    tl.store(ws_row + experts, logits, mask=experts < E)
    # Every thread's logits are stored before the ticket is taken; the release of the acq_rel
    # atomic publishes them at GPU scope.
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + token, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        _route_last(ws_row, token, E, weights_ptr, ids_ptr, K, BLOCK_K, BLOCK_E, RENORMALIZE)
        tl.atomic_xchg(cnt_ptr + token, 0)  # ready for the next call


@triton.jit
def _route_last(
    ws_row,
    token,
    E,
    weights_ptr,
    ids_ptr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """The last program of a token: its logits back from the workspace (``.cg``: this SM's L1
    may hold lines of the row from an earlier call), then the routing. A helper of its own, so
    the runtime branch that calls it binds no name of the kernel."""
    tl.debug_barrier()
    lanes = tl.arange(0, BLOCK_E)
    valid = lanes < E
    logits = tl.load(ws_row + lanes, mask=valid, other=float("-inf"), cache_modifier=".cg")
    route_and_store(logits, lanes, valid, token, weights_ptr, ids_ptr, K, BLOCK_K, RENORMALIZE)
