"""A skinny-``M`` GEMM runner for the ``graphtune.gemm`` op on the tensor cores, operands swapped.

From about 4 rows on, the CUDA-core GEMV (``graphtune.ops.gemm.gemv``) loses to cuBLAS because every
row costs it a multiply-add per weight on the CUDA cores. :class:`TritonSkinnyGemmRunner` computes
``out.T = weight @ a.T`` instead: the weight rows fill the MMA's M side (``bn`` of 16..64) and the
``M <= 16`` activation rows are padded to 16 in N, so the tensor cores do the multiply-adds while
the weight streams once (``graphtune.ops.fused_gemv._kernels`` in plain mode, ``dot=1``).

It takes the ``graphtune.gemm`` op's inputs (``[a, weight, bias, residual, inplace]`` and the
optional ``out``) with the same semantics as ``graphtune.ops.gemm.TritonGemmRunner``: bias and
residual added in float32 and rounded once, in place when ``inplace``. It is the last runner of
``graphtune.ops.gemm.gemm_runners()``.
"""

from __future__ import annotations

from typing import Any

import torch

from graphtune.ops.fused_gemv import (
    PLAIN,
    FusedTritonRunner,
    GemvShape,
    fused_gemv_tactics,
    launch_fused_gemv,
)
from graphtune.ops.gemm.common import (
    result_tensor,
    torch_gemm,
    triton_gemm_supports,
    unpack_gemm_inputs,
)


def skinny_supports(inputs: list[Any]) -> bool:
    """The Triton GEMM's rules, and unit strides along ``K`` (the kernel assumes them)."""
    a, weight = inputs[0], inputs[1]
    return a.stride(-1) == 1 and weight.stride(-1) == 1 and triton_gemm_supports(inputs)


def skinny_tactics(a: torch.Tensor, weight: torch.Tensor, sm_count: int) -> list[dict[str, int]]:
    """The ``dot=1`` tactics of :func:`graphtune.ops.fused_gemv.family.fused_gemv_tactics`,
    less the measured losers: none for one row, and only ``bn >= 64`` with ``bk`` 128 up to
    8 rows. Over every GEMM case of the committed tuning-quality runs
    (``benchmarks/results/tuning-*.json``, Llama-1B's decode GEMMs) none of these came within
    5.8% of the case's best under either truth."""
    m = a.shape[0]
    if m <= 1:
        return []
    shape = GemvShape(PLAIN, m, weight.shape[0], 1, a.shape[1], a.element_size())
    tactics = [t for t in fused_gemv_tactics(shape, sm_count=sm_count) if t["dot"] == 1]
    if m <= 8:
        tactics = [t for t in tactics if t["bn"] >= 64 and t["bk"] == 128]
    return tactics


class TritonSkinnyGemmRunner(FusedTritonRunner):
    """Swapped-operand tensor-core GEMM for ``M <= 16``; tactic ``-1`` is ``F.linear``.

    Args: as :class:`~graphtune.ops.fused_gemv.FusedTritonRunner`.
    """

    def supports(self, inputs: list[Any]) -> bool:
        """See :func:`skinny_supports`."""
        return skinny_supports(inputs)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`skinny_tactics`; the SM count of the inputs' device (or the override)."""
        a, weight = inputs[0], inputs[1]
        return skinny_tactics(a, weight, self.sm_count_for(a.device))

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """:func:`graphtune.ops.gemm.common.torch_gemm`: the fallback tactic."""
        return torch_gemm(inputs)

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs the kernel; returns ``[M, N]`` (``residual`` itself when ``inplace``)."""
        a, weight, bias, residual, inplace = unpack_gemm_inputs(inputs)
        n = weight.shape[0]
        out = result_tensor(inputs, a, n, residual, inplace)
        if a.shape[0] == 0:
            return out
        launch_fused_gemv(
            PLAIN,
            tactic,
            x=a,
            weight=weight,
            out=out,
            n=n,
            bias=bias,
            residual=residual,
            warmup=warmup,
        )
        return out
