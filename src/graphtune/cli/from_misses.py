"""``graphtune tune --from-misses FILE``: tune exactly the shapes a serving process missed.

A serving process records every call that ran the fallback because its shape was not tuned
(``AutoTuner.misses``, saved by ``autotune(misses_path=FILE)``, ``GRAPHTUNE_MISSES=FILE`` or
``tuner.misses.save(FILE)``). This rebuilds each recorded call through the op registry of
:mod:`graphtune.ops` (same runners, config and input shapes) and tunes only the bucket it missed,
adding the picks to ``--cache``.

``graphtune tune`` adds these options with :func:`add_arguments` and hands over to :func:`run`
when ``--from-misses`` is given (no ``--model`` is needed then).
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from graphtune.cli._args import timing_timer
from graphtune.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--from-misses FILE`` (and what it needs that ``tune`` may not have) to ``parser``."""
    parser.add_argument(
        "--from-misses",
        type=Path,
        default=None,
        metavar="FILE",
        help="tune exactly the shapes recorded in this misses file (AutoTuner.misses.save); "
        "--model is not needed then (default: none, tune the step of --model)",
    )
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="with --from-misses: import this module first, so the ops it registers "
        "(graphtune.ops.registry.register_op) can be rebuilt; repeat for several "
        "(default: graphtune.ops only)",
    )


def run(args: argparse.Namespace) -> int:
    """Tunes the recorded misses into ``args.cache``; prints the picks and what was skipped.

    Reads ``args.from_misses``, ``args.cache``, ``args.device`` (``auto``: each record's own
    device type) and ``args.timing``. Returns 0, or 1 when a record could not be rebuilt; an
    unreadable file raises (one ``error:`` line, exit 1, from :mod:`graphtune.cli.main`).
    """
    import graphtune.ops  # noqa: F401  (registers the ops the records name)
    from graphtune.autotuner import AutoTuner, autotune, load_misses
    from graphtune.engine.devices import resolve_device
    from graphtune.ops.registry import tune_records

    for name in args.imports:
        try:
            importlib.import_module(name)
        except Exception as exc:  # whatever the user's module raises, say which and why
            raise ConfigError(
                f"--import {name}: the module could not be imported ({type(exc).__name__}: "
                f"{exc}); check its name and that it is on PYTHONPATH"
            ) from None
    records = load_misses(args.from_misses)
    if not records:
        print(f"{args.from_misses} holds no recorded misses; nothing to tune")
        return 0
    device = None if args.device == "auto" else resolve_device(args.device)
    timing = getattr(args, "timing", "auto")
    # With --device auto each record keeps its device: time on this machine's best one.
    timer = timing_timer(timing, device or resolve_device("auto"))
    tuner = AutoTuner(timer=timer)
    with autotune(args.cache, tuner, tune=True):
        report = tune_records(records, tuner, device)
    cached = report.already_cached
    table = tuner.summary_table(f"picks for the {len(records)} recorded misses")
    print(table or _nothing_tuned(cached, len(report.skipped), tuner.stats.profiles_failed))
    for record, reason in report.skipped:
        print(f"skipped {record.op}: {reason}")
    tuned = len(report.tuned) - cached
    if cached:
        print(f"{cached} of {len(records)} recorded calls already in {args.cache}; {tuned} tuned")
    else:
        print(f"{tuned} of {len(records)} recorded calls tuned into {args.cache}")
    return 1 if report.skipped else 0


def _nothing_tuned(cached: int, skipped: int, failed: int) -> str:
    """Why no pick was tuned: the recorded shapes were cached already, skipped, or failed."""
    if failed:
        return (
            f"no pick was tuned: every candidate of {failed} recorded profile(s) failed (the "
            "warnings above say why)"
        )
    if not cached:
        return f"no pick was tuned: all {skipped} recorded calls were skipped (reasons below)"
    if skipped:
        return (
            f"nothing to tune: {cached} recorded shape(s) were already in the cache file and "
            f"{skipped} were skipped (reasons below)"
        )
    return "every recorded shape was already in the cache file; nothing to tune"
