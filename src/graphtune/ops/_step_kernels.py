"""The decode step's input kernel (``graphtune.ops.step_inputs``). Imported only through
``graphtune.ops.step_inputs.step_input_kernels()`` (needs Triton).

:func:`decode_inputs_kernel` turns a decode step's ``tokens``, ``positions`` and ``slots`` into
what its layers read: the embedding rows, the KV-cache write row of each (token, KV head) and the
additive attention mask over every cached position. Torch needs seven kernels for that (an index
gather and six elementwise ops); this is one. The outputs are exact (a copy, integer arithmetic,
0 or ``-inf``), so they equal the torch code's bit for bit.

Only stable ``tl.`` APIs; ``griddepcontrol`` only under ``USE_PDL`` (``graphtune.ops._pdl``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["B"])
def decode_inputs_kernel(
    tok_ptr,
    pos_ptr,
    slot_ptr,
    embed_ptr,
    x_ptr,
    rows_ptr,
    mask_ptr,
    B,
    HIDDEN,
    SEQ,
    WINDOW,
    stride_e,
    stride_x,
    stride_mask,
    KV: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program ``(row, block)``: elements ``[block * BLOCK, (block + 1) * BLOCK)`` of row ``row``'s
    embedding and mask, and (block 0) its ``KV`` write rows ``(slot * KV + head) * SEQ + pos``.
    A key ``s`` is visible when ``s <= pos`` (and ``s > pos - WINDOW`` with a sliding window)."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.load(tok_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < HIDDEN
    values = tl.load(embed_ptr + token * stride_e + cols, mask=in_row)
    tl.store(x_ptr + row.to(tl.int64) * stride_x + cols, values, mask=in_row)
    keys = cols.to(tl.int64)
    visible = keys <= pos
    if HAS_WINDOW:
        visible = visible & (keys > pos - WINDOW)
    dtype = mask_ptr.dtype.element_ty
    bias = tl.where(visible, 0.0, float("-inf")).to(dtype)
    tl.store(mask_ptr + row.to(tl.int64) * stride_mask + cols, bias, mask=cols < SEQ)
    heads = tl.arange(0, KV_BLOCK)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    cache_rows = (slot * KV + heads) * SEQ + pos
    # Block 0 writes them; a bound, not a scalar mask and-ed in (the interpreter rejects that).
    tl.store(rows_ptr + row * KV + heads, cache_rows, mask=heads < tl.where(block == 0, KV, 0))
