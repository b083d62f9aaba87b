"""Capturing a callable into a CUDA graph for measurement: the ``torch.cuda.graphs`` recipe once.

The library's graph runner (``graphtune.graphs``) and graph timer (``graphtune.autotuner.timing``)
capture for serving and tuning; benchmarks that need a bare graph of back-to-back calls (the
in-graph CUPTI truth, the all-reduce latency, a one-call reference timer) use
:func:`capture_calls` and :func:`release`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# One side stream per device for every capture: a fresh stream per measurement would make torch
# set up (and keep) a new cuBLAS workspace for each one.
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """The side stream captures of the current device run on (made once per device)."""
    index = torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = torch.cuda.Stream(device=index)
        _CAPTURE_STREAMS[index] = stream
    return stream


def capture_calls(
    fn: Callable[[int], object],
    calls: int,
    *,
    warmup: int = 1,
    stream: torch.cuda.Stream | None = None,
) -> torch.cuda.CUDAGraph:
    """One CUDA graph holding ``calls`` back-to-back calls of ``fn(i)``.

    ``max(1, warmup)`` calls ``fn(0) ..`` run first on the capture stream (lazy initialisation
    such as cuBLAS workspaces must happen before capture, on the capturing stream), then
    ``fn(warmup) .. fn(warmup + calls - 1)`` are captured on it with a private memory pool. The
    stream waits for the caller's work first (the inputs may have been written there) and the
    caller waits for the warm-up. Replay the graph on ``stream`` and :func:`release` it.

    Raises:
        ValueError: ``calls < 1``.
        RuntimeError: The capture failed (the graph is reset before the error propagates).
    """
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    caller = torch.cuda.current_stream()
    stream = stream if stream is not None else capture_stream()
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        for i in range(max(1, warmup)):
            fn(i)
    caller.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(), stream=stream):
            for i in range(calls):
                fn(warmup + i)
    except BaseException:
        release(graph)
        raise
    return graph


def release(graph: torch.cuda.CUDAGraph) -> None:
    """Frees ``graph`` and its hold on its private pool (a failed capture may hold nothing)."""
    try:
        graph.reset()
    except RuntimeError as exc:
        logger.debug("graph.reset() failed: %s", exc)
