"""The tuning cache file: versioned JSON with an environment fingerprint.

Saving is read-merge-write under ``filelock.FileLock(path + ".lock")`` with a temporary file in
the same directory, ``fsync`` and ``os.replace``, so readers never see a half-written file and two
processes saving at once lose nothing; a writer killed at any point leaves the previous file
intact (its temporary file is removed by the next save, which holds the lock). Loading never
crashes a serving process: a file that is corrupt, of another format version or from another
environment is skipped with one warning (or raises :class:`CacheFileError` in strict mode). The
format is in ``docs/cache-format.md``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from graphtune import env
from graphtune.atomic_files import (
    FallbackFailed,
    real_path,
    remove_stale_temp_files,
    write_atomically,
    write_fallback,
)
from graphtune.autotuner.cache_reader import (
    FORMAT_VERSION,
    Entries,
    Unreadable,
    Unusable,
    parse,
    parse_document,
    raw_document,
    read_raw_and_document,
)
from graphtune.autotuner.entries import BlockedTactic, Blocklist, CacheEntry, tactic_text
from graphtune.autotuner.fingerprint import environment_fingerprint, fingerprint_mismatch
from graphtune.autotuner.save_target import (
    LOCK_TIMEOUT_S,
    check_lockable,
    check_regular_target,
    lock_path,
    locked,
    move_aside,
    not_a_file,
)
from graphtune.errors import CacheFileError

logger = logging.getLogger(__name__)


@dataclass
class LoadedCache:
    """What a usable cache file holds."""

    entries: Entries = field(default_factory=dict)
    blocklist: Blocklist = field(default_factory=dict)


def _retune_hint(path: Path, unreadable: bool = False) -> str:
    refused = not_a_file(path)
    if unreadable:
        return (
            "Its picks are ignored, and a save there fails too (graphtune never moves aside or "
            "replaces a file it could not read; the picks go to a fallback file its error "
            "names): make it readable, or pass another cache path."
        )
    if refused is not None:
        return (
            f"A save there is refused too, since it {refused} (graphtune never moves or replaces "
            "one; the picks go to a fallback file its error names): pass the path of a file."
        )
    return (
        f"Its picks are ignored; the next tuning run with this cache moves it aside to "
        f"{path}.unusable and writes a new one (`graphtune tune --model M --cache {path}`, or "
        f"your workload under graphtune.autotune('{path}')); "
        f"`graphtune cache verify {path}` says what is wrong with it."
    )


def load(
    path: str | PathLike[str],
    *,
    strict: bool | None = None,
    fingerprint: dict[str, Any] | None = None,
) -> Entries:
    """Reads the entries of a cache file made in this environment (see :func:`load_file`)."""
    return load_file(path, strict=strict, fingerprint=fingerprint).entries


def load_file(
    path: str | PathLike[str],
    *,
    strict: bool | None = None,
    fingerprint: dict[str, Any] | None = None,
) -> LoadedCache:
    """Reads the entries and blocklist of a cache file made in this environment.

    Args:
        path: Cache file. A missing file gives no entries (logged at debug level).
        strict: Raise instead of warning; ``None`` reads ``GRAPHTUNE_STRICT_CACHE``.
        fingerprint: The environment to match; ``None`` computes this process's.

    Returns:
        The entries and blocklist, both empty when the file is missing or unusable.

    Raises:
        CacheFileError: In strict mode, when the file is unusable for any reason but absence.
    """
    path = Path(path)
    strict = env.strict_cache() if strict is None else strict
    if not path.exists():
        logger.debug("tuning cache %s does not exist yet; starting empty", path)
        return LoadedCache()
    try:
        doc = parse(path)
        current = environment_fingerprint() if fingerprint is None else fingerprint
        diffs = fingerprint_mismatch(doc["fingerprint"], current)
        if diffs:
            raise Unusable("was made in another environment (" + "; ".join(diffs) + ")")
    except Unusable as exc:
        if strict:
            raise CacheFileError(
                f"Tuning cache {path} is unusable: it {exc}. Strict mode (GRAPHTUNE_STRICT_CACHE=1 "
                "or strict=True) stops on an unusable cache instead of skipping it; fix or "
                f"remove the file (`graphtune cache verify {path}` says what is wrong), pass "
                "another cache path, or unset GRAPHTUNE_STRICT_CACHE to run without its picks."
            ) from None
        hint = _retune_hint(path, isinstance(exc, Unreadable))
        logger.warning("Skipping tuning cache %s: it %s. %s", path, exc, hint)
        return LoadedCache()
    _warn_ignored(path, doc["ignored"])
    return LoadedCache(doc["entries"], doc["blocklist"])


def _warn_ignored(path: Path, ignored: list[str]) -> None:
    if ignored:
        logger.warning(
            "Ignoring %d entries of tuning cache %s that no look-up can use (%s); `graphtune "
            "cache verify %s` lists them, and the next save drops them.",
            len(ignored),
            path,
            ignored[0] if len(ignored) == 1 else ignored[0] + "; ...",
            path,
        )


def save(
    path: str | PathLike[str],
    entries: Entries,
    *,
    blocklist: Blocklist | None = None,
    fingerprint: dict[str, Any] | None = None,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> int:
    """Merges ``entries`` (and ``blocklist``) into the file at ``path``; on a conflict the given
    ones win.

    Entries and blocked tactics of an existing file from this environment are kept; an unusable
    existing file (corrupt, other version, other environment) is first renamed to
    ``<name>.unusable[.N]`` (:func:`move_aside`), with a warning naming where it went. An
    existing file that cannot be read (``EACCES``, ``EIO``) is neither: the save fails.

    Returns:
        The number of entries in the file after the write.

    Raises:
        CacheFileError: ``path`` is a folder or not a regular file (a FIFO, a device), the lock
            could not be taken in time, the existing file could not be read or the file could
            not be written; what would have been
            saved is then written to a file in the temporary folder, which the message names
            (:func:`graphtune.atomic_files.write_fallback`): the merged document when the
            existing file was read, else only ``entries`` and ``blocklist``.
    """
    path = real_path(path)
    current = environment_fingerprint() if fingerprint is None else fingerprint
    entries, unstorable = _storable(entries)
    # What the file would have held, once known: a failed write puts it in a fallback file.
    # Until the existing file is read it is only the given changes, which must then be merged
    # into the file, not copied over it (that would drop the file's other entries).
    doc = _document(entries, current, blocklist or {})
    complete = False
    merged = entries
    refused = not_a_file(path)  # a folder or FIFO is never moved aside or replaced
    if refused is not None:
        raise CacheFileError(
            _kept_elsewhere(path, doc, f"it {refused}", complete)
            + "; pass the path of a file as the cache path"
        )
    try:
        check_lockable(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock_path(path)), timeout=lock_timeout_s):
            remove_stale_temp_files(path)
            existing = _existing(path, current)
            merged = existing.entries
            merged.update(entries)
            blocked = existing.blocklist
            blocked.update(blocklist or {})
            doc = _document(merged, current, blocked)
            complete = True
            _atomic_write(path, doc)
    except CacheFileError as exc:  # check_lockable, or a folder made there meanwhile
        raise CacheFileError(_kept_elsewhere(path, doc, str(exc).rstrip("."), complete)) from None
    except Timeout:
        why = f"could not lock {lock_path(path)} within {lock_timeout_s:g} s"
        raise CacheFileError(
            _kept_elsewhere(path, doc, why, complete)
            + "; another process holds the lock: retry, or remove the lock file if no "
            "graphtune process is running"
        ) from None
    except OSError as exc:
        raise CacheFileError(
            _kept_elsewhere(path, doc, f"{type(exc).__name__}: {exc}", complete)
            + "; check the folder exists and is writable, or pass another cache_path"
        ) from exc
    except (TypeError, ValueError) as exc:  # a blocklist item JSON cannot hold
        raise CacheFileError(f"Could not write tuning cache {path}: {exc}.") from exc
    if unstorable:
        raise CacheFileError(
            f"Saved {len(merged)} entries to tuning cache {path}, but left out "
            f"{len(unstorable)} that a JSON file cannot hold, e.g. {unstorable[0]}. Tactics must "
            "be None, bools, ints, finite floats, strings, tuples, lists or dicts of those, and "
            "times finite numbers or null."
        )
    logger.debug("saved %d tuning entries to %s", len(merged), path)
    return len(merged)


def _kept_elsewhere(path: Path, doc: dict[str, Any], why: str, complete: bool) -> str:
    """Writes ``doc``, which could not be saved to ``path`` (``why``), to the fallback file of
    :mod:`graphtune.atomic_files`; returns the start of the error message, naming where the
    picks are (or that they are lost, when the fallback fails too). ``complete``: ``doc`` is
    the whole merged document, so copying the fallback over ``path`` loses nothing; else it
    holds only this save's changes, and the advice is to merge it into ``path``."""
    try:
        text = json.dumps(doc, indent=1, allow_nan=False) + "\n"
        fallback = write_fallback(path, text.encode("utf-8"), why)
    except FallbackFailed as exc:
        return (
            f"Could not save tuning cache {path} ({why}) nor its copy {exc.fallback} "
            f"({exc.second}); its {len(doc['entries'])} entries are lost"
        )
    except (TypeError, ValueError) as exc:
        return f"Could not save tuning cache {path} ({why}); no copy could be written ({exc})"
    if complete:
        return (
            f"Could not save tuning cache {path} ({why}); its {len(doc['entries'])} entries are "
            f"in {fallback} instead (copy it to {path} once that can be written)"
        )
    return (
        f"Could not save tuning cache {path} ({why}); the {len(doc['entries'])} entries this "
        f"save would have added or changed are in {fallback} instead (once {path} can be "
        f"written, merge them in with `graphtune cache merge {path} {fallback} --prefer b -o "
        f"{path}`, or copy it there if {path} does not exist)"
    )


def _storable(entries: Entries) -> tuple[Entries, list[str]]:
    """The entries a cache file can hold, and a description of each other one (a pick whose
    tactic JSON cannot represent), so one such pick never costs the others their save."""
    kept: Entries = {}
    left_out: list[str] = []
    for key, entry in entries.items():
        problem = _unstorable_field(entry)
        if problem is not None:
            left_out.append(f"op {key.op!r} runner {entry.runner_id} ({problem})")
            continue
        kept[key] = entry
    return kept, left_out


def _unstorable_field(entry: CacheEntry) -> str | None:
    """Which field of ``entry`` a file cannot hold, and why; ``None`` when it can hold them all
    (the error then blames the right one: a NaN time is not a bad tactic)."""
    for name in ("time_us", "fallback_us"):
        value = getattr(entry, name)
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name} is {value}, and JSON has no non-finite numbers"
    try:
        json.dumps(entry.to_json(), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        return f"tactic {entry.tactic!r}: {exc}"
    return None


def unblock(
    path: str | PathLike[str],
    *,
    runner_id: str | None = None,
    tactic: Any = None,
    match_tactic: bool = False,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> list[BlockedTactic]:
    """Removes blocked tactics from a cache file, under the file lock. Only the blocklist
    changes: every entry stays as the file holds it, also one that loading ignores (a key
    without a device type, a duplicate key, a runner_index that names no runner), which a
    rewrite from the usable entries would drop.

    Args:
        path: Cache file.
        runner_id: Only items of this runner (``None``: every runner).
        tactic: With ``match_tactic``, only this tactic (compared by its canonical text,
            :func:`~graphtune.autotuner.entries.tactic_text`).
        match_tactic: Whether ``tactic`` filters (``None`` is a valid JSON tactic, hence the flag).

    Returns:
        The removed items (one per (runner, tactic)). When none match, the file is neither
        locked nor written.

    Raises:
        CacheFileError: The file is unusable, or could not be locked or written.
    """
    path = real_path(path)

    def split(raw: dict[str, Any]) -> tuple[list[Any], dict[tuple[str, str], BlockedTactic]]:
        keep: list[Any] = []
        removed: dict[tuple[str, str], BlockedTactic] = {}
        # read_raw_and_document parsed every item, so none raises here.
        for item in raw.get("blocklist", []):
            blocked = BlockedTactic.from_json(item)
            hit = (runner_id is None or blocked.runner_id == runner_id) and (
                not match_tactic or blocked.ident[1] == tactic_text(tactic)
            )
            if hit:
                removed.setdefault(blocked.ident, blocked)
            else:
                keep.append(item)  # as the file holds it
        return keep, removed

    if not split(read_raw_and_document(path)[0])[1]:
        return []  # nothing to remove: no lock file, no write (a read-only folder is fine)
    try:
        with FileLock(str(lock_path(path)), timeout=lock_timeout_s):
            raw = read_raw_and_document(path)[0]  # again under the lock: a save may have come
            keep, removed = split(raw)
            if removed:
                if keep:
                    raw["blocklist"] = keep
                else:  # as a save writes it: no key for an empty blocklist
                    raw.pop("blocklist", None)
                _atomic_write(path, raw)
    except Timeout:
        raise CacheFileError(
            f"Could not lock {lock_path(path)} within {lock_timeout_s:g} s; another process "
            "holds it. Retry, or remove the lock file if no graphtune process is running."
        ) from None
    except OSError as exc:
        raise CacheFileError(f"Could not rewrite tuning cache {path}: {exc}.") from exc
    return list(removed.values())


def _existing(path: Path, current: dict[str, Any]) -> LoadedCache:
    if not path.exists():
        return LoadedCache()
    try:
        raw = raw_document(path)  # read once: the test below and the entries both use it
    except Unreadable as exc:
        # Its content is unknown (a valid cache the umask made unreadable to this user, a disk
        # error): moving it aside would drop every other process's picks. Fail as on a file
        # that cannot be written; the caller keeps this save's picks in a fallback file.
        raise CacheFileError(
            f"it exists but {exc}, and a file that was not read is never moved aside or replaced"
        ) from None
    except Unusable as exc:
        move_aside(path, str(exc))
        return LoadedCache()
    try:
        doc = parse_document(raw)
        diffs = fingerprint_mismatch(doc["fingerprint"], current)
        if diffs:
            raise Unusable("was made in another environment (" + "; ".join(diffs) + ")")
    except Unusable as exc:
        # A cache of another version or environment still holds picks valid where it was made.
        move_aside(path, str(exc), advice=_KEPT_ASIDE)
        return LoadedCache()
    return LoadedCache(doc["entries"], doc["blocklist"])


def existing_output(path: str | PathLike[str], fingerprint: dict[str, Any]) -> LoadedCache:
    """What the file at ``path`` holds, as a save reads it before writing there (for ``cache
    merge``, whose output is written there; call it holding the lock): the entries and blocklist
    of a usable cache of ``fingerprint``'s environment; nothing when there is no file, or when it
    is no usable cache of that environment, which is then renamed to ``<name>.unusable[.N]``
    with a warning. A folder or a file that is not a regular one is left for the write to
    refuse.

    Raises:
        CacheFileError: The file exists but cannot be read (it is then left as it is).
    """
    path = real_path(path)
    if not_a_file(path) is not None:
        return LoadedCache()
    try:
        return _existing(path, fingerprint)
    except CacheFileError as exc:
        raise CacheFileError(f"Could not write tuning cache {path}: {exc}.") from None


_KEPT_ASIDE = (
    "Its picks are kept there: use that file where it was made, or `graphtune cache verify` it."
)


def document(
    entries: Entries, fingerprint: Any, blocklist: Blocklist | None = None
) -> dict[str, Any]:
    """The JSON document of a cache file (public for ``graphtune cache merge``)."""
    return _document(entries, fingerprint, blocklist or {})


def write_atomic(path: str | PathLike[str], doc: dict[str, Any], *, lock: bool = True) -> None:
    """Writes ``doc`` to ``path`` via a temporary file and ``os.replace`` under the file lock
    (``lock=False``: the caller holds it, :func:`locked`).

    Raises:
        CacheFileError: The lock could not be taken or the file could not be written.
    """
    path = real_path(path)
    check_regular_target(path)
    try:
        if not lock:
            remove_stale_temp_files(path)
            _atomic_write(path, doc)
            return
        with locked(path):
            remove_stale_temp_files(path)
            _atomic_write(path, doc)
    except (OSError, TypeError, ValueError) as exc:
        raise CacheFileError(f"Could not write tuning cache {path}: {exc}.") from exc


def _document(entries: Entries, fingerprint: Any, blocklist: Blocklist) -> dict[str, Any]:
    # Sorted so a file's bytes depend only on its content (stable diffs, reproducible results).
    items = sorted(entries.items(), key=lambda kv: json.dumps(kv[0].to_json(), sort_keys=True))
    doc = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "entries": [{"key": k.to_json(), "value": v.to_json()} for k, v in items],
    }
    if blocklist:
        # Written only when non-empty, so files without failures keep their exact old layout.
        doc["blocklist"] = [blocklist[ident].to_json() for ident in sorted(blocklist)]
    return doc


def _after_temp_write(tmp: Path) -> None:
    """Fault-injection seam: runs after the temporary file is complete, before ``os.replace``.

    Does nothing. Tests replace it to kill or pause a writer at the most delicate moment.
    """
    return None


def _atomic_write(path: Path, doc: dict[str, Any]) -> None:
    # allow_nan=False: a non-finite time must never reach the file (the tuner stores None).
    text = json.dumps(doc, indent=1, allow_nan=False) + "\n"
    # A lambda, so a test's replacement of the seam is seen at call time.
    write_atomically(path, text.encode("utf-8"), before_replace=lambda tmp: _after_temp_write(tmp))
