"""Triton kernel of the fused all-reduce + residual add + RMSNorm over symmetric memory.

Imported only through :func:`comm_kernels` (needs Triton). The caller
(:class:`graphtune.engine.collectives.SymmMemAllReduce`) owns the symmetric-memory buffers and
passes, for every rank, the distance (in elements) from this rank's buffer to that rank's mapping
of its buffer; a peer's row is then ``local_ptr + delta[peer]``, an ordinary NVLink load.

Synchronisation is one barrier per row program: program ``r`` of rank ``i`` raises slot
``r * WORLD + i`` of every rank's signal pad (compare-and-swap 0 -> 1, release, system scope;
it spins while the previous raise is still unconsumed) and then consumes slot ``r * WORLD + p``
of its own pad for every rank ``p`` (1 -> 0, acquire, system scope). Passing it means every rank
has finished the kernels before this one in its stream, including the GEMM that wrote its
partial. There is no second barrier at the end: the caller alternates two staging buffers, and a
rank can only reuse a buffer after the barrier of the next call, which every peer reaches only
after it finished reading that buffer.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["rank"])
def allreduce_add_rms_norm_kernel(
    part_ptr,
    deltas_ptr,
    pad_ptr,
    pad_deltas_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    rank,
    N,
    stride_p,
    stride_r,
    stride_o,
    eps,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: ``d = to_dtype(sum over ranks of part)``; ``s = to_dtype(res + d)`` written back to
    ``res``; ``out = to_dtype(s * rsqrt(mean(s^2) + eps) * w)``.

    The ranks are summed in rank order in float32, so every rank computes the same bits. The
    roundings are those of the unfused path (an all-reduced bf16 ``delta``, then the fused add +
    RMSNorm kernel of :mod:`graphtune.ops._kernels`).
    """
    row = tl.program_id(0)
    own_pad = pad_ptr + row * WORLD
    for peer in tl.static_range(WORLD):
        slot = own_pad + tl.load(pad_deltas_ptr + peer) + rank
        while tl.atomic_cas(slot, 0, 1, sem="release", scope="sys") != 0:
            pass
    for peer in tl.static_range(WORLD):
        while tl.atomic_cas(own_pad + peer, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()  # every thread of the program reads after the barrier, not just thread 0
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = res_ptr.dtype.element_ty
    part_row = part_ptr + row.to(tl.int64) * stride_p + cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        acc += tl.load(part_row + tl.load(deltas_ptr + peer), mask=mask, other=0.0).to(tl.float32)
    r_row = res_ptr + row.to(tl.int64) * stride_r + cols
    s = tl.load(r_row, mask=mask, other=0.0).to(tl.float32) + acc.to(dtype).to(tl.float32)
    s = s.to(dtype)
    tl.store(r_row, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    o_row = out_ptr + row.to(tl.int64) * stride_o + cols
    tl.store(o_row, (sf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
