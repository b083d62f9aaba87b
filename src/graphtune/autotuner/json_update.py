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

from graphtune.atomic_files import (
    FallbackFailed,
    real_path,
    remove_stale_temp_files,
    write_atomically,
    write_fallback,
)
from graphtune.autotuner import save_target
from graphtune.errors import CacheFileError
from graphtune.finite_json import parse_json


def update_json(
    path: str | PathLike[str],
    merge: Callable[[Any], dict[str, Any]],
    *,
    problem: Callable[[Any], str | None],
    what: str = "file",
    lock_timeout_s: float = save_target.LOCK_TIMEOUT_S,
) -> dict[str, Any]:
    """Read-merge-write of any JSON document under the file's lock, atomically.

    Args:
        path: The file.
        merge: Given the current document (``None`` when the file is missing or was moved
            aside), returns the document to write.
        problem: Why a parsed document is not one this save may merge into (``None``: it may).
            An existing file that is not JSON or has a problem (but is no tuning cache, and no
            folder: those are refused, never moved) is renamed to
            ``<name>.unusable`` first (:func:`graphtune.autotuner.save_target.move_aside`), with a
            warning naming ``what`` and where it went, as a tuning cache save does with a file
            that is no tuning cache; ``merge`` then gets ``None``.
        what: What the file is, for that warning.

    Returns:
        The document written.

    Raises:
        CacheFileError: ``path`` is a folder or not a regular file, or the lock could not be
            taken or the file could not be written; what would have been written is then in
            the fallback file of :func:`graphtune.atomic_files.write_fallback`, which the
            message names (the merged document when the file was read, else ``merge(None)``:
            only this save's part).
    """
    path = real_path(path)  # a link: its target is locked and written, the link stays
    doc: dict[str, Any] | None = None
    refused = "it is a folder" if path.is_dir() else None
    try:
        save_target.check_regular_target(path)
    except CacheFileError:
        refused = "it is not a regular file (a device, FIFO or socket)"
    try:
        if refused is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(save_target.lock_path(path)), timeout=lock_timeout_s):
                doc, refused = _merge_locked(path, merge, problem, what)
        if refused is not None:
            message = _kept_elsewhere(path, None, merge, refused, what)
            raise CacheFileError(f"{message}; pass another path")
    except Timeout:
        why = f"could not lock {save_target.lock_path(path)} within {lock_timeout_s:g} s"
        raise CacheFileError(_kept_elsewhere(path, doc, merge, why, what)) from None
    except OSError as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise CacheFileError(_kept_elsewhere(path, doc, merge, why, what)) from exc
    except (TypeError, ValueError) as exc:
        raise CacheFileError(f"Could not write {path}: {exc}.") from exc
    assert doc is not None  # written, or refused above
    return doc


def _kept_elsewhere(
    path: Path,
    doc: dict[str, Any] | None,
    merge: Callable[[Any], dict[str, Any]],
    why: str,
    what: str,
) -> str:
    """Writes what could not be written to ``path`` (``why``) to the fallback file; returns
    the error message, which says where it went (or that it is lost)."""
    whole = doc is not None
    try:
        text = json.dumps(merge(None) if doc is None else doc, indent=1, allow_nan=False) + "\n"
        fallback = write_fallback(path, text.encode("utf-8"), why)
    except FallbackFailed as exc:
        return f"Could not write the {what} {path} ({why}) nor its copy {exc.fallback} " + (
            f"({exc.second}); what this save would have written is lost"
        )
    except (TypeError, ValueError) as exc:
        return f"Could not write the {what} {path} ({why}); no copy could be written ({exc})"
    if whole:
        return (
            f"Could not write the {what} {path} ({why}); its whole content is in {fallback} "
            "instead (use that file, or copy it to the path once that can be written)"
        )
    return (
        f"Could not write the {what} {path} ({why}); what this save would have added is in "
        f"{fallback} instead: use it beside {path}, whose own content it does not hold (copy it "
        f"there only if {path} does not exist)"
    )


def _merge_locked(
    path: Path,
    merge: Callable[[Any], dict[str, Any]],
    problem: Callable[[Any], str | None],
    what: str,
) -> tuple[dict[str, Any] | None, str | None]:
    """The read-merge-write of :func:`update_json`, its lock held: the document written, or
    why the file there is never this save's to move aside or replace (a tuning cache)."""
    remove_stale_temp_files(path)
    current, reason = _current_json(path)
    if isinstance(current, dict) and "format_version" in current:
        return None, "it is a graphtune tuning cache, which this save never moves or replaces"
    if reason is None and current is not None:
        reason = problem(current)
    if reason is not None:
        save_target.move_aside(path, reason, what)
        current = None
    doc = merge(current)
    text = json.dumps(doc, indent=1, allow_nan=False) + "\n"
    write_atomically(path, text.encode("utf-8"))
    return doc, None


def _current_json(path: Path) -> tuple[Any, str | None]:
    """The document at ``path`` (``None`` when there is no file), and why it is not JSON."""
    try:
        return parse_json(path.read_text(encoding="utf-8")), None
    except FileNotFoundError:
        return None, None
    # Another OSError (EACCES, EIO) propagates: a file that was not read is never moved aside,
    # and update_json fails as on a file it cannot write.
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"is not JSON ({exc})"
