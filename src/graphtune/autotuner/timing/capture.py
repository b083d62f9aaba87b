"""Capturing the graph timer's back-to-back calls into one CUDA graph, and freeing such a graph.

Kept apart from :mod:`graphtune.autotuner.timing.graph`, which decides how many calls to capture
and how to replay them; this module only does the capture and turns a failure into one clear
:class:`~graphtune.errors.CaptureError`.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from graphtune.errors import CaptureError

logger = logging.getLogger(__name__)


def capture_calls(
    fn: Callable[[int], object],
    counter: Iterator[int],
    calls: int,
    stream: torch.cuda.Stream,
    device: torch.device,
    *,
    keep: bool = False,
    error_mode: str = "global",
) -> torch.cuda.CUDAGraph:
    """Captures ``fn(next(counter))`` ``calls`` times on ``stream`` into a new graph with its own
    memory pool.

    Args:
        keep: Keep the captured graph's handle (``CUDAGraph(keep_graph=True)``), to build a
            :class:`~graphtune.autotuner.timing.repeated.RepeatedGraph` of it.
        error_mode: ``capture_error_mode`` of ``CUDAGraph.capture_begin``.

    Raises:
        CaptureError: A call or the capture itself failed (the graph is released first).
    """
    graph = torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()
    # Pending work of other streams must not race the capture (torch.cuda.graph does the same).
    torch.cuda.synchronize(device)
    # A garbage collection during capture could free tensors of other streams mid-capture;
    # pausing it is cheaper than the full gc.collect() torch.cuda.graph may run.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    failure: BaseException | None = None
    try:
        with torch.cuda.stream(stream):
            try:
                graph.capture_begin(capture_error_mode=error_mode)
            except RuntimeError as exc:
                failure = exc
            else:
                try:
                    for _ in range(calls):
                        fn(next(counter))
                except BaseException as exc:  # noqa: B036 - capture must be ended first
                    failure = exc
                try:
                    # Always end the capture, or the stream stays in capture mode for good.
                    graph.capture_end()
                except RuntimeError as end_exc:
                    if failure is None:
                        failure = end_exc
                    else:
                        logger.debug("GraphTimer: capture_end after a failed call: %s", end_exc)
    finally:
        if gc_was_enabled:
            gc.enable()
    if failure is not None:
        release_graph(graph)
        if not isinstance(failure, Exception):  # KeyboardInterrupt, SystemExit: not data
            raise failure
        raise CaptureError(
            f"GraphTimer could not capture {calls} calls in a CUDA graph: "
            f"{type(failure).__name__}: {_first_line(failure)}. Rule: a timed call must not "
            "synchronize with the host (.item(), .cpu(), .tolist(), printing a CUDA tensor, "
            "torch.cuda.synchronize), use pageable host copies, or run ops that are not "
            "capturable. Remedies: remove the host sync from the runner, mark the tactic "
            "invalid for graph timing, or tune this op with timing='events'."
        ) from failure
    return graph


def release_graph(graph: Any) -> None:
    """Frees a timing graph's executable and its hold on its private memory pool."""
    try:
        graph.reset()
    except RuntimeError as exc:  # a graph whose capture failed may have nothing to reset
        logger.debug("GraphTimer: graph.reset() failed: %s", exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"
