"""In-memory tuning cache: (op, runners, bucketed shapes, dtypes, timing mode) -> pick.

The keys and values are :mod:`graphtune.autotuner.entries`. The cache also holds a *blocklist* of
(runner id, tactic) pairs that crashed, hung or corrupted the CUDA context while being timed. The
tuner consults it before timing, so a tactic that killed a worker once is not tried again until
the user clears it (``graphtune cache unblock``). Files are read and written by
:mod:`graphtune.autotuner.persist`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from os import PathLike
from typing import Any

from graphtune.atomic_files import file_id
from graphtune.autotuner import persist
from graphtune.autotuner.entries import (
    BlockedTactic,
    Blocklist,
    CacheEntry,
    CacheKey,
    tactic_text,
)


class TuningCache:
    """Thread-safe mapping of :class:`CacheKey` to :class:`CacheEntry`, plus the blocklist, with
    file load/save."""

    def __init__(self) -> None:
        self._entries: dict[CacheKey, CacheEntry] = {}
        self._blocked: Blocklist = {}
        # Per file (resolved path): the entries and blocked tactics as this cache last read or
        # wrote them there. A save writes only what changed since, so it never reverts what
        # another process re-tuned, pinned or unblocked in that file meanwhile.
        self._synced: dict[str, tuple[dict[CacheKey, CacheEntry], Blocklist]] = {}
        self._lock = threading.Lock()
        #: Bumped by every change of the entries, so look-up memos know when to forget.
        self.version = 0

    def get(self, key: CacheKey) -> CacheEntry | None:
        """The entry for ``key``, or ``None``, also when the entry's (runner, tactic) is blocked:
        a tactic that crashed or hung is never served (a pick merged in from another file, or
        tuned before the block), and tuning picks again without it."""
        with self._lock:
            return self._served(self._entries.get(key))

    def _served(self, entry: CacheEntry | None) -> CacheEntry | None:
        if entry is None or not self._blocked:
            return entry
        return None if (entry.runner_id, tactic_text(entry.tactic)) in self._blocked else entry

    def put(self, key: CacheKey, entry: CacheEntry) -> None:
        """Stores (or replaces) the entry for ``key``."""
        with self._lock:
            self._entries[key] = entry
            self.version += 1

    def update(self, entries: dict[CacheKey, CacheEntry]) -> None:
        """Stores many entries; given entries replace existing ones with the same key."""
        with self._lock:
            self._entries.update(entries)
            self.version += 1

    def items(self) -> list[tuple[CacheKey, CacheEntry]]:
        """A snapshot of all entries."""
        with self._lock:
            return list(self._entries.items())

    def clear(self) -> None:
        """Drops every entry and the blocklist."""
        with self._lock:
            self._entries.clear()
            self._blocked.clear()
            self.version += 1

    # -- blocklist --------------------------------------------------------------------------

    def block(self, item: BlockedTactic) -> None:
        """Adds (or replaces) a blocked (runner, tactic); entries that pick it are no longer
        served (:meth:`get`)."""
        with self._lock:
            self._blocked[item.ident] = item
            self.version += 1  # look-up memos must forget the picks it hides

    def blocked(self, runner_id: str, tactic: Any) -> BlockedTactic | None:
        """The blocklist item for ``(runner_id, tactic)``, or ``None`` when it may be timed."""
        with self._lock:
            return self._blocked.get((runner_id, tactic_text(tactic)))

    def blocklist(self) -> list[BlockedTactic]:
        """A snapshot of the blocklist."""
        with self._lock:
            return list(self._blocked.values())

    def clear_blocklist(self) -> int:
        """Forgets every blocked tactic in memory; returns how many there were.

        A blocklist in a cache file survives this (saving merges); use
        ``graphtune cache unblock FILE`` or :func:`graphtune.autotuner.persist.unblock` for it.
        """
        with self._lock:
            count = len(self._blocked)
            self._blocked.clear()
            self.version += 1
            return count

    def __contains__(self, key: object) -> bool:
        """Whether :meth:`get` serves an entry for ``key``."""
        if not isinstance(key, CacheKey):
            return False
        with self._lock:
            return self._served(self._entries.get(key)) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __iter__(self) -> Iterator[CacheKey]:
        return iter([key for key, _ in self.items()])

    def save(self, path: str | PathLike[str]) -> int:
        """Merges this cache into the file at ``path`` (see ``docs/cache-format.md``): the entries
        and blocked tactics that are new or changed since this cache last loaded or saved that
        file win over the file's; the others are the file's business (another process may have
        re-tuned or unblocked them meanwhile).

        Returns:
            The number of entries in the file after the merge.

        Raises:
            CacheFileError: The file could not be written.
        """
        where = file_id(path)
        with self._lock:
            changed, blocked = self._unsynced(where)
        count = persist.save(path, changed, blocklist=blocked)
        with self._lock:
            synced = self._synced.setdefault(where, ({}, {}))
            synced[0].update(changed)
            synced[1].update(blocked)
        return count

    def unsaved(self, path: str | PathLike[str]) -> int:
        """How many entries and blocked tactics :meth:`save` would still write to ``path``: 0
        right after a save there returned, more after a save that failed."""
        with self._lock:
            changed, blocked = self._unsynced(file_id(path))
        return len(changed) + len(blocked)

    def _unsynced(self, where: str) -> tuple[dict[CacheKey, CacheEntry], Blocklist]:
        known, known_blocked = self._synced.get(where, ({}, {}))
        # By identity, for entries and blocked tactics alike: a tactic blocked again after an
        # unblock has the ident the file once had, but it is a new item the file lacks now.
        changed = {k: e for k, e in self._entries.items() if known.get(k) is not e}
        blocked = {i: b for i, b in self._blocked.items() if known_blocked.get(i) is not b}
        return changed, blocked

    def load(self, path: str | PathLike[str], *, strict: bool | None = None) -> int:
        """Adds the entries and blocklist of the file at ``path``; entries already in memory win.

        A missing, corrupt, wrong-version or other-environment file adds nothing and logs one
        warning (a missing file only logs at debug level: it is the normal first run).

        Args:
            path: Cache file.
            strict: Raise :class:`CacheFileError` instead of warning; ``None`` reads
                ``GRAPHTUNE_STRICT_CACHE``.

        Returns:
            The number of entries added.
        """
        loaded = persist.load_file(path, strict=strict)
        with self._lock:
            added = {k: v for k, v in loaded.entries.items() if k not in self._entries}
            self._entries.update(added)
            self.version += 1
            for ident, item in loaded.blocklist.items():
                self._blocked.setdefault(ident, item)
            synced = self._synced.setdefault(file_id(path), ({}, {}))
            synced[0].update(added)
            # As for entries: only what memory took from the file is the file's; an item memory
            # already held is newer and is written by the next save.
            synced[1].update({i: b for i, b in loaded.blocklist.items() if self._blocked[i] is b})
        return len(added)
