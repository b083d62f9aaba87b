"""The tuning cache file: versioned JSON with an environment fingerprint.

Saving is read-merge-write under ``filelock.FileLock(path + ".lock")`` with a temporary file in
the same directory, ``fsync`` and ``os.replace``, so readers never see a half-written file and two
processes saving at once lose nothing. Loading never crashes a serving process: a file that is
corrupt, of another format version or from another environment is skipped with one warning
(or raises :class:`CacheFileError` in strict mode). The format is in ``docs/cache-format.md``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from os import PathLike
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from graphtune import env
from graphtune.autotuner.cache import CacheEntry, CacheKey
from graphtune.autotuner.fingerprint import environment_fingerprint, fingerprint_mismatch
from graphtune.errors import CacheFileError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
LOCK_TIMEOUT_S = 60.0

Entries = dict[CacheKey, CacheEntry]


class _Unusable(Exception):
    """Internal: the file cannot be used; the message says why."""


def lock_path(path: str | PathLike[str]) -> Path:
    """The lock file guarding ``path``."""
    return Path(str(path) + ".lock")


def read_document(path: str | PathLike[str]) -> dict[str, Any]:
    """Parses a cache file without checking its environment (for ``graphtune cache show``).

    Returns:
        ``{"format_version", "fingerprint", "entries": {CacheKey: CacheEntry}}``.

    Raises:
        CacheFileError: The file is missing, not valid JSON, of another format version or has
            malformed entries.
    """
    try:
        return _parse(Path(path))
    except _Unusable as exc:
        raise CacheFileError(f"cache file {path}: {exc}") from None


def _parse(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _Unusable("does not exist") from None
    except OSError as exc:
        raise _Unusable(f"cannot be read ({exc})") from None
    except UnicodeDecodeError as exc:
        raise _Unusable(f"is corrupt (not UTF-8 text: {exc})") from None
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _Unusable(f"is corrupt or truncated (invalid JSON: {exc})") from None
    if not isinstance(doc, dict) or "format_version" not in doc:
        raise _Unusable("is not a graphtune cache (no format_version)")
    if doc["format_version"] != FORMAT_VERSION:
        raise _Unusable(
            f"has format_version {doc['format_version']!r}; this graphtune reads {FORMAT_VERSION}"
        )
    try:
        entries = {
            CacheKey.from_json(item["key"]): CacheEntry.from_json(item["value"])
            for item in doc["entries"]
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _Unusable(f"is corrupt (malformed entry: {type(exc).__name__}: {exc})") from None
    return {
        "format_version": doc["format_version"],
        "fingerprint": doc.get("fingerprint"),
        "entries": entries,
    }


def _retune_hint(path: Path) -> str:
    return (
        f"Its picks are ignored; re-tune by running your workload under graphtune.autotune("
        f"cache_path='{path}') (or remove it first with `graphtune cache clear {path}`)."
    )


def load(
    path: str | PathLike[str],
    *,
    strict: bool | None = None,
    fingerprint: dict[str, Any] | None = None,
) -> Entries:
    """Reads the entries of a cache file made in this environment.

    Args:
        path: Cache file. A missing file gives no entries (logged at debug level).
        strict: Raise instead of warning; ``None`` reads ``GRAPHTUNE_STRICT_CACHE``.
        fingerprint: The environment to match; ``None`` computes this process's.

    Returns:
        The entries, or ``{}`` when the file is unusable.

    Raises:
        CacheFileError: In strict mode, when the file is unusable for any reason but absence.
    """
    path = Path(path)
    strict = env.strict_cache() if strict is None else strict
    if not path.exists():
        logger.debug("tuning cache %s does not exist yet; starting empty", path)
        return {}
    try:
        doc = _parse(path)
        current = environment_fingerprint() if fingerprint is None else fingerprint
        diffs = fingerprint_mismatch(doc["fingerprint"], current)
        if diffs:
            raise _Unusable("was made in another environment (" + "; ".join(diffs) + ")")
    except _Unusable as exc:
        message = f"Skipping tuning cache {path}: it {exc}. {_retune_hint(path)}"
        if strict:
            raise CacheFileError(message) from None
        logger.warning(message)
        return {}
    return doc["entries"]


def save(
    path: str | PathLike[str],
    entries: Entries,
    *,
    fingerprint: dict[str, Any] | None = None,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> int:
    """Merges ``entries`` into the file at ``path``; on a key conflict ``entries`` win.

    Entries of an existing file from this environment are kept; an unusable existing file
    (corrupt, other version, other environment) is replaced, with a warning.

    Returns:
        The number of entries in the file after the write.

    Raises:
        CacheFileError: The lock could not be taken in time or the file could not be written.
    """
    path = Path(path)
    current = environment_fingerprint() if fingerprint is None else fingerprint
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock_path(path)), timeout=lock_timeout_s):
            merged = _existing_entries(path, current)
            merged.update(entries)
            _atomic_write(path, _document(merged, current))
    except Timeout:
        raise CacheFileError(
            f"Could not lock {lock_path(path)} within {lock_timeout_s:.0f} s to save the tuning "
            "cache; another process holds it. Retry, or remove the lock file if no graphtune "
            "process is running."
        ) from None
    except OSError as exc:
        raise CacheFileError(
            f"Could not write tuning cache {path}: {exc}. Check the directory exists and is "
            "writable, or pass another cache_path."
        ) from exc
    except (TypeError, ValueError) as exc:
        raise CacheFileError(
            f"Could not write tuning cache {path}: an entry is not JSON-serialisable ({exc}). "
            "Tactics must be ints, strings, lists or dicts of those."
        ) from exc
    logger.debug("saved %d tuning entries to %s", len(merged), path)
    return len(merged)


def _existing_entries(path: Path, current: dict[str, Any]) -> Entries:
    if not path.exists():
        return {}
    try:
        doc = _parse(path)
    except _Unusable as exc:
        logger.warning("Replacing tuning cache %s: it %s.", path, exc)
        return {}
    diffs = fingerprint_mismatch(doc["fingerprint"], current)
    if diffs:
        logger.warning(
            "Replacing tuning cache %s: it was made in another environment (%s).",
            path,
            "; ".join(diffs),
        )
        return {}
    return doc["entries"]


def _document(entries: Entries, fingerprint: dict[str, Any]) -> dict[str, Any]:
    # Sorted so a file's bytes depend only on its content (stable diffs, reproducible results).
    items = sorted(entries.items(), key=lambda kv: json.dumps(kv[0].to_json(), sort_keys=True))
    return {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "entries": [{"key": k.to_json(), "value": v.to_json()} for k, v in items],
    }


def _atomic_write(path: Path, doc: dict[str, Any]) -> None:
    # allow_nan=False: a non-finite time must never reach the file (the tuner stores None).
    text = json.dumps(doc, indent=1, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
