"""Helpers shared by the benchmark scripts: provenance, CUPTI kernel time, JSON results.

Import from a script in ``benchmarks/`` with ``import _common`` (the scripts put their own
directory on ``sys.path``). Importing this module needs torch but no GPU and has no side effects.

* :func:`provenance` — where a result came from: GPU name, compute capability, L2 size, torch /
  CUDA / Triton / graphtune versions, git commit, command line, UTC time.
* :func:`cupti_kernel_time` — ground truth for a callable's GPU time: the device-side durations
  of its kernels recorded by CUPTI through ``torch.profiler``, summed per call, median over calls.
* :func:`write_json` — writes a result file atomically, with non-finite floats as ``null``.
* :func:`gpu_slug`, :func:`require_cuda_or_exit`, :func:`median`.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Trace categories that are device work: kernels, and memset/memcpy the op itself issues.
DEVICE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
#: Environment variables that may carry the commit when the checkout has no ``.git``.
COMMIT_ENV_VARS = ("GRAPHTUNE_COMMIT", "GIT_COMMIT", "GITHUB_SHA")


# --- environment -------------------------------------------------------------------------------


def require_cuda_or_exit(script: str) -> torch.device:
    """Returns the current CUDA device, or prints why not and exits with status 2."""
    if not torch.cuda.is_available():
        print(
            f"{script}: needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). Run it on the GPU "
            "machine: PYTHONPATH=src python3 benchmarks/<script>.py --out DIR",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return torch.device("cuda", torch.cuda.current_device())


def gpu_slug(name: str) -> str:
    """File-name friendly GPU name: ``"NVIDIA H200"`` -> ``"h200"``."""
    text = re.sub(r"^\s*nvidia\s+", "", name, flags=re.IGNORECASE).lower()
    text = re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    return text or "unknown"


def git_commit(explicit: str | None = None) -> str:
    """The commit a result belongs to.

    Order: ``explicit`` (for example a ``--commit`` flag), then the environment variables in
    :data:`COMMIT_ENV_VARS` (the device copy of the tree may lack ``.git``), then
    ``git rev-parse HEAD`` in the repository (with ``-dirty`` when the tree has local changes),
    then ``"unknown"``.
    """
    if explicit:
        return explicit
    for name in COMMIT_ENV_VARS:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if head and dirty else (head or "unknown")


def _package_version(module: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8 only
        return None
    try:
        return version(module)
    except PackageNotFoundError:
        return None


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", None) or _package_version("triton")


def _graphtune_version() -> str:
    try:
        from graphtune._version import __version__
    except ImportError:
        return _package_version("graphtune") or "unknown"
    return __version__


def provenance(commit: str | None = None, device: torch.device | None = None) -> dict[str, Any]:
    """Describes the machine and software a result was measured with.

    Args:
        commit: Commit to record (see :func:`git_commit` for the fallbacks).
        device: CUDA device (default: the current one when CUDA is available).

    Returns:
        A JSON-serialisable dict. GPU fields are ``None`` without CUDA.
    """
    info: dict[str, Any] = {
        "gpu": None,
        "gpu_slug": None,
        "compute_capability": None,
        "sm_count": None,
        "l2_cache_bytes": None,
        "total_memory_bytes": None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "triton": _triton_version(),
        "graphtune": _graphtune_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": git_commit(commit),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        index = device.index if device is not None and device.index is not None else None
        index = torch.cuda.current_device() if index is None else index
        props = torch.cuda.get_device_properties(index)
        info.update(
            gpu=props.name,
            gpu_slug=gpu_slug(props.name),
            compute_capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            l2_cache_bytes=getattr(props, "L2_cache_size", None),
            total_memory_bytes=props.total_memory,
        )
    return info


# --- CUPTI kernel time -------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceEvent:
    """One device-side activity from a profiler trace (times in microseconds)."""

    name: str
    category: str
    start_us: float
    duration_us: float


@dataclass(frozen=True)
class KernelTime:
    """Device time of one call by CUPTI.

    Attributes:
        per_call_us: Median over calls of the summed device durations of one call.
        samples_us: Per-call sums, in call order.
        kernels_per_call: Device activities per call, or ``None`` when the recorded count was not
            a multiple of the calls (then every sample is the total divided by the calls).
        kernel_names: Names of the activities of one call (the first call).
        calls: Profiled calls.
    """

    per_call_us: float
    samples_us: list[float]
    kernels_per_call: int | None
    kernel_names: list[str] = field(default_factory=list)
    calls: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (without the per-call samples)."""
        return {
            "per_call_us": self.per_call_us,
            "min_us": min(self.samples_us) if self.samples_us else None,
            "kernels_per_call": self.kernels_per_call,
            "kernel_names": self.kernel_names,
            "calls": self.calls,
        }


def device_events_from_trace(
    trace: dict[str, Any], categories: Sequence[str] = DEVICE_CATEGORIES
) -> list[DeviceEvent]:
    """Device activities of a Chrome trace (as ``torch.profiler`` exports it), by start time."""
    wanted = set(categories)
    events = [
        DeviceEvent(
            name=str(event.get("name", "")),
            category=str(event["cat"]),
            start_us=float(event.get("ts", 0.0)),
            duration_us=float(event["dur"]),
        )
        for event in trace.get("traceEvents", [])
        if isinstance(event, dict)
        and event.get("ph") == "X"
        and event.get("cat") in wanted
        and "dur" in event
    ]
    events.sort(key=lambda e: e.start_us)
    return events


def group_per_call(events: Sequence[DeviceEvent], calls: int) -> tuple[list[float], int | None]:
    """Splits device events in call order into per-call sums.

    Returns:
        ``(per_call_us, events_per_call)``. When the event count is not a multiple of ``calls``
        (a lost or extra activity), every call gets the total divided by ``calls`` and the
        second element is ``None``.
    """
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    total = sum(e.duration_us for e in events)
    if not events or len(events) % calls:
        return [total / calls] * calls, None
    size = len(events) // calls
    sums = [sum(e.duration_us for e in events[k * size : (k + 1) * size]) for k in range(calls)]
    return sums, size


def _profile_trace(fn: Callable[[int], object], first: int, calls: int, with_cpu: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA]
    if with_cpu:
        activities.insert(0, ProfilerActivity.CPU)
    with profile(activities=activities) as prof:
        for i in range(calls):
            fn(first + i)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def cupti_kernel_time(
    fn: Callable[[int], object],
    *,
    calls: int = 50,
    warmup: int = 5,
    categories: Sequence[str] = DEVICE_CATEGORIES,
) -> KernelTime:
    """Measures the device time of ``fn(i)`` from CUPTI kernel durations.

    Runs ``warmup`` unprofiled calls, then profiles ``calls`` eager calls with
    ``torch.profiler`` (``ProfilerActivity.CUDA``), reads the device activities from the exported
    trace, groups them per call in launch order and returns the median of the per-call sums.
    Device durations do not include host launch gaps, so this is the ground truth the timers
    are compared with. Call it with the same inputs (same cache state) as the timers.

    Raises:
        RuntimeError: The profiler recorded no device activity (CUPTI unavailable).
    """
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    events = device_events_from_trace(_profile_trace(fn, warmup, calls, False), categories)
    if not events:
        # Some builds only export device activity when CPU activity is traced too.
        events = device_events_from_trace(_profile_trace(fn, warmup, calls, True), categories)
    if not events:
        raise RuntimeError(
            "torch.profiler recorded no device kernels; is CUPTI available to this process "
            "(another profiler attached, or a build without kineto)?"
        )
    samples, per_call = group_per_call(events, calls)
    if per_call is None:
        logger.warning(
            "CUPTI: %d device activities for %d calls is not a multiple; using total / calls",
            len(events),
            calls,
        )
    names = [e.name for e in events[: per_call or 0]]
    return KernelTime(
        per_call_us=statistics.median(samples),
        samples_us=samples,
        kernels_per_call=per_call,
        kernel_names=names,
        calls=calls,
    )


# --- results -----------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return statistics.median(values)


def _sanitize(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no inf/nan
    if isinstance(value, dict):
        return {str(k): _sanitize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_sanitize(v) for v in value]
    return value


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Writes ``payload`` as indented JSON atomically (temp file + rename); returns the path.

    Non-finite floats become ``null``; values JSON cannot represent are written with ``str``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_sanitize(payload), indent=2, sort_keys=False, default=str) + "\n"
    with tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False
    ) as handle:
        handle.write(text)
        temp = Path(handle.name)
    os.replace(temp, path)
    return path
