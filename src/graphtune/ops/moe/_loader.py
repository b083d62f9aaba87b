"""Lazy import of the fused-MoE Triton kernels (importing graphtune.ops never imports Triton)."""

from __future__ import annotations

from types import ModuleType

from graphtune.ops._triton import kernel_module


def moe_kernels() -> ModuleType:
    """The module of fused-MoE Triton kernels (imported on first use; needs Triton)."""
    return kernel_module("graphtune.ops.moe._kernels", "graphtune's fused-MoE Triton kernels")


def moe_gemv_kernels() -> ModuleType:
    """The module of the fused-MoE GEMV-path kernels (imported on first use; needs Triton)."""
    return kernel_module("graphtune.ops.moe._gemv_kernels", "graphtune's fused-MoE GEMV kernels")


def router_kernels() -> ModuleType:
    """The module of the router's Triton kernels (imported on first use; needs Triton)."""
    return kernel_module("graphtune.ops.moe._router_kernels", "graphtune's MoE router kernels")
