"""Writing a result file (JSON, a plot): atomically, and never losing the data.

:func:`write_result` (and :func:`write_json` for strict JSON) writes a temporary file next to
the target and renames it over the target (``os.replace``), so a reader sees the old file or the
new one, never half of one. When the target cannot be written (a read-only folder, a full disk)
the data goes to a file in the system's temporary folder instead: the returned path says where,
and a warning names both; only when that fails too is an error raised, naming both places.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from graphtune.atomic_files import FallbackFailed, write_with_fallback
from graphtune.atomic_files import write_atomically as _write_atomically
from graphtune.bench.schema import CHECK_FIELDS, is_provenance
from graphtune.errors import ResultsWriteError

logger = logging.getLogger(__name__)


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` (strict JSON has no inf/nan), recursively;
    under a key of :data:`~graphtune.bench.schema.CHECK_FIELDS` as the text ``"nan"``,
    ``"inf"`` or ``"-inf"`` instead, so a failed check never reads as one not run."""
    return _json_safe(value, None)


def _json_safe(value: Any, key: str | None) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value) if key in CHECK_FIELDS else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v, None) for v in value]
    return value


def write_json(path: str | os.PathLike[str], payload: Any) -> Path:
    """Writes ``payload`` as indented strict JSON to ``path`` (:func:`write_result`).

    Non-finite floats become ``null`` (text in a check field, :func:`json_safe`); values JSON
    cannot represent are written with ``str``.
    """
    text = json.dumps(json_safe(payload), indent=2, sort_keys=False, default=str) + "\n"
    return write_result(path, text.encode("utf-8"))


def write_result(path: str | os.PathLike[str], data: bytes) -> Path:
    """Writes ``data`` to ``path`` atomically, or where it can when ``path`` cannot be written.

    Returns:
        The file holding the data: ``path``, or, when ``path`` could not be written, a file in
        the temporary folder (a warning names both).

    Raises:
        ResultsWriteError: Neither ``path`` nor the temporary folder could be written.
    """
    target = Path(path)
    try:
        # Looked up at call time (tests replace it).
        written, first = write_with_fallback(target, data, write=_write_atomically)
    except FallbackFailed as exc:
        raise ResultsWriteError(
            f"could not write the result to {exc.target} ({exc.first}) nor to {exc.fallback} "
            f"({exc.second}); free some disk space or pass a writable path"
        ) from None
    if first is not None:
        logger.warning(
            "could not write %s (%s); the result is in %s instead", target, first, written
        )
    return written


#: The keys of one op's report in the bare list ``graphtune check-tactics --json`` wrote before it
#: carried a provenance record, so that rerunning the command may replace such an earlier report.
CHECK_TACTICS_REPORT_KEYS = frozenset({"op", "profile", "passed", "reference_error", "checks"})
#: A result JSON is kilobytes; a bigger file (a model's weights) is not read whole to find out.
_RESULT_MAX_BYTES = 64 * 2**20


def graphtune_result_file(path: Path) -> bool:
    """Whether the existing file ``path`` is a graphtune result, which a command's ``--json`` may
    replace: a JSON object whose ``provenance`` is a provenance record
    (:func:`~graphtune.bench.schema.is_provenance`; ``bench decode``, ``check-tactics``), or
    the non-empty list of op reports an earlier ``check-tactics`` wrote
    (:data:`CHECK_TACTICS_REPORT_KEYS`; ``[]`` is anybody's JSON). Any other file is somebody's
    data (:func:`graphtune.cli._args.check_output_path` refuses it)."""
    try:
        if path.stat().st_size > _RESULT_MAX_BYTES:
            return False
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    if isinstance(doc, dict):
        return is_provenance(doc.get("provenance"))
    return (
        isinstance(doc, list)
        and bool(doc)
        and all(isinstance(item, dict) and CHECK_TACTICS_REPORT_KEYS <= set(item) for item in doc)
    )


def graphtune_data_file(path: Path) -> str | None:
    """``"a graphtune tuning cache"`` or ``"a graphtune misses file"`` (of any version) when
    the existing file ``path`` is one, else ``None``: results must not be written over such a
    file (:func:`graphtune.cli._args.check_output_path`). The kinds are decided by their readers
    (:func:`~graphtune.autotuner.cache_reader.not_a_cache_file`,
    :data:`~graphtune.autotuner.misses_file.MISSES_FORMAT`)."""
    from graphtune.autotuner.cache_reader import not_a_cache_file
    from graphtune.autotuner.misses_file import MISSES_FORMAT
    from graphtune.finite_json import parse_json

    if not_a_cache_file(path) is None:
        return "a graphtune tuning cache"
    try:
        doc = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if isinstance(doc, dict) and doc.get("format") == MISSES_FORMAT:
        return "a graphtune misses file"
    return None
