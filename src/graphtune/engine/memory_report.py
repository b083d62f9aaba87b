"""What the engine's memory plan reads of a device: the :class:`MemoryReport` protocol and its
``torch.cuda`` implementation (:class:`CudaMemoryReport`). Passed in, so CPU tests drive the
plan (:mod:`graphtune.engine.memory_plan`) with a fake report."""

from __future__ import annotations

from typing import Protocol

import torch

from graphtune.errors import ConfigError


class MemoryReport(Protocol):
    """What the memory plan reads of a device (``torch.cuda.mem_get_info`` / ``memory_stats``)."""

    def device_bytes(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the device, all processes counted."""
        ...

    def allocated_bytes(self) -> int:
        """Bytes this process's tensors hold now."""
        ...

    def peak_allocated_bytes(self) -> int:
        """Most bytes this process's tensors held since :meth:`reset_peak`."""
        ...

    def reset_peak(self) -> None:
        """Starts a new peak."""
        ...

    def settle(self) -> None:
        """Waits for the device and returns cached free blocks to it, so free bytes are real."""
        ...


class CudaMemoryReport:
    """:class:`MemoryReport` of one CUDA device, through ``torch.cuda``."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        resolved = torch.device("cuda", device) if isinstance(device, int) else device
        resolved = torch.device(resolved if resolved is not None else "cuda")
        if resolved.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError(
                f"gpu_memory_utilization needs a CUDA device, got {resolved} (CUDA available: "
                f"{torch.cuda.is_available()}); run on a GPU, or drop gpu_memory_utilization "
                "and give max_batch_size"
            )
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
        self.device = resolved

    def device_bytes(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak_allocated_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
