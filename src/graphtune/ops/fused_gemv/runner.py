"""The base class of every runner that launches the fused GEMV kernel."""

from __future__ import annotations

from graphtune.ops._triton_runner import TritonRunner


class FusedTritonRunner(TritonRunner):
    """Base of a fused op's Triton runner: tactic ``-1`` runs the op's torch composition, any
    other the fused GEMV kernel, whose launch code and kernel source are part of the runner's
    cache identity."""

    source_modules = ("graphtune.ops.fused_gemv.family", "graphtune.ops.fused_gemv._kernels")
