"""Device and dtype names as the command line and the benchmarks spell them."""

from __future__ import annotations

import torch

from graphtune.errors import ConfigError


def resolve_device(device: str) -> torch.device:
    """``"auto"`` becomes CUDA when available, else CPU; anything else is a torch device name.

    Raises:
        ConfigError: ``device`` is not a device torch knows, or a CUDA device that this torch
            cannot use (no CUDA build, no GPU, or an index past the last GPU).
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(
            f"unknown device {device!r} ({exc}); use auto, cpu, cuda or cuda:N"
        ) from None
    check_device_available(resolved, f"--device {device}", "use --device cpu or auto")
    return resolved


def check_device_available(device: torch.device, what: str, fix: str) -> None:
    """Raises unless this torch can use ``device``: a CUDA device needs a CUDA build, a visible
    GPU and an index below the GPU count (torch itself fails later, deep inside, with an
    AssertionError or RuntimeError).

    Args:
        device: The device to check.
        what: Names the input in the message (``--device cuda``, ``device='cuda'``).
        fix: What to do instead when CUDA is missing.

    Raises:
        ConfigError: One line naming ``what``, what is missing, and ``fix``.
    """
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ConfigError(
            f"{what}: CUDA is not available ({why}, torch {torch.__version__}); {fix}"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(
            f"{what}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``"auto"`` becomes bfloat16 on CUDA and float32 elsewhere; else a torch dtype name.

    Raises:
        ConfigError: ``dtype`` names no torch dtype.
    """
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32")
    return value


#: The dtypes a model's weights, activations and KV cache may have.
MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_model_dtype(dtype: object, what: str = "dtype") -> None:
    """Raises unless ``dtype`` is ``None`` or one of :data:`MODEL_DTYPES` (before anything is
    converted: ``model.to(torch.bool)`` would destroy the weights).

    Raises:
        ConfigError: Another dtype, or not a ``torch.dtype``; the message names ``what``.
    """
    if dtype is not None and dtype not in MODEL_DTYPES:
        names = ", ".join(f"torch.{str(d).removeprefix('torch.')}" for d in MODEL_DTYPES)
        raise ConfigError(f"{what} must be one of {names}, got {dtype!r}")


def as_torch_device(device: torch.device | str | int, what: str = "device") -> torch.device:
    """``torch.device(device)``, checked to be usable here (:func:`check_device_available`).

    Raises:
        ConfigError: A name torch does not know, or a CUDA device this torch cannot use; the
            message names ``what``.
    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"{what} {device!r} is not a device torch knows ({exc}); use 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    check_device_available(resolved, f"{what}={device!r}", f"pass {what}='cpu'")
    return resolved
