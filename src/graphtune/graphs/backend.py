"""Graph backends: the only code of the graph runner that talks to CUDA graphs.

:class:`CudaGraphBackend` is the real one (``torch.cuda.CUDAGraph``). The simulated backend
(:mod:`graphtune.graphs.simulated`) runs the runner's whole logic without CUDA; CPU tests use it,
GPU tests use this one.

Capture calls ``CUDAGraph.capture_begin``/``capture_end`` directly instead of the
``torch.cuda.graph`` context manager: its ``__enter__`` synchronises the device and empties the
allocator's caches (device and pinned host) before *every* capture, which the runner does not
need. Nothing has to be freed for the pool (pool memory is reserved by the pool itself), the
capture stream waits for the caller's stream by an event instead of a device-wide
synchronisation, and pool growth is read from allocator statistics without emptying the cache
(see :class:`~graphtune.graphs.breaks.PieceCapture`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from graphtune.cuda_memory import reserved_bytes

logger = logging.getLogger(__name__)


class GraphBackend(Protocol):
    """What the runner needs from a graph implementation.

    A key is captured inside ``capture_context(device, args)`` as one or more pieces, each
    between ``begin_capture`` and ``end_capture`` (pieces are separated by graph breaks, which
    run eagerly after ``execute`` ran the piece before them). ``share_memory`` tells the backend
    that the runner no longer owns the given storages (non-owning twins of graph outputs and break
    inputs), so the pool may reuse their memory for other graphs; ``invalidate`` makes reading
    such storages fail (or at least not look valid) after ``release()``. ``hold_slack``, called
    right after the first ``begin_capture`` of a key, allocates spare memory from the pool being
    captured into (an object to drop after the capture; see ``CapturePolicy.pool_slack_bytes``).
    ``capture_computes`` says whether a capture also computes the captured call (a simulation
    that runs the code while recording) or, as CUDA capture, only records it; such a backend's
    ``discard_capture`` undoes what the last capture wrote to memory that existed before it and
    that no ``execute`` ran (the runner calls it for a lazy capture it cannot use, which on CUDA
    computed nothing, before running the call eagerly).
    """

    device_type: str | None
    capture_computes: bool

    def available(self) -> bool: ...

    def is_capturing(self) -> bool: ...

    def resolve_device(self, device: Any, leaves: list) -> Any: ...

    def device_guard(self, device: Any) -> contextlib.AbstractContextManager: ...

    def new_pool(self, device: Any) -> Any: ...

    def warmup(self, fn: Callable, args: tuple, runs: int, device: Any) -> None: ...

    def capture_context(
        self, device: Any, args: tuple
    ) -> contextlib.AbstractContextManager[None]: ...

    def begin_capture(self, pool: Any, device: Any) -> Any: ...

    def end_capture(self, graph: Any) -> None: ...

    def abort_capture(self, graph: Any, device: Any) -> None: ...

    def execute(self, graph: Any) -> None: ...

    def hold_slack(self, device: Any, nbytes: int) -> Any: ...

    def share_memory(self, pool: Any, graphs: Sequence[Any], storages: Sequence[Any]) -> None: ...

    def can_invalidate(self) -> bool: ...

    def invalidate(self, storages: Sequence[Any], message: str) -> None: ...

    def recover(self, device: Any) -> None: ...

    def discard_capture(self, device: Any) -> None: ...

    def synchronize(self, device: Any) -> None: ...

    def memory_reserved(self, device: Any) -> int: ...

    def empty_cache(self) -> None: ...


class CudaGraphBackend:
    """CUDA graphs through ``torch.cuda.CUDAGraph`` (``capture_begin``/``capture_end``).

    Warm-up and capture run on one side stream per device, shared by every runner in the process:
    PyTorch gives each (cuBLAS handle, stream) pair its own workspace, allocated on first use and
    never freed. Warming up on the capture stream makes that allocation happen outside the
    capture (inside it would land in the graph pool and pin it), and sharing the stream keeps it
    to one workspace per device instead of one per runner.
    """

    device_type: str | None = "cuda"
    capture_computes = False

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

    @contextlib.contextmanager
    def capture_context(self, device: torch.device, args: tuple) -> Iterator[None]:
        """Runs the block on the capture stream, ordered after the caller's stream's work."""
        stream = self.stream(device)
        previous = torch.cuda.current_stream(device)
        stream.wait_stream(previous)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            # A step that switched streams and failed must not leave later work on another stream.
            if torch.cuda.current_stream(device) != previous:
                torch.cuda.set_stream(previous)
            with torch.cuda.stream(stream):
                stuck = torch.cuda.is_current_stream_capturing()
            if not stuck:
                # Pieces run at graph breaks executed on the capture stream.
                previous.wait_stream(stream)

    def begin_capture(self, pool: Any, device: torch.device) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool)
        return graph

    def end_capture(self, graph: torch.cuda.CUDAGraph) -> None:
        with warnings.catch_warnings():
            # A piece between two adjacent breaks may hold no kernel; that is not an error here.
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            graph.capture_end()

    def abort_capture(self, graph: torch.cuda.CUDAGraph, device: torch.device) -> None:
        _end_stuck_capture(graph, self.stream(device))

    def execute(self, graph: torch.cuda.CUDAGraph) -> None:
        graph.replay()

    def hold_slack(self, device: torch.device, nbytes: int) -> torch.Tensor | None:
        # Allocating during the capture takes the memory from the graph's pool and launches no
        # kernel, so the graph itself is unchanged.
        return torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes > 0 else None

    def share_memory(self, pool: Any, graphs: Sequence[Any], storages: Sequence[Any]) -> None:
        # The caching allocator returns a block to its pool when the last owning tensor is
        # dropped; the runner has dropped its own, so there is nothing to tell it.
        return None

    def can_invalidate(self) -> bool:
        return hasattr(torch._C, "_set_storage_data_ptr_access_error_msg")

    def invalidate(self, storages: Sequence[Any], message: str) -> None:
        # Every view of a storage shares its StorageImpl, so each view a caller kept now raises
        # RuntimeError(message) on access instead of reading memory the device got back.
        poison = torch._C._set_storage_data_ptr_access_error_msg
        for storage in storages:
            poison(storage._cdata, message)

    def discard_capture(self, device: torch.device) -> None:
        return None  # a CUDA capture records its kernels without running them

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
        return reserved_bytes(device)  # read twice per captured piece: the cheap way

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def _end_stuck_capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    """Ends a capture that the failing code left open (``fn`` raised under capture, or switched
    streams and never switched back). An open capture in the default "global" mode makes every
    later allocation in the process fail."""
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
