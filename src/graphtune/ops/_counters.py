"""The persistent arrival counters of kernels that merge their own splits.

A kernel that splits its work over several programs and merges the partials itself (decode
attention's one-kernel runner, a split-K launch of the fused GEMV) gives each output tile a
counter: every program adds one after storing its partial, the program that arrives last merges
the partials in split order and sets the counter back to zero. The counters must therefore be
zero when a launch starts: they live in one zero-filled int32 buffer per device, made at the first
eager call and never grown, so no capture ever makes it (a buffer made during a capture would be
filled only at the graph's first replay) and graphs keep valid addresses.

Kernels sharing the buffer must not run at the same time: the kernels of one stream satisfy that,
with programmatic dependent launch too, because each touches its counters only after
``gdc_wait()``; concurrent launches on several streams of one device do not.
"""

from __future__ import annotations

import threading

import torch

from graphtune.errors import ConfigError, InputError

COUNTERS = 1 << 16
"""Counters per device (256 KiB)."""

_lock = threading.Lock()
_buffers: dict[str, torch.Tensor] = {}


def split_fits(count: int) -> bool:
    """Whether a split launch that needs ``count`` arrival counters fits the device's buffer.

    A bucket's pick serves every larger size mapped to it (all sizes past a capped bucket), so a
    split tactic tuned on few rows can meet a launch with more output tiles than counters. The
    split runners then launch the same tiles unsplit: the same result up to the order of the
    float32 sums, where :func:`arrival_counters` would refuse the launch.
    """
    return count <= COUNTERS


def arrival_counters(device: torch.device, count: int, *, user: str, fix: str) -> torch.Tensor:
    """The zeroed counters of ``device`` (at least ``count`` of them).

    Args:
        device: Where the kernel runs.
        count: Counters the launch uses.
        user: Who asks, for the error messages (say, a runner's name).
        fix: What to do instead when ``count`` exceeds :data:`COUNTERS`.

    Raises:
        InputError: ``count`` exceeds :data:`COUNTERS`.
        ConfigError: The buffer would have to be made during a CUDA graph capture.
    """
    if count > COUNTERS:
        raise InputError(
            f"{user}: the launch needs {count} arrival counters, more than the {COUNTERS} a "
            f"device has; {fix}."
        )
    key = str(device)
    with _lock:
        found = _buffers.get(key)
        if found is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ConfigError(
                    f"{user}: the arrival counters on {device} must exist before a CUDA graph "
                    "captures the launch; run the op once outside the capture first (graphtune's "
                    "graph runner and tuner warm up eagerly)."
                )
            found = _buffers[key] = torch.zeros(COUNTERS, device=device, dtype=torch.int32)
        return found
