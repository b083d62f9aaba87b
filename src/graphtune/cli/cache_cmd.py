"""``graphtune cache show|clear|verify|merge|unblock``: inspect, check, combine or delete tuning
cache files.

The autotuner's modules are imported by the handlers (building the parser imports no torch). A
file that cannot be used is an ``error:`` line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from graphtune.cli._args import cache_file, check_cache_path, usage
from graphtune.errors import CacheFileError

COLUMNS = (
    "op",
    "runner",
    "shapes",
    "dtypes",
    "device",
    "mode",
    "tactic",
    "time (us)",
    "fallback (us)",
    "speed-up",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``cache show``, ``clear``, ``verify``, ``merge`` and ``unblock``."""
    cache = subparsers.add_parser(
        "cache",
        help="inspect, check, merge or delete tuning cache files",
        description="Inspect, check, merge or delete tuning cache files (docs/cache-format.md).",
    )
    actions = cache.add_subparsers(dest="cache_command", metavar="ACTION")
    show = actions.add_parser(
        "show",
        help="print the entries and environment of a cache file",
        description="Prints a cache file's environment fingerprint (and whether it matches this "
        "one), its entries and its blocked tactics.",
    )
    show.add_argument("path", metavar="PATH", type=Path, help="tuning cache file (JSON)")
    show.set_defaults(handler=show_command)
    clear = actions.add_parser(
        "clear",
        help="delete a cache file (waits for a save in progress)",
        description="Deletes a tuning cache file under its lock, so a save in progress finishes "
        "first; the lock file stays. A symbolic link's target is deleted (the file saves "
        "through the link write) and the link stays. Exit 1 when there is no cache file.",
    )
    clear.add_argument("path", metavar="PATH", type=Path, help="tuning cache file (JSON)")
    clear.set_defaults(handler=clear_command)
    verify = actions.add_parser(
        "verify",
        help="check a cache file; exit 0 when usable here, 1 when anything is wrong",
        description="Checks a tuning cache file and prints every problem: parse errors, format "
        "version, fingerprint vs this environment, malformed entries (runner not in the key, "
        "non-finite times, tactics that are not JSON), malformed blocklist items; and a summary "
        "of the blocklist. Exit 0: usable here; 1: problems.",
    )
    verify.add_argument("path", metavar="FILE", type=Path, help="tuning cache file (JSON)")
    verify.set_defaults(handler=verify_command)
    merge = actions.add_parser(
        "merge",
        help="merge two cache files into a third (faster recorded time wins; ties keep A)",
        description="Merges cache files A and B into C. Rule: A and B must come from the same "
        "environment (equal fingerprints) unless --force (C gets A's fingerprint). A key in one "
        "file only is copied. For a key in both, the entry with the faster recorded time_us is "
        "kept (the timing mode, cold L2 included, is part of the key, so both were measured the "
        "same way); an entry with a time beats one without; ties keep A's. With --prefer b, "
        "B's entry is kept "
        "instead (as a save keeps its own: merge a failed save's fallback file so). Blocklists "
        "are unioned (A's reason wins). "
        "C is written atomically under its lock file; it may be A or B. An existing C that is "
        "neither is merged into, as a save does: its entries and blocked tactics whose keys A "
        "and B lack are kept (`graphtune cache clear C` first to replace it). An existing C "
        "that is not a tuning cache is refused.",
    )
    merge.add_argument("a", metavar="A", type=Path, help="first cache file (wins ties)")
    merge.add_argument("b", metavar="B", type=Path, help="second cache file")
    merge.add_argument(
        "-o", "--output", required=True, type=cache_file, metavar="C", help="output file (required)"
    )
    merge.add_argument("--force", action="store_true", help="merge even if the fingerprints differ")
    merge.add_argument(
        "--prefer",
        choices=("faster", "b"),
        default="faster",
        help="which entry a key in both files keeps: the faster recorded time (default) or B's",
    )
    merge.set_defaults(handler=merge_command)
    unblock = actions.add_parser(
        "unblock",
        help="remove blocklisted tactics from a cache file so tuning retries them",
        description="Removes blocked (runner, tactic) pairs from a cache file; with no filter, "
        "all of them. Entries are untouched (also those loading ignores), as is the rest of "
        "the file.",
    )
    unblock.add_argument("path", metavar="FILE", type=Path, help="tuning cache file (JSON)")
    unblock.add_argument(
        "--runner", metavar="ID", help="only this runner id (see verify; default: every runner)"
    )
    unblock.add_argument(
        "--tactic",
        metavar="JSON",
        type=_json_text,
        help="only this tactic, as JSON as `cache show` prints it, e.g. 3, [64,2] or "
        '{"__dtype__":"float16"} (default: every tactic)',
    )
    unblock.add_argument(
        "--malformed",
        action="store_true",
        help="remove the blocklist items that cannot be parsed (a blocklist damaged by hand makes "
        "the whole file unusable); without --runner/--tactic only those",
    )
    unblock.set_defaults(handler=unblock_command)
    cache.set_defaults(handler=lambda args: usage(cache))


def _json_text(text: str) -> str:
    """``argparse`` type: text that parses as JSON (returned as given)."""
    try:
        json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not JSON (e.g. 3, '\"a\"', '[1, 2]')"
        ) from None
    return text


def _shapes(shapes: tuple[Any, ...]) -> str:
    return ", ".join("x".join(map(str, s)) if s is not None else "-" for s in shapes)


def show_command(args: argparse.Namespace) -> int:
    """Prints the fingerprint header and one row per entry; 1 if the file is unusable."""
    from graphtune.autotuner import cache_reader
    from graphtune.autotuner.entries import tactic_text
    from graphtune.autotuner.fingerprint import (
        FINGERPRINT_FIELDS,
        environment_fingerprint,
        fingerprint_mismatch,
    )
    from graphtune.autotuner.identity import short_runner_name
    from graphtune.reporting import render_table

    path: Path = args.path
    doc = cache_reader.read_document(path)
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
                key.device,
                key.timing,
                tactic_text(entry.tactic),
                entry.time_us,
                entry.fallback_us,
                entry.speedup,
            )
        )
    if rows:
        print(render_table(f"{len(rows)} entries", COLUMNS, rows, width=200))
    else:
        print("No entries.")
    if doc["ignored"]:
        print(
            f"{len(doc['ignored'])} entries no look-up can use are not shown (`graphtune cache "
            f"verify {path}` lists why), e.g. {doc['ignored'][0]}"
        )
    blocked = [
        (short_runner_name(b.runner_id), tactic_text(b.tactic), b.op, b.reason)
        for b in doc["blocklist"].values()
    ]
    if blocked:
        title = f"{len(blocked)} blocked tactics (never timed; `graphtune cache unblock` clears)"
        print(render_table(title, ("runner", "tactic", "op", "reason"), blocked, width=200))
    return 0


def verify_command(args: argparse.Namespace) -> int:
    """Prints every problem of the file; 0 when usable here, 1 otherwise (one ``error:`` line
    on stderr)."""
    from graphtune.autotuner import maintenance

    report = maintenance.verify_file(args.path)
    for note in report.notes:
        print(note)
    if report.ok:
        print(f"OK: {args.path} is usable in this environment.")
        return 0
    lines = [f"problem: {p}" for p in report.problems] + [f"ignored: {p}" for p in report.ignored]
    if report.problems and len(lines) == 1:
        raise CacheFileError(
            f"cache file {args.path}: {report.problems[0]}; graphtune would skip this file here"
        )
    print("\n".join(lines))
    if report.problems:
        raise CacheFileError(
            f"cache file {args.path} has {len(report.problems)} problems (listed above); "
            "graphtune would skip this file here"
        )
    # Entries, not lines: one entry can have several problems.
    ignored = report.ignored_entries
    raise CacheFileError(
        f"cache file {args.path}: graphtune would ignore the {ignored} "
        f"entr{'y' if ignored == 1 else 'ies'} listed above and use the other "
        f"{report.entries - ignored}; re-tune those shapes, or save over the file to drop them"
    )


def merge_command(args: argparse.Namespace) -> int:
    """Merges A and B into the output; 1 when an input is unusable or environments differ."""
    from graphtune.autotuner import maintenance

    _require_files(args.a, args.b)  # before the output's lock file is made
    # As a cache path: an existing file there must be a tuning cache (never someone's notes).
    check_cache_path(args.output, "--output")
    report = maintenance.merge_files(
        args.a, args.b, args.output, force=args.force, prefer=args.prefer
    )
    for problem in report.ignored:
        print(f"left out: {problem}")
    print(
        f"Wrote {args.output}: {report.entries} entries ({report.only_a} only in A, "
        f"{report.only_b} only in B, {report.conflicts_kept_a} conflicts kept A, "
        f"{report.conflicts_kept_b} kept B"
        + (f", {report.kept_output} kept from {args.output}" if report.kept_output else "")
        + f"), {report.blocked} blocked tactics"
        + (f"; {len(report.ignored)} unusable entries left out." if report.ignored else ".")
    )
    return 0


def unblock_command(args: argparse.Namespace) -> int:
    """Removes matching blocklist items; 1 when the file is unusable or the tactic is not JSON."""
    from graphtune.autotuner import persist
    from graphtune.autotuner.entries import tactic_text

    _require_files(args.path)  # no lock file is left beside a path that holds no cache
    if args.malformed:
        from graphtune.autotuner import maintenance

        dropped = maintenance.drop_malformed_blocklist(args.path)
        for problem in dropped:
            print(f"removed malformed {problem}")
        print(f"Removed {len(dropped)} malformed blocklist item(s) from {args.path}.")
        if args.runner is None and args.tactic is None:
            return 0
    tactic = None if args.tactic is None else _tactic(args.tactic)
    runner = None if args.runner is None else _blocked_runner(args.path, args.runner)
    removed = persist.unblock(
        args.path, runner_id=runner, tactic=tactic, match_tactic=args.tactic is not None
    )
    for item in removed:
        print(f"unblocked {item.runner_id} tactic {tactic_text(item.tactic)} ({item.reason})")
    print(f"Removed {len(removed)} blocked tactic(s) from {args.path}.")
    return 0


def _tactic(text: str) -> Any:
    """The tactic ``--tactic`` names, in the file's typed encoding, which ``cache show`` prints:
    ``{"__dtype__":"float16"}`` is the dtype, never a dict of that text."""
    from graphtune.autotuner.values import decode_value
    from graphtune.errors import ConfigError

    try:
        return decode_value(json.loads(text))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"--tactic {text}: {exc}; pass the tactic as `graphtune cache show` prints it "
            '(e.g. 3, [64,2], {"__dtype__":"float16"})'
        ) from None


def _require_files(*paths: Path) -> None:
    """Raises the error reading a missing cache file gives, before any lock file is created."""
    for path in paths:
        if not path.exists():
            raise CacheFileError(f"cache file {path}: does not exist")


def _blocked_runner(path: Path, name: str) -> str:
    """The full id of the blocked runner ``name`` names: its id, or the short name ``cache
    show`` prints when that names one runner of the blocklist."""
    from graphtune.autotuner import cache_reader
    from graphtune.autotuner.identity import short_runner_name

    blocked = cache_reader.read_document(path)["blocklist"].values()
    ids = sorted({item.runner_id for item in blocked})
    if name in ids:
        return name
    matches = [i for i in ids if short_runner_name(i) == name]
    if len(matches) == 1:
        return matches[0]
    listed = ", ".join(ids) or "none"
    rule = "names several" if matches else "names none"
    raise CacheFileError(
        f"--runner {name} {rule} of the blocked runners of {path} ({listed}); pass one of those ids"
    )


def clear_command(args: argparse.Namespace) -> int:
    """Removes the cache file under its lock (the lock file stays: a process waiting on it, or
    holding it mid-save, must keep locking the same file); 1 if the file does not exist.

    A path that is a symbolic link names the file saves write through it: that file (the one
    locked and checked) is removed, and the link stays, as a save keeps it."""
    from graphtune.atomic_files import real_path
    from graphtune.autotuner import save_target

    path: Path = args.path
    if not path.exists():
        raise CacheFileError(f"no tuning cache at {path}; nothing removed")
    # Before the lock too, so no lock file is left beside a file that is not a cache (notes.txt).
    _refuse_other_files(path, real_path(path))
    # Under the lock, so a save in progress finishes first and the next one starts from nothing.
    with save_target.locked(path) as target:
        if not target.exists():
            raise CacheFileError(f"no tuning cache at {path}; nothing removed")
        _refuse_other_files(path, target)  # again: it may have been replaced meanwhile
        try:
            target.unlink()
        except OSError as exc:
            raise CacheFileError(
                f"could not remove {_named(path, target)}: {exc.strerror or exc}"
            ) from None
    link = f"; the link {path} stays" if path.is_symlink() else ""
    print(f"Removed tuning cache {_named(path, target)}{link}.")
    return 0


def _refuse_other_files(path: Path, target: Path) -> None:
    """Raises unless ``target`` (the file ``path`` names) is a graphtune tuning cache: ``cache
    clear`` removes nothing else."""
    from graphtune.autotuner import cache_reader

    reason = cache_reader.not_a_cache_file(target)
    if reason is not None:
        raise CacheFileError(
            f"{_named(path, target)} is not a graphtune tuning cache (it {reason}); nothing "
            "removed. Remove it with rm if that is what you meant"
        )


def _named(path: Path, target: Path) -> str:
    """``path``, or ``target`` and what names it when ``path`` goes through a link."""
    if target == Path(os.path.abspath(path)):
        return str(path)
    return f"{target} (what {path} resolves to)"
