"""The environment a tuning result is valid for (docs/design.md, principle 6: results carry
their provenance).

Picks measured on one GPU model, compute capability or software stack are not trusted on
another, so every cache file records these fields and a file whose fields differ is skipped.
"""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

import torch

from graphtune._version import __version__

FINGERPRINT_FIELDS = ("gpu", "compute_capability", "torch", "cuda", "triton", "graphtune")


@functools.lru_cache(maxsize=1)
def _triton_version() -> str | None:
    # The installed distribution's metadata instead of importing triton: importing it is slow and
    # can initialise CUDA, and graphtune must stay side-effect free. Read once per process, since
    # scanning the installed distributions costs milliseconds on every cache load.
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


def environment_fingerprint() -> dict[str, Any]:
    """Describes the current environment.

    Returns:
        ``gpu`` (device name of the current CUDA device, or ``"cpu"``), ``compute_capability``
        (``"9.0"``, or ``None`` on CPU), ``torch``, ``cuda`` (``torch.version.cuda``, ``None`` on a
        CPU build), ``triton`` (``None`` when not installed) and ``graphtune`` versions.
    """
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        gpu = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        capability: str | None = f"{major}.{minor}"
    else:
        gpu, capability = "cpu", None
    return {
        "gpu": gpu,
        "compute_capability": capability,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _triton_version(),
        "graphtune": __version__,
    }


def fingerprint_mismatch(saved: Any, current: dict[str, Any]) -> list[str]:
    """Human-readable differences, e.g. ``["gpu: 'NVIDIA A100' (file) vs 'NVIDIA H200' (here)"]``.

    An empty list means the file's environment matches this one.
    """
    if not isinstance(saved, dict):
        return [f"fingerprint is {type(saved).__name__}, expected an object"]
    return [
        f"{name}: {saved.get(name)!r} (file) vs {current.get(name)!r} (here)"
        for name in FINGERPRINT_FIELDS
        if saved.get(name) != current.get(name)
    ]
