"""The decode step's inputs in one kernel: embedding rows, KV-cache write rows, attention mask.

A decode step starts from ``tokens``, ``positions`` and ``slots`` (``[B]`` each, int64) and its
layers read three things made from them: the embedding rows ``embed[tokens]``, the flattened cache
row of each (token, KV head), ``(slot * kv_heads + head) * max_seq + position``, and the additive
mask ``[B, 1, 1, max_seq]`` (0 where a cached key is visible, ``-inf`` elsewhere). The torch code
(``graphtune.engine.step`` and ``graphtune.engine.attention.causal_mask``) takes seven kernels for
that; :func:`decode_inputs` launches one (``graphtune.ops._step_kernels``), with the same bits.

It has nothing to tune (a copy and integer arithmetic, well under the step's weight streams), so
it is not a tunable op: the tuned decode step calls it where :func:`decode_inputs_supported` says
the kernel can run, and the untuned step keeps the torch code.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from graphtune.errors import InputError, describe_tensor
from graphtune.ops._triton import device_supported, kernel_module, run_kernel

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
BLOCK = 1024
"""Embedding and mask elements per program (4 warps, 8 elements a thread)."""


def step_input_kernels() -> ModuleType:
    """The module of the step-input kernel (imported on first use; needs Triton)."""
    return kernel_module("graphtune.ops._step_kernels", "graphtune's decode step-input kernel")


def decode_inputs_supported(embed: torch.Tensor) -> bool:
    """Whether :func:`decode_inputs` runs for this embedding table (a ``[vocab, hidden]`` table
    of a dtype in :data:`DTYPES` with unit last stride, on a device Triton runs on)."""
    return _embed_table_ok(embed) and device_supported(embed.device)


def _embed_table_ok(embed: torch.Tensor) -> bool:
    """The kernel's rule for the table, shared by :func:`decode_inputs_supported` and the check
    of :func:`decode_inputs`: 2-D, a dtype of :data:`DTYPES`, unit last stride (a row is read as
    one run)."""
    return embed.dim() == 2 and embed.dtype in DTYPES and embed.stride(-1) == 1


def decode_inputs(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    embed: torch.Tensor,
    *,
    kv_heads: int,
    max_seq: int,
    window: int | None,
    mask_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The embedding rows ``[B, hidden]``, the KV write rows ``[B * kv_heads]`` (int64) and the
    decode mask ``[B, 1, 1, max_seq]`` of ``mask_dtype``, from one kernel launch.

    ``tokens``, ``positions`` and ``slots`` are ``[B]`` int32 or int64 tensors on ``embed``'s
    device; strided views are copied to contiguous ones first (the kernel reads element ``b``
    at offset ``b``), which costs nothing for the engine's contiguous step inputs. ``tokens``
    must lie in ``[0, vocab)``: the kernel does not check them (the engine checks prompts on
    the host, and sampled tokens are in range by construction).

    Raises:
        InputError: ``embed`` is not a ``[vocab, hidden]`` table of a dtype in :data:`DTYPES`
            with a unit last stride,
            ``mask_dtype`` is not a float dtype, or an index tensor is not ``[B]`` int32/int64
            on ``embed``'s device.
    """
    _check_inputs(tokens, positions, slots, embed, mask_dtype, kv_heads, max_seq, window)
    # Copy strided views rather than refuse them: the untuned step's torch code takes them, and
    # inside a captured step the copy is captured too (reading the same static buffer).
    tokens, positions, slots = tokens.contiguous(), positions.contiguous(), slots.contiguous()
    batch, hidden = tokens.shape[0], embed.shape[1]
    device = embed.device
    x = torch.empty((batch, hidden), device=device, dtype=embed.dtype)
    rows = torch.empty(batch * kv_heads, device=device, dtype=torch.long)
    mask = torch.empty((batch, 1, 1, max_seq), device=device, dtype=mask_dtype)
    if batch == 0:
        return x, rows, mask
    grid = (batch, -(-max(hidden, max_seq) // BLOCK))
    args = (
        tokens,
        positions,
        slots,
        embed,
        x,
        rows,
        mask,
        batch,
        hidden,
        max_seq,
        window or 0,
        embed.stride(0),
        x.stride(0),
        mask.stride(0),
    )
    meta = dict(
        KV=kv_heads,
        KV_BLOCK=1 << max(0, (kv_heads - 1).bit_length()),
        HAS_WINDOW=window is not None,
        BLOCK=BLOCK,
        num_warps=4,
    )
    run_kernel(step_input_kernels().decode_inputs_kernel, grid, args, meta, False)
    return x, rows, mask


def _check_inputs(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    embed: torch.Tensor,
    mask_dtype: Any,
    kv_heads: Any,
    max_seq: Any,
    window: Any,
) -> None:
    """:func:`decode_inputs`' rules, attribute comparisons only (no host synchronisation)."""
    for name, size, least in (("kv_heads", kv_heads, 1), ("max_seq", max_seq, 1)):
        if isinstance(size, bool) or not isinstance(size, int) or size < least:
            raise InputError(
                f"decode_inputs: {name} must be an int >= {least} (the KV heads per row and the "
                f"mask's keys), got {size!r}."
            )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise InputError(
            f"decode_inputs: window must be None or an int (the sliding window), got {window!r}."
        )
    if not _embed_table_ok(embed):
        raise InputError(
            f"decode_inputs: embed must be a [vocab, hidden] float16, bfloat16 or float32 table "
            f"with unit last stride (the kernel reads a row as one run; see "
            f"decode_inputs_supported), got {describe_tensor(embed)} with strides "
            f"{embed.stride()}."
        )
    if not isinstance(mask_dtype, torch.dtype) or not mask_dtype.is_floating_point:
        raise InputError(
            f"decode_inputs: mask_dtype must be a float torch.dtype (the mask holds 0 and -inf), "
            f"got {mask_dtype!r}; pass the attention's dtype."
        )
    batch = tokens.shape[0] if tokens.dim() == 1 else -1
    for name, value in (("tokens", tokens), ("positions", positions), ("slots", slots)):
        if (
            value.dim() != 1
            or value.shape[0] != batch
            or value.dtype not in INDEX_DTYPES
            or value.device != embed.device
        ):
            raise InputError(
                f"decode_inputs: tokens, positions and slots must be [B] int32 or int64 tensors "
                f"of one B on embed's device {embed.device}, got {name} {describe_tensor(value)}"
                f" (tokens {tuple(tokens.shape)}); move or cast it with .to()."
            )
