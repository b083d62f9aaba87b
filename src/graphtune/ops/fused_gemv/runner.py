"""The base class of every runner that launches the fused GEMV kernel."""

from __future__ import annotations

from typing import Any

import torch

from graphtune.ops._triton import device_limits
from graphtune.ops._triton_runner import TritonRunner


class FusedTritonRunner(TritonRunner):
    """Base of a fused op's Triton runner: tactic ``-1`` runs the op's torch composition, any
    other the fused GEMV kernel, whose launch code and kernel source are part of the runner's
    cache identity.

    Args:
        sm_count: Override the device's SM count (tests, or to tune for another GPU).
        compile_workers: Threads for ahead-of-time compilation.
    """

    source_modules = (
        "graphtune.ops.fused_gemv.family",
        "graphtune.ops.fused_gemv._kernels",
        "graphtune._rope_jit",
        "graphtune._split_k_jit",
    )

    def __init__(self, *, sm_count: int | None = None, compile_workers: int | None = None) -> None:
        super().__init__(compile_workers=compile_workers)
        self.sm_count = sm_count

    def cache_key_extras(self) -> tuple[Any, ...]:
        """An SM-count override changes the candidates."""
        return () if self.sm_count is None else ({"sm": self.sm_count},)

    def sm_count_for(self, device: torch.device) -> int:
        """The SM count the tactics are pruned for: the override, else the device's."""
        return self.sm_count or device_limits(device)[1]
