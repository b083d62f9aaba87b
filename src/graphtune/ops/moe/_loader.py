"""Lazy import of the fused-MoE Triton kernels (importing graphtune.ops never imports Triton)."""

from __future__ import annotations

from types import ModuleType

from graphtune.ops._triton import require_triton


def moe_kernels() -> ModuleType:
    """The module of fused-MoE Triton kernels (imported on first use; needs Triton)."""
    require_triton("graphtune's fused-MoE Triton kernels")
    from graphtune.ops.moe import _kernels

    return _kernels


def moe_gemv_kernels() -> ModuleType:
    """The module of the fused-MoE GEMV-path kernels (imported on first use; needs Triton)."""
    require_triton("graphtune's fused-MoE GEMV kernels")
    from graphtune.ops.moe import _gemv_kernels

    return _gemv_kernels
