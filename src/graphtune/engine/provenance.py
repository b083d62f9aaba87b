"""Provenance of a benchmark result: device, versions and source commit.

The library cannot import ``benchmarks/`` (it is not installed), so the engine's benchmark carries
this small helper itself.
"""

from __future__ import annotations

import logging
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from graphtune import env
from graphtune._version import __version__

logger = logging.getLogger(__name__)


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    """The source commit: ``GRAPHTUNE_COMMIT``, else ``git rev-parse HEAD``, else ``"unknown"``."""
    named = env.source_commit()
    if named:
        return named
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else "unknown"


def provenance(device: torch.device | str | None = None) -> dict[str, Any]:
    """Describes where a result was measured.

    Args:
        device: The device measured on (CUDA fields are filled when it is a CUDA device).

    Returns:
        GPU name and compute capability (or ``None``), torch / CUDA / Triton / transformers /
        graphtune versions, Python version, platform and the source commit.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    info: dict[str, Any] = {
        "device": str(device),
        "gpu_name": None,
        "compute_capability": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _package_version("triton"),
        "transformers": _package_version("transformers"),
        "graphtune": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": git_commit(),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        info["gpu_name"] = props.name
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return info
