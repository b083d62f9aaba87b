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

import torch

from graphtune.ops._triton import device_supported, kernel_module, run_kernel

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 1024
"""Embedding and mask elements per program (4 warps, 8 elements a thread)."""


def step_input_kernels() -> ModuleType:
    """The module of the step-input kernel (imported on first use; needs Triton)."""
    return kernel_module("graphtune.ops._step_kernels", "graphtune's decode step-input kernel")


def decode_inputs_supported(embed: torch.Tensor) -> bool:
    """Whether :func:`decode_inputs` runs for this embedding table (a float table with unit last
    stride on a device Triton runs on)."""
    return embed.dtype in DTYPES and embed.stride(-1) == 1 and device_supported(embed.device)


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

    ``tokens`` must lie in ``[0, vocab)``: the kernel does not check them (the engine checks
    prompts on the host, and sampled tokens are in range by construction).
    """
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
