"""What every GEMM runner shares: the input rules, ``out=`` and in-place handling, the kernels'
operands, and the torch path.

Inputs of every GEMM runner are ``[a, weight, bias, residual, inplace]`` (see
:mod:`graphtune.ops.gemm`), plus, for ``forward`` only, an optional sixth element: the output
tensor of ``gemm(..., out=)``. Where the result goes does not change which kernel is fastest, so
it stays out of the inputs the tuner sees (and out of the cache key).

Both Triton GEMM kernels reduce a split-K tactic's splits inside their own launch
(``graphtune.ops._split_k``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.errors import InputError
from graphtune.ops._triton import device_supported

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Operand dtypes the Triton GEMM kernels take."""

_Inputs = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", bool]


def unpack_gemm_inputs(inputs: list[Any]) -> _Inputs:
    """Unpacks ``[a, weight, bias, residual, inplace]`` and checks the shapes (an optional sixth
    element, the output tensor, is read by :func:`out_of`)."""
    a, weight, bias, residual, inplace = inputs[:5]
    if a.dim() != 2 or weight.dim() != 2 or a.shape[1] != weight.shape[1]:
        raise InputError(
            f"GEMM needs a [M, K] and weight [N, K] with the same K, got a {tuple(a.shape)} and "
            f"weight {tuple(weight.shape)}; flatten leading dims of a (gemm() does)."
        )
    if residual is not None and tuple(residual.shape) != (a.shape[0], weight.shape[0]):
        raise InputError(
            f"GEMM residual must be [M, N] = {[a.shape[0], weight.shape[0]]}, got "
            f"{tuple(residual.shape)}."
        )
    if inplace and residual is None:
        raise InputError("GEMM inplace=True accumulates into residual, so pass a residual.")
    return a, weight, bias, residual, bool(inplace)


def out_of(inputs: list[Any]) -> torch.Tensor | None:
    """The caller's output tensor (``gemm(..., out=)``), passed to ``forward`` as a sixth input.

    It is not part of the inputs the tuner sees: where the result goes does not change which
    kernel is fastest, so it stays out of the cache key.
    """
    return inputs[5] if len(inputs) > 5 else None


def triton_gemm_supports(inputs: list[Any]) -> bool:
    """Whether the Triton GEMM kernels (tiled and GEMV) can run these inputs.

    One float dtype for all operands, a contiguous 1-D bias (the kernels read ``bias_ptr + n``),
    a contiguous residual, a Triton device.
    """
    a, weight, bias, residual, _ = unpack_gemm_inputs(inputs)
    if a.dtype not in DTYPES or weight.dtype != a.dtype:
        return False
    if bias is not None and (bias.dtype != a.dtype or bias.dim() != 1 or bias.stride(0) != 1):
        return False
    if residual is not None and (residual.dtype != a.dtype or not residual.is_contiguous()):
        return False  # the split-K reduction indexes the residual as a flat [M * N]
    return device_supported(a.device)


def result_tensor(
    inputs: list[Any], a: torch.Tensor, n: int, residual: torch.Tensor | None, inplace: bool
) -> torch.Tensor:
    """Where a Triton GEMM writes ``[M, N]``: ``out=``, else the residual in place, else new."""
    out = out_of(inputs)
    if out is not None:
        return out
    if inplace:
        return residual
    return torch.empty((a.shape[0], n), device=a.device, dtype=a.dtype)


def kernel_operands(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """The operand pointers and strides the Triton GEMM kernels take first, in their order.

    Returns:
        ``(a, weight, bias, res)`` (an absent bias or residual is replaced by ``a``, an unread
        placeholder pointer) and the strides of ``a``, ``weight`` and ``res``; each kernel's
        output arguments follow them.
    """
    res = residual if residual is not None else a
    pointers = (a, weight, bias if bias is not None else a, res)
    return pointers, (*a.stride(), *weight.stride(), *res.stride())


def torch_gemm(inputs: list[Any]) -> torch.Tensor:
    """The torch path: ``F.linear``, or ``addmm`` / ``addmm_`` with a residual."""
    a, weight, bias, residual, inplace = unpack_gemm_inputs(inputs)
    out = out_of(inputs)
    if out is not None:
        if residual is not None:
            torch.addmm(residual, a, weight.t(), out=out)
            return out.add_(bias) if bias is not None else out
        if bias is not None:
            return torch.addmm(bias, a, weight.t(), out=out)
        return torch.mm(a, weight.t(), out=out)
    if residual is None:
        return F.linear(a, weight, bias)
    if inplace:
        out = residual.addmm_(a, weight.t())
    else:
        out = torch.addmm(residual, a, weight.t())
    # A bias next to a residual is rare (no decode projection has both): a second rounding.
    return out.add_(bias) if bias is not None else out


class TorchGemmRunner(TunableRunner):
    """``F.linear`` / ``torch.addmm`` (cuBLAS on CUDA); only the fallback tactic."""

    def forward(
        self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC, **kwargs: Any
    ) -> torch.Tensor:
        """Runs :func:`torch_gemm`."""
        return torch_gemm(inputs)
