"""The measurement toolkit: timing on the library's own timers, CUPTI truths, provenance, results.

Benchmark scripts (``benchmarks/``) and ``graphtune bench decode`` measure with these, so every
number is taken the same way and every result file carries the same provenance record:

* :mod:`~graphtune.bench.timing` — per-call time of a callable (:func:`time_per_call_ms`, on
  ``EventTimer`` / ``WallClockTimer``), device copy bandwidth, the bytes floor, the host's speed
  (:func:`host_speed`, recorded beside host-bound results);
* :mod:`~graphtune.bench.cupti` — device time from CUPTI: kernel sums per call
  (:func:`cupti_kernel_time`), GPU-busy time and top kernels (:func:`gpu_busy`), trace parsing;
* :mod:`~graphtune.bench.cupti_graph` — the in-graph truth (:func:`cupti_graph_time`);
* :mod:`~graphtune.bench.timeline` — one graph replay kernel by kernel: what each kernel adds to
  the step with PDL's overlap counted (imported on its own);
* :mod:`~graphtune.bench.graphs` — capturing back-to-back calls into one CUDA graph;
* :mod:`~graphtune.bench.schema` — the one versioned provenance schema (:func:`provenance`);
* :mod:`~graphtune.bench.results` — the atomic results writer (:func:`write_json`);
* :mod:`~graphtune.bench.decode` — the decode benchmark, built from the engine's own factories
  (imported on its own: ``from graphtune.bench.decode import run_decode_bench``).

This package sits above the engine (it imports engine, ops, graphs and autotuner; nothing in the
library imports it). Importing it needs torch but no GPU.
"""

from graphtune.bench.cuda import require_cuda_or_exit
from graphtune.bench.cupti import (
    DEVICE_CATEGORIES,
    BusyTime,
    DeviceEvent,
    KernelTime,
    cupti_kernel_time,
    device_events_from_trace,
    gpu_busy,
    group_per_call,
    top_kernels,
)
from graphtune.bench.cupti_graph import (
    GraphKernelTime,
    cupti_graph_time,
    graph_calls_for,
    replay_spans,
    split_replays,
)
from graphtune.bench.graphs import capture_calls, release
from graphtune.bench.results import json_safe, write_json
from graphtune.bench.schema import SCHEMA, git_commit, gpu_slug, provenance
from graphtune.bench.timing import (
    bytes_floor_ms,
    call_timer,
    copy_bandwidth_gbps,
    host_speed,
    sync,
    time_per_call_ms,
)

__all__ = [
    "DEVICE_CATEGORIES",
    "SCHEMA",
    "BusyTime",
    "DeviceEvent",
    "GraphKernelTime",
    "KernelTime",
    "bytes_floor_ms",
    "call_timer",
    "capture_calls",
    "copy_bandwidth_gbps",
    "cupti_graph_time",
    "cupti_kernel_time",
    "device_events_from_trace",
    "git_commit",
    "gpu_busy",
    "gpu_slug",
    "graph_calls_for",
    "group_per_call",
    "host_speed",
    "json_safe",
    "provenance",
    "release",
    "replay_spans",
    "require_cuda_or_exit",
    "split_replays",
    "sync",
    "time_per_call_ms",
    "top_kernels",
    "write_json",
]
