"""In-memory tuning cache: (op, runners, bucketed shapes, dtypes, timing mode) -> pick.

The key holds the identity of every runner offered (class and ``cache_key_extras``), so changing
the runner set, a runner's extras or the timing mode never reuses a stale pick. The value names
the winning runner by identity as well as by index, so a lookup can check it still matches.

The cache also holds a *blocklist* of (runner id, tactic) pairs that crashed, hung or corrupted
the CUDA context while being timed. The tuner consults it before timing, so a tactic that killed
a worker once is not tried again until the user clears it (``graphtune cache unblock``).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from os import PathLike
from typing import Any


@dataclass(frozen=True)
class CacheKey:
    """Identity of one tuned (op, profile).

    Attributes:
        op: Op name given to ``choose_one``.
        runners: Identity of each runner offered, in order (see ``runner_id``).
        shapes: Bucketed shape of each input (``None`` for non-tensors).
        dtypes: dtype name of each input.
        timing: Name of the timer the times come from (``graph``, ``events``, ``wallclock``...).
    """

    op: str
    runners: tuple[str, ...]
    shapes: tuple[tuple[int, ...] | None, ...]
    dtypes: tuple[str, ...]
    timing: str

    def to_json(self) -> dict[str, Any]:
        """JSON form (lists instead of tuples)."""
        return {
            "op": self.op,
            "runners": list(self.runners),
            "shapes": [list(s) if s is not None else None for s in self.shapes],
            "dtypes": list(self.dtypes),
            "timing": self.timing,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CacheKey:
        """Inverse of :meth:`to_json`; raises ``ValueError``, ``KeyError`` or ``TypeError``."""
        shapes = tuple(tuple(int(d) for d in s) if s is not None else None for s in data["shapes"])
        key = cls(
            op=str(data["op"]),
            runners=tuple(str(r) for r in data["runners"]),
            shapes=shapes,
            dtypes=tuple(str(d) for d in data["dtypes"]),
            timing=str(data["timing"]),
        )
        if len(key.shapes) != len(key.dtypes) or not key.runners:
            raise ValueError(f"inconsistent cache key {data!r}")
        return key


@dataclass(frozen=True)
class CacheEntry:
    """The pick for one key.

    Attributes:
        runner_id: Identity of the winning runner.
        runner_index: Its position in the runner list of the key.
        tactic: Winning tactic (a JSON value; ``-1`` when everything failed).
        time_us: Its measured per-call time, ``None`` when every candidate failed.
        fallback_us: Time of ``(runners[0], -1)``, the untuned choice; ``None`` if it failed.
        tuned_by: How distributed tuning made the pick, ``{"strategy": ..., "world_size": ...}``;
            ``None`` when the tuner was not distributed (then the file has no such field).
    """

    runner_id: str
    runner_index: int
    tactic: Any
    time_us: float | None
    fallback_us: float | None
    tuned_by: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    @property
    def speedup(self) -> float | None:
        """``fallback_us / time_us``, or ``None`` when either is unknown."""
        if not self.time_us or self.fallback_us is None or not math.isfinite(self.fallback_us):
            return None
        return self.fallback_us / self.time_us

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        data = {
            "runner_id": self.runner_id,
            "runner_index": self.runner_index,
            "tactic": self.tactic,
            "time_us": self.time_us,
            "fallback_us": self.fallback_us,
        }
        if self.tuned_by is not None:  # only then, so other files keep their exact old layout
            data["tuned_by"] = dict(self.tuned_by)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CacheEntry:
        """Inverse of :meth:`to_json`; raises on malformed data."""
        time_us = data["time_us"]
        fallback_us = data["fallback_us"]
        tuned_by = data.get("tuned_by")
        if tuned_by is not None:
            tuned_by = {
                "strategy": str(tuned_by["strategy"]),
                "world_size": int(tuned_by["world_size"]),
            }
        return cls(
            runner_id=str(data["runner_id"]),
            runner_index=int(data["runner_index"]),
            tactic=data["tactic"],
            time_us=float(time_us) if time_us is not None else None,
            fallback_us=float(fallback_us) if fallback_us is not None else None,
            tuned_by=tuned_by,
        )


def tactic_text(tactic: Any) -> str:
    """Canonical JSON text of a tactic: tuples become lists, dict keys are sorted.

    Two spellings of one tactic (``(64, 2)`` and ``[64, 2]``, or dicts in another key order) give
    the same text, so the blocklist matches a tactic however the runner spells it.
    """
    return json.dumps(tactic, sort_keys=True, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class BlockedTactic:
    """A (runner, tactic) that must not be timed again: it crashed, hung or broke the context.

    Attributes:
        runner_id: Identity of the runner (see ``runner_id``).
        tactic: The tactic (a JSON value).
        reason: Why it was blocked, e.g. ``"timeout after 60.0 s"`` or ``"crash: exit code -11"``.
        op: The op being tuned when it failed (for people reading the file).
        shapes: The profile being tuned when it failed (``describe()`` form), for the same reason.
    """

    runner_id: str
    tactic: Any
    reason: str
    op: str = ""
    shapes: str = ""

    @property
    def ident(self) -> tuple[str, str]:
        """``(runner_id, canonical tactic text)``: what the blocklist is keyed by."""
        return (self.runner_id, tactic_text(self.tactic))

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "runner_id": self.runner_id,
            "tactic": self.tactic,
            "reason": self.reason,
            "op": self.op,
            "shapes": self.shapes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BlockedTactic:
        """Inverse of :meth:`to_json`; raises ``KeyError``/``TypeError`` on malformed data."""
        if not isinstance(data, dict):
            raise TypeError(f"blocklist item must be an object, got {type(data).__name__}")
        return cls(
            runner_id=str(data["runner_id"]),
            tactic=data["tactic"],
            reason=str(data["reason"]),
            op=str(data.get("op", "")),
            shapes=str(data.get("shapes", "")),
        )


Blocklist = dict[tuple[str, str], BlockedTactic]


class TuningCache:
    """Thread-safe mapping of :class:`CacheKey` to :class:`CacheEntry`, plus the blocklist, with
    file load/save."""

    def __init__(self) -> None:
        self._entries: dict[CacheKey, CacheEntry] = {}
        self._blocked: Blocklist = {}
        self._lock = threading.Lock()
        #: Bumped by every change of the entries, so look-up memos know when to forget.
        self.version = 0

    def get(self, key: CacheKey) -> CacheEntry | None:
        """The entry for ``key``, or ``None``."""
        with self._lock:
            return self._entries.get(key)

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
        """Adds (or replaces) a blocked (runner, tactic)."""
        with self._lock:
            self._blocked[item.ident] = item

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
            return count

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __iter__(self) -> Iterator[CacheKey]:
        return iter([key for key, _ in self.items()])

    def save(self, path: str | PathLike[str]) -> int:
        """Merges this cache into the file at ``path`` (see ``docs/cache-format.md``).

        Returns:
            The number of entries in the file after the merge.

        Raises:
            CacheFileError: The file could not be written.
        """
        from graphtune.autotuner import persist

        with self._lock:
            blocked = dict(self._blocked)
        return persist.save(path, dict(self.items()), blocklist=blocked)

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
        from graphtune.autotuner import persist

        loaded = persist.load_file(path, strict=strict)
        with self._lock:
            added = {k: v for k, v in loaded.entries.items() if k not in self._entries}
            self._entries.update(added)
            self.version += 1
            for ident, item in loaded.blocklist.items():
                self._blocked.setdefault(ident, item)
        return len(added)
