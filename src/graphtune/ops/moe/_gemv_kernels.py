"""Triton kernels of the fused-MoE op's GEMV path. Imported only through
``graphtune.ops.moe._loader``.

At decode sizes (a few tokens, so a row or none per expert) every selected expert is a GEMV:
its weights are streamed once per (token, slot) pair and multiplied by one activation row. These
two kernels do that without the sort step of the grouped GEMMs (``graphtune.ops.moe._kernels``)
and without ``tl.dot`` tiles of 16 rows that would be mostly padding:

* :func:`moe_gemv_gate_up_kernel`: one program per (pair, ``BLOCK_N`` features of the expert
  width); reads the pair's expert id, streams its gate and up rows ``[BLOCK_N, BLOCK_K]`` at a
  time along the hidden size (16-byte vector loads, the next chunk loaded one iteration ahead in
  registers) and writes ``silu(gate) * up`` for the pair;
* :func:`moe_gemv_down_kernel`: one program per (token, ``BLOCK_F`` features of the hidden size),
  streaming the down rows of all of the token's experts side by side, then rounding each slot's
  product, applying its routing weight and adding the slots in float32: the top-k sum happens in
  the program, so no per-pair buffer and no sum kernel are needed (deterministic, no atomics).

Rounding is the grouped kernels' (and the torch expert loop's): each projection rounded to the
dtype, then ``silu(gate)`` and its product with ``up``; the down product rounded, times the
routing weight in float32, rounded again; the k rounded rows summed in float32 and rounded once
(by a fixed reduction tree rather than in slot order: the float32 sum may differ from the
grouped path's in its last bit).
A slot whose expert id is outside ``[0, E)`` adds nothing and its ``act`` row is never written
nor read.

PDL (``graphtune.ops._pdl``): the weights these kernels read depend on the routing. The gate/up
kernel follows the router, which writes the routing, so it loads nothing before ``gdc_wait()``.
The down kernel always follows the gate/up kernel of the same call, which lets it launch only
after its own ``gdc_wait()``, so the router has completed when the down kernel starts: it reads
the expert ids and routing weights and streams its first weight chunk before its
``gdc_wait()`` (overlapping them with the gate/up kernel's last wave), and the gate/up output
after it; the residual right after it, before its main loop. Each lets its successor
launch right after its wait. As in ``graphtune.ops.gemm._gemv_kernels``, the reduction over
``K`` is written without helper ``@triton.jit`` calls (the interpreter pays for each nested call).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def moe_gemv_gate_up_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    act_ptr,
    TOP_K,
    E,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_am,
    stride_an,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``act[p, n] = silu(x[tok] . gate[e, n]) * (x[tok] . up[e, n])`` for pair ``p``.

    ``w [E, 2N, K]`` holds the gate rows ``[0, N)`` then the up rows ``[N, 2N)``; ``e =
    ids[p]``, ``tok = p // TOP_K``. Program ``p * cdiv(N, BLOCK_N) + n`` owns features
    ``[n * BLOCK_N, ...)``; features past ``N`` are clamped to ``N - 1`` for loading and not
    stored. The activation chunk is loaded as a ``[BLOCK_N, BLOCK_K]`` tile whose rows repeat
    the same columns, so it gets the weight tile's register layout (see
    ``graphtune.ops.gemm._gemv_kernels``).
    """
    pid = tl.program_id(0)
    grid_n = (N + BLOCK_N - 1) // BLOCK_N
    pair = pid // grid_n
    pid_n = pid % grid_n
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (expert < 0) | (expert >= E):
        return
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_safe = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we + offs_k[None, :] * stride_wk
    g_ptrs = w_base + n_safe[:, None] * stride_wn
    u_ptrs = w_base + (n_safe + N)[:, None] * stride_wn
    a_ptrs = x_ptr + token * stride_xm + offs_k[None, :] * stride_xk + (n_safe * 0)[:, None]
    if EVEN_K:
        g_next = tl.load(g_ptrs)
        u_next = tl.load(u_ptrs)
    else:
        g_next = tl.load(g_ptrs, mask=(offs_k < K)[None, :], other=0.0)
        u_next = tl.load(u_ptrs, mask=(offs_k < K)[None, :], other=0.0)
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        g = g_next.to(tl.float32)
        u = u_next.to(tl.float32)
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
        ahead = (k + BLOCK_K + offs_k < K)[None, :]
        g_next = tl.load(g_ptrs, mask=ahead, other=0.0)
        u_next = tl.load(u_ptrs, mask=ahead, other=0.0)
        if EVEN_K:
            a = tl.load(a_ptrs + k * stride_xk).to(tl.float32)
        else:
            here = (k + offs_k < K)[None, :]
            a = tl.load(a_ptrs + k * stride_xk, mask=here, other=0.0).to(tl.float32)
        acc_g += tl.sum(g * a, axis=1)
        acc_u += tl.sum(u * a, axis=1)
    dtype = act_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    out_ptrs = act_ptr + pair.to(tl.int64) * stride_am + offs_n * stride_an
    tl.store(out_ptrs, act.to(dtype), mask=offs_n < N)


@triton.jit
def moe_gemv_down_kernel(
    act_ptr,
    w_ptr,
    ids_ptr,
    route_ptr,
    out_ptr,
    TOP_K,
    E,
    N,
    K,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    EVEN_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_RES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out[t, n] = sum_j route[t, j] * (act[t * TOP_K + j] . down[ids[t, j], n])``.

    ``w [E, N, K]``; ``route`` is the flat ``[T * TOP_K]`` routing weights. Program ``t *
    cdiv(N, BLOCK_F) + f`` owns features ``[f * BLOCK_F, ...)`` of token ``t`` and all of its
    slots at once: tile row ``r`` is slot ``r // BLOCK_F`` (``BLOCK_S >= TOP_K`` slots, a power
    of two) and feature ``r % BLOCK_F``, so every chunk streams ``BLOCK_S * BLOCK_F`` weight rows
    of up to ``BLOCK_S`` experts side by side (a loop over the slots would wait for each slot's
    expert id and stream one expert at a time). After the loop each row is rounded, weighted and
    rounded again, and the slots are summed in float32 (a fixed reduction tree: deterministic).
    A slot past ``TOP_K`` or without an expert adds nothing: its loads use expert 0 and its
    unwritten ``act`` row is masked out, so nothing uninitialised is read. With ``HAS_RES``
    ``out`` is the residual and the rounded sum is added to it (a second rounding, as
    ``residual.add_``; each element is read and written by the same program).
    """
    pid = tl.program_id(0)
    grid_n = (N + BLOCK_F - 1) // BLOCK_F
    token = (pid // grid_n).to(tl.int64)
    pid_n = pid % grid_n
    rows = tl.arange(0, BLOCK_S * BLOCK_F)
    slot = rows // BLOCK_F
    offs_n = pid_n * BLOCK_F + rows % BLOCK_F
    n_safe = tl.minimum(offs_n, N - 1).to(tl.int64)
    pair = token * TOP_K + slot
    expert = tl.load(ids_ptr + pair, mask=slot < TOP_K, other=-1).to(tl.int64)
    routed = (slot < TOP_K) & (expert >= 0) & (expert < E)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = (
        w_ptr
        + (tl.where(routed, expert, 0) * stride_we + n_safe * stride_wn)[:, None]
        + offs_k[None, :] * stride_wk
    )
    a_ptrs = act_ptr + (pair * stride_am)[:, None] + offs_k[None, :] * stride_ak
    if EVEN_K:
        w_next = tl.load(w_ptrs)
    else:
        w_next = tl.load(w_ptrs, mask=(offs_k < K)[None, :], other=0.0)
    # The expert ids, the routing weights and the first weight chunk are read before waiting
    # (see the module docstring); act, written by the gate/up kernel just before, only after.
    weight = tl.load(route_ptr + pair, mask=routed, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cols = pid_n * BLOCK_F + tl.arange(0, BLOCK_F)
    out_ptrs = out_ptr + token * stride_om + cols * stride_on
    if HAS_RES:
        # Issued before the loop and used only after it, so its round trip overlaps the loop.
        res = tl.load(out_ptrs, mask=cols < N, other=0.0)
    acc = tl.zeros((BLOCK_S * BLOCK_F,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        w = w_next.to(tl.float32)
        w_ptrs += BLOCK_K * stride_wk
        w_next = tl.load(w_ptrs, mask=(k + BLOCK_K + offs_k < K)[None, :], other=0.0)
        here = routed[:, None] & (k + offs_k < K)[None, :]
        a = tl.load(a_ptrs + k * stride_ak, mask=here, other=0.0).to(tl.float32)
        acc += tl.sum(w * a, axis=1)
    dtype = out_ptr.dtype.element_ty
    y = (acc.to(dtype).to(tl.float32) * weight.to(tl.float32)).to(dtype).to(tl.float32)
    total = tl.sum(tl.reshape(tl.where(routed, y, 0.0), (BLOCK_S, BLOCK_F)), axis=0)
    result = total.to(dtype)
    if HAS_RES:
        result = (result.to(tl.float32) + res.to(tl.float32)).to(dtype)
    tl.store(out_ptrs, result, mask=cols < N)
