"""Argument checks shared by the timers."""

from __future__ import annotations

import torch

from graphtune.errors import ConfigError


def check_counts(who: str, *, warmup: int, repeat: int) -> None:
    """Raises ConfigError unless ``warmup >= 0`` and ``repeat >= 1`` are integers."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"{who}: warmup must be an integer >= 0, got {warmup!r}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ConfigError(f"{who}: repeat must be an integer >= 1, got {repeat!r}")


def as_device(device: torch.device | str | int | None) -> torch.device | None:
    """Normalises a device argument (``None`` stays ``None``; an int means ``cuda:<int>``)."""
    if device is None or isinstance(device, torch.device):
        return device
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def require_cuda(who: str, device: torch.device | str | int | None) -> torch.device:
    """Returns the CUDA device to time on, or raises ConfigError naming the rule and remedies.

    Args:
        who: Name of the timer, for the message.
        device: Requested device; ``None`` means the current CUDA device.

    Raises:
        ConfigError: CUDA is not available, or ``device`` is not a CUDA device.
    """
    resolved = as_device(device)
    if resolved is not None and resolved.type != "cuda":
        raise ConfigError(
            f"{who} times CUDA work but was given device {resolved}; "
            "use timing='wallclock' (or 'auto') for CPU tensors"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            f"{who} needs a CUDA device but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
            "use timing='wallclock' (or 'auto', which picks wallclock without CUDA)"
        )
    if resolved is None or resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return resolved
