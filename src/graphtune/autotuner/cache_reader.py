"""Reading a tuning cache file: the one parser that loading, ``graphtune cache show``, ``verify``
and ``merge`` share, and :func:`not_a_cache_file`, the test of what graphtune may remove or
replace. Writing is :mod:`graphtune.autotuner.persist`; the format is ``docs/cache-format.md``.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any

from graphtune.autotuner.entries import BlockedTactic, CacheEntry, CacheKey, entry_problems
from graphtune.errors import CacheFileError
from graphtune.finite_json import parse_json

FORMAT_VERSION = 2

Entries = dict[CacheKey, CacheEntry]


class Unusable(Exception):
    """The file cannot be used; the message says why (for :mod:`graphtune.autotuner.persist`,
    which turns it into a warning or a :class:`~graphtune.errors.CacheFileError`)."""


class Unreadable(Unusable):
    """The file exists but could not be read (``EACCES``, ``EIO``...): nothing is known of its
    content, so a save never moves it aside or replaces it (it fails as on an unwritable file)."""


def read_document(path: str | PathLike[str]) -> dict[str, Any]:
    """Parses a cache file without checking its environment (for ``graphtune cache show``).

    Returns:
        ``{"format_version", "fingerprint", "entries": {CacheKey: CacheEntry},
        "blocklist": {(runner_id, tactic text): BlockedTactic}, "ignored": [str]}``: the
        entries usable for their keys, and why each other one is not
        (:func:`~graphtune.autotuner.entries.entry_problems`).

    Raises:
        CacheFileError: The file is missing, not valid JSON, of another format version or has
            malformed entries.
    """
    return read_raw_and_document(path)[1]


def read_raw_and_document(path: str | PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The cache file's JSON object as it is (:func:`raw_document`) and its parsed form
    (:func:`read_document`'s), from one read: for changing one part of a file and writing the
    rest back as it was (``graphtune cache unblock``).

    Raises:
        CacheFileError: As :func:`read_document`.
    """
    try:
        raw = raw_document(Path(path))
        return raw, parse_document(raw)
    except Unusable as exc:
        raise CacheFileError(f"cache file {path}: {exc}") from None


def read_text(path: Path) -> str:
    """The text of the regular file ``path``; raises :class:`Unusable` saying why not (a FIFO
    or a device is refused before it is opened: reading one would block or never end), or
    :class:`Unreadable` when reading it fails (its content is then unknown). Also
    the reader of the misses file (:func:`graphtune.autotuner.calls.load_misses`)."""
    try:
        if path.exists() and not path.is_file():
            raise Unusable("is not a regular file")
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise Unusable("does not exist") from None
    except OSError as exc:
        raise Unreadable(f"cannot be read ({exc})") from None
    except UnicodeDecodeError as exc:
        raise Unusable(f"is corrupt (not UTF-8 text: {exc})") from None


def parse(path: Path) -> dict[str, Any]:
    """:func:`parse_document` of the file ``path``; :class:`Unusable` says why it cannot be."""
    return parse_document(raw_document(path))


def raw_document(path: Path) -> dict[str, Any]:
    """The JSON object of the graphtune cache file ``path`` of any format version, unchecked
    beyond that; :class:`Unusable` when the file is no graphtune cache (or cannot be read)."""
    return _parse_cache_json(read_text(path))


def parse_document(doc: dict[str, Any]) -> dict[str, Any]:
    """The usable content of a cache file's JSON object (:func:`raw_document`), in the form
    :func:`read_document` returns; :class:`Unusable` for another format version or a malformed
    entry or blocklist item."""
    problem = version_problem(doc["format_version"])
    if problem is not None:
        raise Unusable(f"has {problem}")
    entries: Entries = {}
    ignored: list[str] = []
    try:
        for item in _list_field(doc, "entries"):
            key = CacheKey.from_json(_list_item(item, "key"))
            entry = CacheEntry.from_json(_list_item(item, "value"))
            problems = entry_problems(key, entry)
            if problems:
                ignored.append(f"op {key.op!r} shapes {list(key.shapes)}: {'; '.join(problems)}")
            else:
                entries[key] = entry
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise Unusable(f"is corrupt (malformed entry: {exc})") from None
    try:
        # Optional: files written before the blocklist existed have none.
        blocked = [
            BlockedTactic.from_json(item) for item in _list_field(doc, "blocklist", optional=True)
        ]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise Unusable(
            f"is corrupt (malformed blocklist: {exc}); `graphtune cache unblock FILE "
            "--malformed` removes the blocklist items it cannot parse"
        ) from None
    fingerprint = doc.get("fingerprint")
    if not isinstance(fingerprint, dict):
        raise Unusable(
            f"is corrupt (its fingerprint is {type(fingerprint).__name__}, not an object)"
        )
    return {
        "format_version": doc["format_version"],
        "fingerprint": fingerprint,
        "entries": entries,
        "blocklist": {item.ident: item for item in blocked},
        "ignored": ignored,
    }


def version_problem(
    version: Any, *, name: str = "format_version", expected: int = FORMAT_VERSION
) -> str | None:
    """What is wrong with a file's version field (completing "has ..."), or ``None``: it must be
    the JSON integer ``expected``; ``"2"``, ``2.0`` and ``true`` are refused, not read as it.
    The one rule of the tuning cache's ``format_version`` and the misses file's ``version``
    (``name`` and ``expected`` name the field and the version this graphtune reads)."""
    if type(version) is not int:
        kind = type(version).__name__
        how = (
            "a number, not a string" if isinstance(version, str) else f"a JSON integer, not {kind}"
        )
        return (
            f"{name} {version!r} ({kind}); it must be the integer {expected} ({how}) for this "
            "graphtune to read it"
        )
    if version != expected:
        return f"{name} {version!r}; this graphtune reads {expected}"
    return None


def _parse_cache_json(text: str) -> dict[str, Any]:
    """The JSON object of a graphtune cache file of any format version; :class:`Unusable`
    when ``text`` is not one."""
    try:
        doc = parse_json(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise Unusable(f"is corrupt or truncated (invalid JSON: {exc})") from None
    if not isinstance(doc, dict) or "format_version" not in doc:
        raise Unusable("is not a graphtune cache (no format_version)")
    return doc


def _list_field(doc: dict[str, Any], name: str, *, optional: bool = False) -> list[Any]:
    value = doc.get(name, [] if optional else None)
    if not isinstance(value, list):
        what = "missing" if value is None else f"{type(value).__name__}, not a list"
        raise ValueError(f"{name!r} is {what}")
    return value


def _list_item(item: Any, name: str) -> Any:
    if not isinstance(item, dict) or name not in item:
        raise ValueError(f"an entry has no {name!r}")
    return item[name]


def read_cache_json(path: str | PathLike[str]) -> dict[str, Any]:
    """The JSON object of the graphtune cache file ``path``, of any format version, unchecked
    beyond that (``graphtune cache verify`` checks the rest item by item).

    Raises:
        CacheFileError: The file is missing, not a regular file, unreadable, not JSON, or has no
            ``format_version``.
    """
    try:
        return raw_document(Path(path))
    except Unusable as exc:
        raise CacheFileError(
            f"cache file {path} {exc}; pass a graphtune tuning cache file"
        ) from None


def not_a_cache_file(path: str | PathLike[str]) -> str | None:
    """Why the existing file ``path`` is not a graphtune tuning cache file, or ``None`` when it
    is one (of any format version or environment: a save moves those aside to
    ``FILE.unusable`` before writing its own).

    ``graphtune cache clear`` removes, and the commands that save a cache overwrite, only files
    for which this is ``None``, so a mistyped path never destroys another file.
    """
    try:
        raw_document(Path(path))
    except Unusable as exc:
        return str(exc)
    return None
