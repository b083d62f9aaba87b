"""The graph runner: one object that owns every CUDA graph of a step callable.

See docs/graph-runner.md for the user guide. Public names:

* :class:`CUDAGraphRunner`, :class:`EagerRunner` (same call interface), :class:`RunnerState`.
* :func:`graph_break`: marks a part of the step that runs eagerly between captured pieces.
* :class:`CapturePolicy`: serving switches (padding off, capture after ``freeze()``, output
  memory sharing).
* :class:`FallbackReason`: why a call ran eagerly; counted in :class:`RunnerStats`.
* :class:`RunnerStats` (alias :data:`GraphRunnerStats`), :class:`CaptureRecord`,
  :class:`CapturedGraph`.
* :func:`default_capture_sizes`, :func:`validate_capture_sizes`, :func:`padded_size`.
* Backends: :class:`CudaGraphBackend` (real), :class:`SimulatedGraphBackend` (no CUDA, for tests).

This package imports nothing from graphtune.autotuner, engine, ops or cli.
"""

from graphtune.graphs.backend import CudaGraphBackend, GraphBackend
from graphtune.graphs.breaks import graph_break
from graphtune.graphs.capture import CapturedGraph, CaptureRecord
from graphtune.graphs.eager import EagerRunner
from graphtune.graphs.padding import PAD_RULES, PadRule
from graphtune.graphs.policy import (
    CapturePolicy,
    FallbackReason,
    default_capture_sizes,
    padded_size,
    validate_capture_sizes,
)
from graphtune.graphs.runner import CUDAGraphRunner, RunnerState
from graphtune.graphs.simulated import SimulatedGraphBackend
from graphtune.graphs.stats import GraphRunnerStats, RunnerStats

__all__ = [
    "PAD_RULES",
    "CUDAGraphRunner",
    "CapturePolicy",
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
    "graph_break",
    "padded_size",
    "validate_capture_sizes",
]
