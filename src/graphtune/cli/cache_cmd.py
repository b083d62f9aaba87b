"""``graphtune cache show|clear PATH``: inspect or delete a tuning cache file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from graphtune.autotuner import persist
from graphtune.autotuner.fingerprint import (
    FINGERPRINT_FIELDS,
    environment_fingerprint,
    fingerprint_mismatch,
)
from graphtune.autotuner.runner import short_runner_name
from graphtune.errors import CacheFileError
from graphtune.reporting import render_table

COLUMNS = (
    "op", "runner", "shapes", "dtypes", "mode", "tactic", "time (us)", "fallback (us)", "speed-up",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``cache show`` and ``cache clear``."""
    cache = subparsers.add_parser("cache", help="inspect or delete a tuning cache file")
    actions = cache.add_subparsers(dest="cache_command", metavar="ACTION")
    show = actions.add_parser("show", help="print the entries and environment of a cache file")
    show.add_argument("path", metavar="PATH", type=Path, help="tuning cache file (JSON)")
    show.set_defaults(handler=show_command)
    clear = actions.add_parser("clear", help="delete a cache file and its lock file")
    clear.add_argument("path", metavar="PATH", type=Path, help="tuning cache file (JSON)")
    clear.set_defaults(handler=clear_command)
    cache.set_defaults(handler=lambda args: _usage(cache))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _shapes(shapes: tuple[Any, ...]) -> str:
    return ", ".join("x".join(map(str, s)) if s is not None else "-" for s in shapes)


def show_command(args: argparse.Namespace) -> int:
    """Prints the fingerprint header and one row per entry; 1 if the file is unusable."""
    path: Path = args.path
    try:
        doc = persist.read_document(path)
    except CacheFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    saved = doc["fingerprint"] if isinstance(doc["fingerprint"], dict) else {}
    header = [(name, saved.get(name)) for name in FINGERPRINT_FIELDS]
    header.append(("format_version", doc["format_version"]))
    print(render_table(f"tuning cache {path}", ("field", "value"), header))
    diffs = fingerprint_mismatch(doc["fingerprint"], environment_fingerprint())
    if diffs:
        print("This environment differs, so graphtune skips this file here: " + "; ".join(diffs))
    else:
        print("Matches this environment.")
    rows = []
    for key, entry in sorted(doc["entries"].items(), key=lambda kv: (kv[0].op, kv[0].shapes)):
        rows.append(
            (
                key.op,
                short_runner_name(entry.runner_id),
                _shapes(key.shapes),
                ", ".join(key.dtypes),
                key.timing,
                json.dumps(entry.tactic),
                entry.time_us,
                entry.fallback_us,
                entry.speedup,
            )
        )
    if rows:
        print(render_table(f"{len(rows)} entries", COLUMNS, rows, width=200))
    else:
        print("No entries.")
    return 0


def clear_command(args: argparse.Namespace) -> int:
    """Removes the cache file and its lock file; 1 if the file does not exist."""
    path: Path = args.path
    lock = persist.lock_path(path)
    if not path.exists():
        print(f"error: no tuning cache at {path}; nothing removed.", file=sys.stderr)
        return 1
    try:
        path.unlink()
        lock.unlink(missing_ok=True)
    except OSError as exc:
        print(f"error: could not remove {path}: {exc}", file=sys.stderr)
        return 1
    print(f"Removed tuning cache {path} (and its lock file).")
    return 0
