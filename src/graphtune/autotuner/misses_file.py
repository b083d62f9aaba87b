"""What makes a JSON document a misses file this graphtune reads and merges into: its format
name and version (:class:`~graphtune.autotuner.calls.MissLog` writes such files,
:func:`~graphtune.autotuner.calls.load_misses` reads them). The version is checked by the rule
of the tuning cache's ``format_version``
(:func:`~graphtune.autotuner.cache_reader.version_problem`), so both refuse a string or a
float for the integer alike and say so alike.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any

from graphtune.autotuner.cache_reader import Unusable, read_text, version_problem
from graphtune.finite_json import parse_json

MISSES_FORMAT = "graphtune-misses"
MISSES_VERSION = 1


def misses_version_problem(doc: dict[str, Any]) -> str | None:
    """What is wrong with the ``version`` of a misses document (completing "has ..."), or
    ``None`` when this graphtune reads it."""
    return version_problem(doc.get("version"), name="version", expected=MISSES_VERSION)


def is_misses_doc(doc: Any) -> bool:
    """Whether ``doc`` is a misses document of this version with a list of misses."""
    return (
        isinstance(doc, dict)
        and doc.get("format") == MISSES_FORMAT
        and misses_version_problem(doc) is None
        and isinstance(doc.get("misses"), list)
    )


def misses_doc_problem(doc: Any) -> str | None:
    """Why ``doc`` is not a misses document this graphtune may merge into (completing "it
    ..."), or ``None``."""
    if is_misses_doc(doc):
        return None
    if isinstance(doc, dict) and "format_version" in doc:
        return "is a graphtune tuning cache, not a misses file"
    if isinstance(doc, dict) and doc.get("format") == MISSES_FORMAT:
        problem = misses_version_problem(doc)
        if problem is None:
            return "is a misses file without a list of misses"
        return f"is a misses file of {problem}"
    return f"is not a graphtune misses file (format {MISSES_FORMAT!r})"


def not_a_misses_file(path: str | PathLike[str]) -> str | None:
    """Why the existing file ``path`` is no record of missed shapes (completing "it ..."), or
    ``None`` when it is one, of any version (a save moves one it cannot merge into aside to
    ``FILE.unusable``). The CLI refuses a ``GRAPHTUNE_MISSES`` for which this is not ``None``
    before a run, as it refuses a cache path that is no tuning cache."""
    try:
        doc = parse_json(read_text(Path(path)))
    except Unusable as exc:
        return str(exc)
    except (ValueError, RecursionError) as exc:
        return f"is not JSON ({exc})"
    if isinstance(doc, dict) and doc.get("format") == MISSES_FORMAT:
        return None
    return misses_doc_problem(doc)
