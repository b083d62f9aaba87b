"""Graph backends: the only code of the graph runner that talks to CUDA graphs.

:class:`CudaGraphBackend` is the real one (``torch.cuda.CUDAGraph``). :class:`SimulatedGraphBackend`
runs the runner's whole capture/pad/replay/slice logic on any device without CUDA: its "graph"
re-runs ``fn`` on the captured static arguments and copies the results into the tensors returned
at capture, which is exactly what a replay does to memory. CPU tests use it; GPU tests use the
real backend.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from graphtune.graphs.tree import flatten_with_paths

logger = logging.getLogger(__name__)


class GraphBackend(Protocol):
    """What the runner needs from a graph implementation."""

    device_type: str | None

    def available(self) -> bool: ...

    def is_capturing(self) -> bool: ...

    def resolve_device(self, device: Any, leaves: list) -> Any: ...

    def device_guard(self, device: Any) -> contextlib.AbstractContextManager: ...

    def new_pool(self, device: Any) -> Any: ...

    def warmup(self, fn: Callable, args: tuple, runs: int, device: Any) -> None: ...

    def capture(self, fn: Callable, args: tuple, pool: Any, device: Any) -> tuple[Any, Any]: ...

    def recover(self, device: Any) -> None: ...

    def synchronize(self, device: Any) -> None: ...

    def memory_reserved(self, device: Any) -> int: ...

    def empty_cache(self) -> None: ...


class CudaGraphBackend:
    """CUDA graphs through ``torch.cuda.CUDAGraph`` and ``torch.cuda.graph``.

    Warm-up and capture run on one side stream per device, shared by every runner in the process:
    PyTorch gives each (cuBLAS handle, stream) pair its own workspace, allocated on first use and
    never freed. Warming up on the capture stream makes that allocation happen outside the
    capture (inside it would land in the graph pool and pin it), and sharing the stream keeps it
    to one workspace per device instead of one per runner.
    """

    device_type: str | None = "cuda"

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def available(self) -> bool:
        return torch.cuda.is_available()

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def resolve_device(self, device: Any, leaves: list) -> torch.device:
        if device is None:
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
                    return leaf.device
            return torch.device("cuda", torch.cuda.current_device())
        if isinstance(device, int):
            resolved = torch.device("cuda", device)
        else:
            resolved = torch.device(device)
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
        return resolved

    def device_guard(self, device: torch.device) -> contextlib.AbstractContextManager:
        return torch.cuda.device(device)

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The shared warm-up/capture stream of ``device``."""
        stream = self._streams.get(device.index)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            self._streams[device.index] = stream
        return stream

    def new_pool(self, device: torch.device) -> Any:
        return torch.cuda.graph_pool_handle()

    def warmup(self, fn: Callable, args: tuple, runs: int, device: torch.device) -> None:
        # Side stream, as PyTorch's CUDA graph notes require: lazy initialisations (cuBLAS
        # handles and workspaces, Triton compilation) happen here instead of inside the capture.
        stream = self.stream(device)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for _ in range(runs):
                fn(*args)
        current.wait_stream(stream)

    def capture(
        self, fn: Callable, args: tuple, pool: Any, device: torch.device
    ) -> tuple[torch.cuda.CUDAGraph, Any]:
        stream = self.stream(device)
        previous = torch.cuda.current_stream(device)
        stream.wait_stream(previous)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs = fn(*args)
        except BaseException:
            _end_stuck_capture(graph, stream)
            raise
        finally:
            # torch.cuda.graph.__exit__ does not restore the caller's stream when capture_end
            # raises, which would silently move all later work onto the capture stream.
            if torch.cuda.current_stream(device) != previous:
                torch.cuda.set_stream(previous)
        return graph, outputs

    def recover(self, device: torch.device) -> None:
        # A failed capture leaves no sticky error (capture errors are not context-corrupting and
        # PyTorch clears the last error when it raises), but the device may still run work queued
        # before the failure; wait for it so the next capture starts from a clean state.
        try:
            torch.cuda.synchronize(device)
        except RuntimeError as exc:  # keep going: the failure is already recorded
            logger.warning("torch.cuda.synchronize after a failed capture raised: %s", exc)
        stream = self._streams.get(device.index)
        if stream is not None:
            with torch.cuda.stream(stream):
                stuck = torch.cuda.is_current_stream_capturing()
            if stuck:
                # Unrecoverable stream: drop it; the next capture gets a fresh one.
                logger.warning("capture stream still capturing after a failure; replacing it")
                del self._streams[device.index]

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def memory_reserved(self, device: torch.device) -> int:
        return torch.cuda.memory_reserved(device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def _end_stuck_capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    """Ends a capture that the failing code left open (e.g. ``fn`` switched streams and never
    switched back, so ``torch.cuda.graph`` could not call ``capture_end``). An open capture in the
    default "global" mode makes every later allocation in the process fail."""
    with torch.cuda.stream(stream):
        if not torch.cuda.is_current_stream_capturing():
            return
        try:
            graph.capture_end()
        except RuntimeError as exc:  # invalidated captures end with an error; that is expected
            logger.debug("ending the failed capture reported: %s", exc)


_DEFAULT_CUDA_BACKEND: CudaGraphBackend | None = None


def default_backend() -> CudaGraphBackend:
    """The process-wide CUDA backend (created on first use; creating it touches no device)."""
    global _DEFAULT_CUDA_BACKEND
    if _DEFAULT_CUDA_BACKEND is None:
        _DEFAULT_CUDA_BACKEND = CudaGraphBackend()
    return _DEFAULT_CUDA_BACKEND


class _SimulatedGraph:
    def __init__(self, backend: SimulatedGraphBackend, fn: Callable, args: tuple, outputs: Any):
        self._backend = backend
        self._fn = fn
        self._args = args
        self._outputs = [x for x in flatten_with_paths(outputs)[0] if isinstance(x, torch.Tensor)]

    def replay(self) -> None:
        fresh = flatten_with_paths(self._fn(*self._args))[0]
        tensors = [x for x in fresh if isinstance(x, torch.Tensor)]
        for static, new in zip(self._outputs, tensors, strict=True):
            if static is not new:
                static.copy_(new)
        self._backend.replays += 1


class SimulatedGraphBackend:
    """A graph backend without CUDA, for exercising the runner on CPU.

    Capture runs ``fn`` once on the static arguments (like a capture, it is the runner's static
    buffers that ``fn`` sees) and keeps its output tensors; replay re-runs ``fn`` on the same
    static arguments and copies the results into those tensors. So padding, stale rows, slicing,
    output aliasing and fallbacks behave as with real graphs; only speed differs.

    Args:
        available: What :meth:`available` reports (False simulates a machine without CUDA).
        fail_when: Optional predicate on the static arguments; a capture where it returns True
            raises ``RuntimeError(fail_message)``, simulating e.g. a host sync during capture.
        fail_message: Text of the simulated capture error.
    """

    device_type: str | None = None

    def __init__(
        self,
        *,
        available: bool = True,
        fail_when: Callable[[tuple], bool] | None = None,
        fail_message: str = "CUDA error: operation not permitted when stream is capturing",
    ) -> None:
        self._available = available
        self._fail_when = fail_when
        self._fail_message = fail_message
        self.capturing = False
        self.captures = 0
        self.replays = 0
        self.warmup_runs = 0
        self.recoveries = 0
        self.empty_cache_calls = 0

    def available(self) -> bool:
        return self._available

    def is_capturing(self) -> bool:
        return self.capturing

    def resolve_device(self, device: Any, leaves: list) -> Any:
        return device

    def device_guard(self, device: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def new_pool(self, device: Any) -> Any:
        return object()

    def warmup(self, fn: Callable, args: tuple, runs: int, device: Any) -> None:
        for _ in range(runs):
            fn(*args)
        self.warmup_runs += runs

    def capture(self, fn: Callable, args: tuple, pool: Any, device: Any) -> tuple[Any, Any]:
        self.capturing = True
        try:
            if self._fail_when is not None and self._fail_when(args):
                raise RuntimeError(self._fail_message)
            outputs = fn(*args)
        finally:
            self.capturing = False
        self.captures += 1
        return _SimulatedGraph(self, fn, args, outputs), outputs

    def recover(self, device: Any) -> None:
        self.recoveries += 1

    def synchronize(self, device: Any) -> None:
        return None

    def memory_reserved(self, device: Any) -> int:
        return 0

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1
