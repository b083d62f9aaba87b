"""Exception types of graphtune.

Every error states the rule that was broken and what to do about it. Each subclass also derives
from the built-in exception a caller would naturally catch (``ValueError`` for bad configuration,
``RuntimeError`` for failures at run time), so generic handlers keep working.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class GraphtuneError(Exception):
    """Base class of every error raised by graphtune."""


class ConfigError(GraphtuneError, ValueError):
    """A configuration value or argument breaks a documented rule."""


class InputError(GraphtuneError, ValueError):
    """A call received inputs that do not match what was captured, tuned or allocated."""


class TuningError(GraphtuneError, RuntimeError):
    """Autotuning could not proceed (not raised for a single failing tactic: that is data)."""


class CacheFileError(GraphtuneError, RuntimeError):
    """A tuning cache file is corrupt, from another environment, or could not be written."""


class CaptureError(GraphtuneError, RuntimeError):
    """A CUDA graph could not be captured for a key."""


class CheckpointError(GraphtuneError, ValueError):
    """A model checkpoint is missing a tensor, has a wrong shape, or an unsupported architecture."""


class NumericalError(GraphtuneError, RuntimeError):
    """A model produced non-finite values (NaN or infinity) where a result was expected."""


class DistributedError(GraphtuneError, RuntimeError):
    """Ranks disagree or a collective could not be completed."""


class ResultsWriteError(GraphtuneError, OSError):
    """A benchmark result could be written neither where asked nor to the temporary folder."""


def add_context_note(exc: BaseException, note: str) -> None:
    """Adds ``note`` (which user callback failed, on what) to ``exc``'s traceback text where
    Python supports notes (3.11+); the exception keeps its type and message."""
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(note)


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__


def wrong_device_error(
    op: str, like: str, device: Any, named: Iterable[tuple[str, Any]]
) -> InputError:
    """The error of an op whose operands are not all on ``like``'s ``device``: names the first
    operand in ``named`` (``(name, tensor or None)`` pairs) that is elsewhere. Ops test the
    devices inline on their hot path and build this only to raise it."""
    name, other = next((n, t) for n, t in named if t is not None and t.device != device)
    return InputError(
        f"{op}: {name} must be on {like}'s device {device}, got {describe_tensor(other)}; move "
        f"it with .to({str(device)!r})."
    )


def describe_tensor(value: Any) -> str:
    """How an error message names a value that should have been a tensor: ``shape dtype on
    device`` for a tensor, with ``, not contiguous`` when it is not (read by attribute, so this
    module imports no torch), else its type."""
    shape = getattr(value, "shape", None)
    if shape is None or not hasattr(value, "dtype"):
        return type(value).__name__
    text = f"{tuple(shape)} {value.dtype} on {getattr(value, 'device', '?')}"
    is_contiguous = getattr(value, "is_contiguous", None)
    return text if is_contiguous is None or is_contiguous() else text + ", not contiguous"
