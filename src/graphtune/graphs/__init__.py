"""The graph runner: one object that owns every CUDA graph of a step callable.

See docs/graph-runner.md for the user guide. Public names:

* :class:`CUDAGraphRunner`, :class:`EagerRunner` (same call interface), :class:`RunnerState`.
* :class:`FallbackReason`: why a call ran eagerly; counted in :class:`RunnerStats`.
* :class:`RunnerStats` (alias :data:`GraphRunnerStats`), :class:`CaptureRecord`,
  :class:`CapturedGraph`.
* :func:`default_capture_sizes`, :func:`validate_capture_sizes`, :func:`padded_size`.
* Backends: :class:`CudaGraphBackend` (real), :class:`SimulatedGraphBackend` (no CUDA, for tests).

This package imports nothing from graphtune.autotuner, engine, ops or cli.
"""

from graphtune.graphs.backend import CudaGraphBackend, GraphBackend, SimulatedGraphBackend
from graphtune.graphs.buffers import PAD_RULES, PadRule
from graphtune.graphs.capture import CapturedGraph, CaptureRecord
from graphtune.graphs.policy import (
    FallbackReason,
    default_capture_sizes,
    padded_size,
    validate_capture_sizes,
)
from graphtune.graphs.runner import CUDAGraphRunner, EagerRunner, RunnerState
from graphtune.graphs.stats import GraphRunnerStats, RunnerStats

__all__ = [
    "PAD_RULES",
    "CUDAGraphRunner",
    "CaptureRecord",
    "CapturedGraph",
    "CudaGraphBackend",
    "EagerRunner",
    "FallbackReason",
    "GraphBackend",
    "GraphRunnerStats",
    "PadRule",
    "RunnerState",
    "RunnerStats",
    "SimulatedGraphBackend",
    "default_capture_sizes",
    "padded_size",
    "validate_capture_sizes",
]
