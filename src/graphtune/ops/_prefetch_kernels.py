"""The Triton side of ``graphtune.ops._l2_prefetch``: a helper that kernels call before their
``gdc_wait()``. Imported only by kernel modules (needs Triton); never under the interpreter's
``L2_PREFETCH=False`` (it has no inline assembly)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def prefetch_l2_share(pf_ptr, pf_chunks, pf_last, program, programs, BLOCK: tl.constexpr):
    """Issues program ``program`` of ``programs``' share of the bulk L2 prefetches over
    ``pf_chunks`` chunks of 16 KiB from ``pf_ptr`` (the last one starting at byte ``pf_last``).

    Each program takes a contiguous run of chunks, ``BLOCK`` per iteration: one chunk per lane
    when ``BLOCK`` is the program's thread count, and lanes past the run's end are predicated off
    (the instruction has no mask). The prefetch is asynchronous: nothing waits for it.
    """
    per = (pf_chunks + programs - 1) // programs
    start = program * per
    stop = tl.minimum(start + per, pf_chunks)
    base = pf_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
    for first in range(start, stop, BLOCK):
        chunk = first + tl.arange(0, BLOCK)
        offset = tl.minimum(chunk.to(tl.int64) * 16384, pf_last)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], 16384; mov.u32 $0, 0; }",
            "=r,l,r",
            [base + offset, (chunk < stop).to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
