"""Checking and merging tuning cache files (``graphtune cache verify`` and ``cache merge``).

``verify`` reads a file leniently and lists *every* problem, where loading stops at the first and
skips the whole file. ``merge`` combines two files under a stated rule (also in
``docs/cache-format.md`` and ``graphtune cache merge --help``):

* both files must be usable (current ``format_version``, well-formed) and come from the same
  environment (equal fingerprints) unless ``force`` is given; the output carries A's fingerprint;
* a key present in one file only is copied;
* for a key present in both, the entry with the faster recorded ``time_us`` is kept (both entries
  were measured with the same timer and both with a warm or both with a cold L2, because the
  timing mode, cold L2 included, is part of the key); an entry with a time beats one without (a
  lone candidate picked without timing, or a pin without a time: a profile whose candidates all
  failed is never written); a tie, or no time on either side, keeps A's.
  With ``prefer="b"`` B's entry is kept instead, as a save keeps its own new entries (for merging
  a failed save's fallback file, whose entries are the newer measurements);
* blocklists are unioned; for the same (runner, tactic) A's reason is kept;
* an entry that no look-up can use (``graphtune.autotuner.entries.entry_problems``: a runner not
  in its key, a time that is not positive) is left out, and the report lists it;
* an existing output C that is neither A nor B is merged into, as a save merges into its file:
  C's entries and blocked tactics whose keys A and B lack are kept (A's and B's win the others).
  A C of another environment or format version is renamed to ``C.unusable`` first; a C that
  cannot be read fails the merge.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

from graphtune.autotuner import cache_reader, persist, save_target
from graphtune.autotuner.cache import BlockedTactic, CacheEntry, CacheKey
from graphtune.autotuner.entries import entry_problems, tactic_text
from graphtune.autotuner.fingerprint import environment_fingerprint, fingerprint_mismatch
from graphtune.errors import CacheFileError, ConfigError

MERGE_PREFERENCES = ("faster", "b")


@dataclass
class VerifyReport:
    """Result of :func:`verify_file`.

    Attributes:
        problems: What makes graphtune skip the whole file here (unreadable, another format
            version or environment, malformed entries or blocklist items).
        ignored: Why loading ignores well-formed entries (a runner not in the key, a time that
            is not positive, a duplicate key), one line per reason (an entry may have several).
        ignored_entries: How many entries those lines are about.
        notes: Information that is not a problem (counts, blocklist summary).
        entries: Well-formed entries found.
        blocked: Well-formed blocklist items found.
    """

    problems: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    entries: int = 0
    ignored_entries: int = 0
    blocked: list[BlockedTactic] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the file is usable here with every entry."""
        return not self.problems and not self.ignored


def verify_file(
    path: str | PathLike[str], *, fingerprint: dict[str, Any] | None = None
) -> VerifyReport:
    """Checks a cache file and reports every problem found.

    Args:
        path: Cache file.
        fingerprint: Environment to compare with; ``None`` computes this process's.

    Returns:
        The report (never raises for a bad file).
    """
    report = VerifyReport()
    try:
        doc = cache_reader.raw_document(Path(path))
    except cache_reader.Unusable as exc:  # the command's message names the file itself
        report.problems.append(f"the file {exc}")
        return report
    version = cache_reader.version_problem(doc["format_version"])
    if version is not None:
        report.problems.append(f"it has {version} (re-tune to rewrite it)")
        return report
    current = environment_fingerprint() if fingerprint is None else fingerprint
    for diff in fingerprint_mismatch(doc.get("fingerprint"), current):
        report.problems.append(f"fingerprint differs from this environment: {diff}")
    _verify_entries(doc.get("entries"), report)
    _verify_blocklist(doc.get("blocklist", []), report)
    return report


def _verify_entries(items: Any, report: VerifyReport) -> None:
    if not isinstance(items, list):
        report.problems.append(f"'entries' is {type(items).__name__}, expected a list")
        return
    seen: dict[CacheKey, int] = {}
    ignored: set[int] = set()
    for index, item in enumerate(items):
        where = f"entry {index}"
        try:
            if not isinstance(item, dict) or "key" not in item or "value" not in item:
                raise ValueError("expected an object with 'key' and 'value'")
            key = CacheKey.from_json(item["key"])
            entry = CacheEntry.from_json(item["value"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            report.problems.append(f"{where}: malformed ({exc})")
            continue
        where = f"entry {index} (op {key.op!r}, shapes {list(key.shapes)})"
        report.entries += 1
        problems = entry_problems(key, entry)
        report.ignored.extend(f"{where}: {p}" for p in problems)
        if problems:
            ignored.add(index)
            continue
        if key in seen:  # as loading does: the last usable copy of a key is the one used
            report.ignored.append(f"entry {seen[key]}: the same key as {where}, which is used")
            ignored.add(seen[key])
        seen[key] = index
    report.ignored_entries = len(ignored)


def _verify_blocklist(items: Any, report: VerifyReport) -> None:
    if not isinstance(items, list):
        report.problems.append(f"'blocklist' is {type(items).__name__}, expected a list")
        return
    for index, item in enumerate(items):
        try:
            report.blocked.append(BlockedTactic.from_json(item))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            report.problems.append(f"blocklist item {index}: malformed ({exc})")
    report.notes.append(f"{report.entries} entries, {len(report.blocked)} blocked tactics")
    for item in report.blocked:
        report.notes.append(
            f"blocked: {item.runner_id} tactic {tactic_text(item.tactic)} ({item.reason})"
        )


@dataclass
class MergeReport:
    """What :func:`merge_files` did."""

    entries: int = 0
    only_a: int = 0
    only_b: int = 0
    conflicts_kept_a: int = 0
    conflicts_kept_b: int = 0
    #: Entries kept from an existing output that is neither A nor B (keys A and B lack).
    kept_output: int = 0
    blocked: int = 0
    #: Entries of A or B that no look-up can use (``entry_problems``), left out of the output.
    ignored: list[str] = field(default_factory=list)


def _faster(a: CacheEntry, b: CacheEntry) -> bool:
    """Whether B replaces A under the merge rule (strictly faster, or timed where A is not)."""
    if b.time_us is None:
        return False
    return a.time_us is None or b.time_us < a.time_us


def merge_files(
    a: str | PathLike[str],
    b: str | PathLike[str],
    out: str | PathLike[str],
    *,
    force: bool = False,
    prefer: str = "faster",
) -> MergeReport:
    """Merges cache files A and B into ``out`` by the rule in this module's docstring.

    Args:
        prefer: Which entry a key in both files keeps: ``"faster"`` (the faster recorded time)
            or ``"b"`` (B's).

    Raises:
        ConfigError: ``prefer`` is neither.
        CacheFileError: A or B is unusable, their environments differ (without ``force``), or
            ``out`` could not be written.

    An existing ``out`` that is neither A nor B is merged into: its entries and blocked tactics
    whose keys A and B lack are kept, as a save keeps its file's. One that is no usable cache of
    A's environment (another environment or format version) is first renamed to
    ``<name>.unusable[.N]``, with a warning naming where it went, as a save does; one that cannot
    be read is a :class:`CacheFileError`, and it is left as it is.
    """
    if prefer not in MERGE_PREFERENCES:
        raise ConfigError(
            f"merge_files: prefer must be one of {MERGE_PREFERENCES}, got {prefer!r}."
        )
    # Inputs first: an unusable one fails before the output's lock file is made. Read again
    # under the lock, since ``out`` may be A or B and a save to it may come between.
    _read_inputs(a, b, force)
    with save_target.locked(out):  # a save to ``out`` meanwhile (often A itself) is not lost
        report = _merge_locked(a, b, out, force, prefer)
    return report


def _read_inputs(
    a: str | PathLike[str], b: str | PathLike[str], force: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The documents of A and B; :class:`CacheFileError` when one is unusable or (without
    ``force``) their environments differ."""
    doc_a = cache_reader.read_document(a)
    doc_b = cache_reader.read_document(b)
    diffs = fingerprint_mismatch(doc_b["fingerprint"], doc_a["fingerprint"] or {})
    if diffs and not force:
        raise CacheFileError(
            f"cannot merge {b} into {a}: they come from different environments ("
            + "; ".join(d.replace("(file)", "(B)").replace("(here)", "(A)") for d in diffs)
            + "). Picks measured elsewhere are not valid here; re-tune, or pass --force to "
            "merge anyway (the output gets A's fingerprint)."
        )
    return doc_a, doc_b


def _merge_locked(
    a: str | PathLike[str],
    b: str | PathLike[str],
    out: str | PathLike[str],
    force: bool,
    prefer: str,
) -> MergeReport:
    doc_a, doc_b = _read_inputs(a, b, force)
    report = MergeReport()
    report.ignored = [f"A, {p}" for p in doc_a["ignored"]] + [f"B, {p}" for p in doc_b["ignored"]]
    merged = dict(doc_a["entries"])
    report.only_a = len(set(merged) - set(doc_b["entries"]))
    for key, entry in doc_b["entries"].items():
        mine = merged.get(key)
        if mine is None:
            merged[key] = entry
            report.only_b += 1
        elif prefer == "b" or _faster(mine, entry):
            merged[key] = entry
            report.conflicts_kept_b += 1
        else:
            report.conflicts_kept_a += 1
    blocked = dict(doc_b["blocklist"])
    blocked.update(doc_a["blocklist"])  # A's reason wins for the same (runner, tactic)
    if not _is_input(out, a, b):
        # As a save does: C's own picks are kept (A's and B's win a conflict), and a cache of
        # another environment or version is kept as C.unusable.
        existing = persist.existing_output(out, doc_a["fingerprint"])
        for key, entry in existing.entries.items():
            if key not in merged:
                merged[key] = entry
                report.kept_output += 1
        for ident, item in existing.blocklist.items():
            blocked.setdefault(ident, item)
    persist.write_atomic(out, persist.document(merged, doc_a["fingerprint"], blocked), lock=False)
    report.entries = len(merged)
    report.blocked = len(blocked)
    return report


def _is_input(out: str | PathLike[str], *inputs: str | PathLike[str]) -> bool:
    """Whether ``out`` is one of the merged files (its content is then in the output)."""
    for path in inputs:
        try:
            if os.path.samefile(out, path):
                return True
        except OSError:  # ``out`` does not exist yet
            return False
    return False


def drop_malformed_blocklist(path: str | PathLike[str]) -> list[str]:
    """Removes the blocklist items of the cache file ``path`` that cannot be parsed (``graphtune
    cache unblock --malformed``), under its lock; everything else stays as it is. Nothing is
    locked or written when there are none.

    Returns:
        A description of each removed item (its index and what is wrong with it).

    Raises:
        CacheFileError: The file is no graphtune cache, or could not be locked or written.
    """
    path = Path(path)
    if not _split_blocklist(cache_reader.read_cache_json(path))[1]:
        return []
    with save_target.locked(path):
        doc = cache_reader.read_cache_json(path)  # again under the lock
        kept, dropped = _split_blocklist(doc)
        if dropped:
            doc["blocklist"] = kept
            persist.write_atomic(path, doc, lock=False)
    return dropped


def _split_blocklist(doc: dict[str, Any]) -> tuple[list[Any], list[str]]:
    """The parseable blocklist items of a cache document, and a description of each other one
    (a blocklist that is no list counts as one malformed item)."""
    items = doc.get("blocklist", [])
    if not isinstance(items, list):
        return [], [f"the blocklist is {type(items).__name__}, not a list"]
    kept: list[Any] = []
    dropped: list[str] = []
    for index, item in enumerate(items):
        try:
            BlockedTactic.from_json(item)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            dropped.append(f"blocklist item {index}: {exc}")
            continue
        kept.append(item)
    return kept, dropped
