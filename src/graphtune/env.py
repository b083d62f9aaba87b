"""The only module that reads environment variables.

Variables (all optional):

* ``GRAPHTUNE_CACHE``: default tuning cache file used by ``autotune()`` and the CLI when no path
  is given.
* ``GRAPHTUNE_DEBUG``: ``1`` turns on extra checks that cost time on the hot path (for example
  the graph runner verifies that non-batched inputs did not move between calls, and the
  ``rope_kv_cache`` runners that positions and write rows lie in the tables and caches, both
  reading it when they are built; ``Engine.step`` checks its tokens, positions and slots against
  their bounds on every call).
* ``GRAPHTUNE_DISABLE_GRAPHS``: ``1`` makes every ``CUDAGraphRunner`` run eagerly (reason
  ``disabled``), for bisecting a suspected graph problem without code changes.
* ``GRAPHTUNE_STRICT_CACHE``: ``1`` makes loading a mismatching or corrupt cache file raise
  instead of warning and skipping it.
* ``GRAPHTUNE_CACHE_ONLY``: ``1`` makes ``autotune()`` cache-only: it loads the cache file and the
  ops look their picks up, but a miss runs the fallback instead of tuning (for CI and development;
  ``autotune(tune=False)`` does the same for one block, and an explicit ``tune=True`` wins).
* ``GRAPHTUNE_MISSES``: default file ``autotune()`` saves the record of missed shapes to when no
  ``misses_path`` is given (for ``graphtune tune --from-misses FILE``).
* ``GRAPHTUNE_NO_PROGRESS``: ``1`` hides progress bars, the progress records long work logs when
  stderr is not a terminal (``graphtune.reporting``, INFO; the CLI shows them), and
  ``graphtune check-tactics``' progress lines.
* ``GRAPHTUNE_PDL``: ``0`` launches every Triton kernel without programmatic dependent launch
  (PDL), even on GPUs that support it; results are identical either way, only the overlap of
  consecutive kernels changes. On by default.
* ``GRAPHTUNE_COMPILE_PROCESSES``: worker processes that run Triton's code generator for the
  tactics compiled ahead of timing (``graphtune.ops._compile_pool``); ``0`` compiles in threads
  of the tuning process only. Unset: ``min(16, cpu_count)``.
* ``GRAPHTUNE_COMPILE_TIMEOUT``: seconds (a number > 0, fractions allowed) a batch of compile jobs
  waits for those worker processes without any job of it finishing; then the workers are killed
  and this process compiles the jobs left, and every later one, itself. Unset: ``300``.
* ``GRAPHTUNE_COMMIT``: the source commit recorded in benchmark results when the tree being run has
  no ``.git`` (for example a copy shipped to a GPU machine).
* ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``: set by ``torchrun``; read for ``--tp N`` (the process
  group itself is initialised by ``torch.distributed`` from ``MASTER_ADDR``/``MASTER_PORT``,
  whose presence is checked first: :func:`missing_rendezvous`).

The on/off variables (``GRAPHTUNE_DEBUG``, ``GRAPHTUNE_DISABLE_GRAPHS``,
``GRAPHTUNE_STRICT_CACHE``, ``GRAPHTUNE_CACHE_ONLY``, ``GRAPHTUNE_NO_PROGRESS``,
``GRAPHTUNE_PDL``) take ``1``, ``true``, ``yes`` or ``on`` for on and ``0``, ``false``, ``no`` or
``off`` for off, in any case; empty is the same as unset. Any other value (``enabled``, ``2``)
raises :class:`~graphtune.errors.ConfigError` naming the variable where it is read (the
``graphtune`` command checks them all before it starts: :func:`check_switches`).

Values are read when the function is called, never at import time.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from graphtune.errors import ConfigError
from graphtune.integer_text import parse_integer

_TRUE = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off"})


def _non_negative_int(value: str) -> int | None:
    """``value`` as an integer >= 0 under the one rule for integer text
    (:func:`~graphtune.integer_text.parse_integer`: ``str.isdigit`` would take ``"²"``, and
    ``int`` ``"1_0"``), or ``None`` when it is not one."""
    try:
        number = parse_integer(value)
    except ValueError:
        return None
    return number if number >= 0 else None


#: The on/off variables: each takes a value of ``_TRUE``, of ``_OFF`` or the empty string.
SWITCHES = (
    "GRAPHTUNE_DEBUG",
    "GRAPHTUNE_DISABLE_GRAPHS",
    "GRAPHTUNE_STRICT_CACHE",
    "GRAPHTUNE_CACHE_ONLY",
    "GRAPHTUNE_NO_PROGRESS",
    "GRAPHTUNE_PDL",
)


def _switch(name: str) -> bool | None:
    """The on/off variable ``name``: ``True``, ``False``, or ``None`` when unset or empty.

    Raises:
        ConfigError: Any other value (``enabled``, ``2``, ``Y``), which would otherwise quietly
            read as one of the two.
    """
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _OFF:
        return False
    if not value:
        return None
    raise ConfigError(
        f"environment variable {name}={raw!r} is neither on nor off; set it to one of "
        f"{', '.join(sorted(_TRUE))} (on) or {', '.join(sorted(_OFF))} (off), or unset it"
    )


def _flag(name: str) -> bool:
    return _switch(name) is True


def check_switches() -> None:
    """Reads every on/off variable once, so that a command refuses a bad value before any work.

    Raises:
        ConfigError: A value that is neither on nor off (see :func:`_switch`).
    """
    for name in SWITCHES:
        _switch(name)


def default_cache_path() -> Path | None:
    """Returns the cache file named by ``GRAPHTUNE_CACHE``, or ``None`` when unset."""
    value = os.environ.get("GRAPHTUNE_CACHE", "").strip()
    return Path(value).expanduser() if value else None


def debug_checks() -> bool:
    """Whether ``GRAPHTUNE_DEBUG`` asks for extra (slower) consistency checks."""
    return _flag("GRAPHTUNE_DEBUG")


def graphs_disabled() -> bool:
    """Whether ``GRAPHTUNE_DISABLE_GRAPHS`` turns every graph runner into eager execution."""
    return _flag("GRAPHTUNE_DISABLE_GRAPHS")


def strict_cache() -> bool:
    """Whether ``GRAPHTUNE_STRICT_CACHE`` makes cache-file problems raise instead of warn."""
    return _flag("GRAPHTUNE_STRICT_CACHE")


def cache_only() -> bool:
    """Whether ``GRAPHTUNE_CACHE_ONLY`` turns tuning off in ``autotune()`` (look-ups only)."""
    return _flag("GRAPHTUNE_CACHE_ONLY")


def default_misses_path() -> Path | None:
    """Returns the misses file named by ``GRAPHTUNE_MISSES``, or ``None`` when unset."""
    value = os.environ.get("GRAPHTUNE_MISSES", "").strip()
    return Path(value).expanduser() if value else None


def progress_disabled() -> bool:
    """Whether ``GRAPHTUNE_NO_PROGRESS`` hides progress bars and progress lines."""
    return _flag("GRAPHTUNE_NO_PROGRESS")


def pdl_allowed() -> bool:
    """Whether ``GRAPHTUNE_PDL`` leaves programmatic dependent launch on (unset: on)."""
    return _switch("GRAPHTUNE_PDL") is not False


def compile_processes() -> int | None:
    """``GRAPHTUNE_COMPILE_PROCESSES`` as an int >= 0, or ``None`` when unset.

    Raises:
        ConfigError: The value is not an integer >= 0.
    """
    value = os.environ.get("GRAPHTUNE_COMPILE_PROCESSES", "").strip()
    if not value:
        return None
    number = _non_negative_int(value)
    if number is None:
        raise ConfigError(
            f"GRAPHTUNE_COMPILE_PROCESSES={value!r}: must be an integer >= 0 (0 compiles in "
            "threads only); unset it for the default."
        )
    return number


def compile_timeout() -> float | None:
    """``GRAPHTUNE_COMPILE_TIMEOUT`` as a finite number of seconds > 0, or ``None`` when unset.

    Raises:
        ConfigError: The value is not a finite number > 0.
    """
    value = os.environ.get("GRAPHTUNE_COMPILE_TIMEOUT", "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(
            f"GRAPHTUNE_COMPILE_TIMEOUT={value!r}: must be a number of seconds > 0 (how long a "
            "batch of compile jobs waits for the worker processes); unset it for the default."
        )
    return seconds


def torchrun_rank() -> tuple[int, int] | None:
    """Returns ``(rank, world_size)`` when launched by torchrun, else ``None``.

    Raises:
        ConfigError: A value that is not an integer, or a rank outside ``[0, WORLD_SIZE)``.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = _launch_int("RANK"), _launch_int("WORLD_SIZE")
        if not 0 <= rank < world:
            raise ConfigError(
                f"RANK={rank} is not a rank of WORLD_SIZE={world} (0 to {world - 1}); launch with "
                "torchrun, which sets both"
            )
        return rank, world
    return None


def torchrun_local_rank() -> int | None:
    """Returns torchrun's ``LOCAL_RANK`` (this process's GPU index on its host), else ``None``.

    Raises:
        ConfigError: A value that is not a non-negative integer.
    """
    return _launch_int("LOCAL_RANK") if os.environ.get("LOCAL_RANK", "").strip() else None


def missing_rendezvous() -> list[str]:
    """The variables of torch.distributed's ``env://`` rendezvous that are not set (torchrun
    sets ``MASTER_ADDR`` and ``MASTER_PORT``; a hand-made launch must too)."""
    return [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]


def _launch_int(name: str) -> int:
    number = _non_negative_int(os.environ[name])
    if number is None:
        raise ConfigError(
            f"environment variable {name}={os.environ[name]!r} must be a non-negative integer; "
            "launch with torchrun, which sets it"
        )
    return number


def source_commit() -> str | None:
    """Returns the commit named by ``GRAPHTUNE_COMMIT``, or ``None`` when unset."""
    value = os.environ.get("GRAPHTUNE_COMMIT", "").strip()
    return value or None
