"""Triton device functions of the one-kernel split exchange: the program that counts last in a
tile's arrival counter sums, in split order, the float32 partials every split stored.

Callers: the split-K epilogues of ``graphtune.ops.gemm._gemv_kernels.gemv_kernel``,
``graphtune.ops._kernels.gemm_kernel`` and ``graphtune.ops.fused_gemv._kernels.fused_gemv_kernel``
(:func:`last_to_arrive` and :func:`sum_partials`), and the inline merge of
``graphtune.ops._attention_kernels.decode_attention_kernel`` (:func:`last_to_arrive` only: its
merge is a softmax rescale, not a sum). The counters are ``graphtune.ops._counters``'s zeroed
buffer; the workspace layout is the caller's (``graphtune.ops._split_k`` sizes it).

Like :mod:`graphtune._rope_jit`, this module sits outside :mod:`graphtune.ops` and imports
nothing but Triton, so a compile worker that executes a kernel module from its file does not run
the ``ops`` package's ``__init__`` (:mod:`graphtune._compile_worker`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(counter_ptr, ARRIVALS: tl.constexpr):
    """Count this program in ``counter_ptr`` (one int32 per tile) after every thread stored its
    partial; True in the program that counted last, which also sets the counter back to zero for
    the next launch (every program of this launch has counted by then).

    The barrier before the count orders all of the program's partial stores before the atomic's
    release; the one after it orders every thread's later reads of the partials after its
    acquire, so the last program sees every split's partial at GPU scope."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    is_last = arrived == ARRIVALS - 1
    tl.store(counter_ptr, 0, mask=is_last)
    return is_last


@triton.jit
def sum_partials(first_ptr, cell, is_last, SPLITS: tl.constexpr, CELLS: tl.constexpr):
    """The float32 sum, in split order, of ``SPLITS`` partial tiles of ``CELLS`` cells each, split
    ``s``'s at ``first_ptr + s * CELLS + cell``: read only where ``is_last`` (zeros elsewhere),
    so only the last program pays for the reads.

    Partials are read from L2 (``.cg``): other SMs wrote them, and this SM's L1 may hold lines of
    the same workspace from an earlier launch."""
    # A block mask and-ed with a scalar one is rejected by Triton's CPU interpreter: a bound.
    live = cell < tl.where(is_last, CELLS, 0)
    total = tl.load(first_ptr + cell, mask=live, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLITS):
        total += tl.load(first_ptr + s * CELLS + cell, mask=live, other=0.0, cache_modifier=".cg")
    return total
