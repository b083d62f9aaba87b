"""Read-merge-write of a JSON file other than the tuning cache (the record of missed shapes),
with the tuning cache's lock file convention and atomic writes (:mod:`graphtune.autotuner.persist`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from os import PathLike
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from graphtune.atomic_files import remove_stale_temp_files, write_atomically
from graphtune.autotuner import persist
from graphtune.autotuner.cache_reader import parse_json
from graphtune.errors import CacheFileError


def update_json(
    path: str | PathLike[str],
    merge: Callable[[Any], dict[str, Any]],
    *,
    problem: Callable[[Any], str | None],
    what: str = "file",
    lock_timeout_s: float = persist.LOCK_TIMEOUT_S,
) -> dict[str, Any]:
    """Read-merge-write of any JSON document under the file's lock, atomically.

    Args:
        path: The file.
        merge: Given the current document (``None`` when the file is missing or was moved
            aside), returns the document to write.
        problem: Why a parsed document is not one this save may merge into (``None``: it may).
            An existing file that is not JSON or has a problem is renamed to
            ``<name>.unusable`` first (:func:`graphtune.autotuner.persist.move_aside`), with a
            warning naming ``what`` and where it went, as a tuning cache save does with a file
            that is no tuning cache; ``merge`` then gets ``None``.
        what: What the file is, for that warning.

    Returns:
        The document written.

    Raises:
        CacheFileError: The lock could not be taken or the file could not be written.
    """
    path = Path(path)
    persist.check_regular_target(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(persist.lock_path(path)), timeout=lock_timeout_s):
            remove_stale_temp_files(path)
            current, reason = _current_json(path)
            if reason is None and current is not None:
                reason = problem(current)
            if reason is not None:
                persist.move_aside(path, reason, what)
                current = None
            doc = merge(current)
            text = json.dumps(doc, indent=1, allow_nan=False) + "\n"
            write_atomically(path, text.encode("utf-8"))
    except Timeout:
        raise CacheFileError(f"Could not lock {persist.lock_path(path)} to write {path}.") from None
    except (OSError, TypeError, ValueError) as exc:
        raise CacheFileError(f"Could not write {path}: {exc}.") from exc
    return doc


def _current_json(path: Path) -> tuple[Any, str | None]:
    """The document at ``path`` (``None`` when there is no file), and why it is not JSON."""
    try:
        return parse_json(path.read_text(encoding="utf-8")), None
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"is not JSON ({exc})"
