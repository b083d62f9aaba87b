"""Argument checks shared by the timers."""

from __future__ import annotations

import math
from numbers import Real

import torch

from graphtune.errors import ConfigError
from graphtune.finite_json import brief


def check_counts(who: str, *, warmup: int, repeat: int) -> None:
    """Raises ConfigError unless ``warmup >= 0`` and ``repeat >= 1`` are integers."""
    check_int(who, "warmup", warmup, minimum=0, default=3)
    check_int(who, "repeat", repeat, minimum=1, default=10)


def check_int(who: str, name: str, value: object, *, minimum: int, default: object) -> None:
    """Raises ConfigError unless ``value`` is an int (not a bool) ``>= minimum``.

    A float or ``None`` count would otherwise pass the constructor and fail much later (after
    real captures) inside ``range()`` or a comparison, with a bare traceback."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"{who}: {name} must be an integer >= {minimum}, got {brief(value)}; "
            f"pass a whole number such as {default!r}"
        )


def check_number(
    who: str, name: str, value: object, *, above: float, default: object, inclusive: bool = False
) -> None:
    """Raises ConfigError unless ``value`` is a finite real number ``> above`` (``>=`` with
    ``inclusive``); bools and strings are refused.

    ``nan`` passes every ``<=`` test and ``inf`` overflows ``math.ceil`` in the sizing rules, so
    both are refused here rather than after real captures. An int (or other real) too large for
    a float counts as infinite: ``float(10**400)`` raises ``OverflowError``."""
    number = math.nan
    if isinstance(value, Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            number = -math.inf if value < 0 else math.inf
    if not (math.isfinite(number) and (number >= above if inclusive else number > above)):
        rule = ">=" if inclusive else ">"
        raise ConfigError(
            f"{who}: {name} must be a finite number {rule} {above:g}, got {brief(value)}; "
            f"pass a number such as {default!r}"
        )


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
