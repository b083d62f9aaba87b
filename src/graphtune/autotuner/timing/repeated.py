"""A CUDA graph that runs one captured graph several times over, built without capturing again.

The graph timer needs a replay of about 100 µs, so a 2 µs kernel is captured about 50 times, and
each captured call costs the host the runner's whole launch path (tens of microseconds). A
:class:`RepeatedGraph` captures the calls once, as a piece, and builds an outer graph of ``copies``
child-graph nodes of that piece in a chain through the CUDA runtime
(``cudaGraphAddChildGraphNode``, which clones the piece; ``cudaGraphInstantiate``). On the GPU the
outer graph runs the same kernel nodes with the same arguments as a capture of
``copies * calls`` calls: only the dependency between the last kernel of one copy and the first of
the next is a full one instead of a programmatic one, which costs a kernel with programmatic
dependent launch a fraction of a microsecond once per copy (so a piece is sized to a whole replay,
``GraphTimer(min_piece_us=100)``, and most replays are one piece).

torch exposes the captured graph's handle (``CUDAGraph(keep_graph=True).raw_cuda_graph()``) but no
way to add nodes, so the runtime is called through ``ctypes``: the ``libcudart`` this process has
loaded (torch's), found in ``/proc/self/maps``. Where that is not possible (no such library
mapped, a torch without ``keep_graph``, not Linux) :func:`cuda_runtime` returns ``None`` and the
timer captures every call as before.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from graphtune.errors import CaptureError

logger = logging.getLogger(__name__)

_MAPS = Path("/proc/self/maps")


def _mapped_cudart(maps: Path = _MAPS) -> str | None:
    """Path of the ``libcudart`` shared library mapped into this process, if any."""
    try:
        text = maps.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "/libcudart.so" in path:
            return path
    return None


@functools.cache
def cuda_runtime() -> ctypes.CDLL | None:
    """torch's CUDA runtime library with the graph functions declared, or ``None`` when it cannot
    be used here (the timer then captures every call). Needs CUDA to be initialised (the
    library is mapped once torch has loaded it)."""
    if not torch.cuda.is_available():
        return None
    try:
        torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:  # a torch without keep_graph: no handle to the captured graph
        return None
    path = _mapped_cudart()
    if path is None:
        logger.debug("no libcudart mapped into this process; graphs are captured call by call")
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        logger.debug("could not load %s (%s); graphs are captured call by call", path, exc)
        return None
    handle = ctypes.c_void_p
    handle_p = ctypes.POINTER(handle)
    signatures = {
        "cudaGraphCreate": (handle_p, ctypes.c_uint),
        "cudaGraphAddChildGraphNode": (
            handle_p,
            handle,
            handle_p,
            ctypes.c_size_t,
            handle,
        ),
        "cudaGraphInstantiate": (handle_p, handle, ctypes.c_ulonglong),
        "cudaGraphLaunch": (handle, handle),
        "cudaGraphExecDestroy": (handle,),
        "cudaGraphDestroy": (handle,),
    }
    for name, args in signatures.items():
        fn = getattr(lib, name, None)
        if fn is None:
            return None
        fn.argtypes = args
        fn.restype = ctypes.c_int
    lib.cudaGetErrorString.argtypes = (ctypes.c_int,)
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    return lib


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        message = lib.cudaGetErrorString(code).decode(errors="replace")
        raise CaptureError(
            f"{what} failed with CUDA error {code} ({message}); the graph timer falls back to "
            "capturing every call"
        )


class RepeatedGraph:
    """``copies`` child-graph copies of ``piece`` in a chain, as one executable graph.

    Args:
        piece: A captured graph made with ``keep_graph=True``; it must outlive this object (its
            memory pool holds what the copies read and write), and :meth:`reset` resets it.
        copies: Copies of the piece per replay (>= 1).
        runtime: The library from :func:`cuda_runtime`.

    Raises:
        CaptureError: The runtime refused to build or instantiate the graph (the caller can
            capture the calls directly instead).
    """

    def __init__(self, piece: torch.cuda.CUDAGraph, copies: int, runtime: ctypes.CDLL) -> None:
        self.piece = piece
        self.copies = copies
        self._rt = runtime
        self._graph = ctypes.c_void_p()
        self._exec = ctypes.c_void_p()
        raw = ctypes.c_void_p(int(piece.raw_cuda_graph()))
        _check(runtime, runtime.cudaGraphCreate(ctypes.byref(self._graph), 0), "cudaGraphCreate")
        try:
            previous: ctypes.c_void_p | None = None
            for _ in range(copies):
                node = ctypes.c_void_p()
                deps = (ctypes.c_void_p * 1)(previous) if previous is not None else None
                code = runtime.cudaGraphAddChildGraphNode(
                    ctypes.byref(node), self._graph, deps, 0 if deps is None else 1, raw
                )
                _check(runtime, code, "cudaGraphAddChildGraphNode")
                previous = node
            code = runtime.cudaGraphInstantiate(ctypes.byref(self._exec), self._graph, 0)
            _check(runtime, code, "cudaGraphInstantiate")
        except BaseException:
            self._destroy()
            raise

    def replay(self) -> None:
        """Launches the graph on the current stream."""
        stream = torch.cuda.current_stream().cuda_stream
        _check(self._rt, self._rt.cudaGraphLaunch(self._exec, stream), "cudaGraphLaunch")

    def reset(self, *, keep_piece: bool = False) -> None:
        """Frees the outer graph and resets the piece, unless ``keep_piece`` (to build another
        :class:`RepeatedGraph` of it); idempotent."""
        self._destroy()
        if not keep_piece:
            self.piece.reset()

    def _destroy(self) -> None:
        if self._exec.value:
            self._rt.cudaGraphExecDestroy(self._exec)
            self._exec = ctypes.c_void_p()
        if self._graph.value:
            self._rt.cudaGraphDestroy(self._graph)
            self._graph = ctypes.c_void_p()
