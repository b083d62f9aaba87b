"""Command-line options of benchmarks/tuning.py: timing modes, ``--variant`` and the rest."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from _sweep import name_list
from _tuning_scores import MODES

from graphtune.cli._args import Parser, positive_int

RUNS = 3
TRUTH_SETS = 3


def tuner_kwargs(args: argparse.Namespace, mode: str | None = None) -> dict[str, Any]:
    """TuningPolicy keyword arguments the options ask for (none: the defaults); for a
    ``--variant`` name, its keywords on top."""
    kwargs = {} if args.tie_tolerance is None else {"tie_tolerance": args.tie_tolerance}
    return {**kwargs, **getattr(args, "variants", {}).get(mode, {})}


def timer_name(mode: str) -> str:
    """The timing mode a mode or ``--variant`` name tunes with (variants use the graph timer)."""
    return mode if mode in MODES else "graph"


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``"sets3:input_sets=3,tie_floor_us=0.02"`` -> ``("sets3", {"input_sets": 3, ...})``.

    Values are read as JSON (numbers, true/false, quoted strings), else kept as text.

    Raises:
        argparse.ArgumentTypeError: No name, or a keyword without ``=``.
    """
    name, _, rest = text.partition(":")
    name = name.strip()
    if not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: give NAME:KEY=VALUE,...")
    kwargs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise argparse.ArgumentTypeError(
                f"--variant {text!r}: {item!r} is not KEY=VALUE (e.g. input_sets=3)"
            )
        try:
            kwargs[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key.strip()] = value.strip()
    return name, kwargs


#: ``--modes``: a comma-separated subset of :data:`MODES`, in the order given, each once.
parse_modes = name_list(MODES, "timing mode")


def _tie_tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(
            f"expected a number in [0, 1) (a relative gap, 0.005 = 0.5%), got {value}"
        )
    return value


def parse_args(argv: list[str] | None, description: str | None = None) -> argparse.Namespace:
    """Parses the options; errors exit with status 2 and a message naming the valid values."""
    parser = Parser(description=description)
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON result"
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes and buckets")
    parser.add_argument(
        "--commit", default=None, help="commit to record (default: GRAPHTUNE_COMMIT, else git)"
    )
    parser.add_argument(
        "--cupti-calls",
        type=positive_int,
        default=30,
        help="profiled eager calls per tactic for the kernel-sum truth",
    )
    parser.add_argument(
        "--cupti-graph-replays",
        type=positive_int,
        default=20,
        help="profiled graph replays per tactic for the in-graph truth",
    )
    parser.add_argument(
        "--modes",
        type=parse_modes,
        default=MODES,
        help=f"comma-separated timing modes to tune with (default {','.join(MODES)})",
    )
    parser.add_argument(
        "--runs",
        type=positive_int,
        default=RUNS,
        help=f"independent tuning runs per mode (default {RUNS})",
    )
    parser.add_argument(
        "--tie-tolerance",
        type=_tie_tolerance,
        default=None,
        help="TuningPolicy(tie_tolerance=F); default: the policy's own default",
    )
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="also tune with the graph timer and these TuningPolicy keywords (GraphTimer ones "
        "prefixed timer., e.g. timer.replays=5), "
        "reported like a mode named NAME (repeatable), e.g. "
        "sets1:input_sets=1,tie_floor_us=0 (default: none)",
    )
    parser.add_argument(
        "--truth-sets",
        type=positive_int,
        default=TRUTH_SETS,
        help="fresh input sets each truth is measured on; a candidate's truth "
        f"is the median over them (default {TRUTH_SETS})",
    )
    parser.add_argument(
        "--only",
        default=None,
        help="run the cases whose label contains this text; alternatives separated by |, "
        "each optionally TEXT@M for one bucket (e.g. 'down@1|add+rmsnorm@8'; default: all)",
    )
    parser.add_argument(
        "--lead-in",
        action="store_true",
        help="experimental: the graph timer times each call right after a small PDL kernel and "
        "takes that kernel's own time off (GraphTimer(lead_in=...): a chain of a candidate "
        "after itself overlaps under PDL unlike the step does); needs PDL",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if args.quick:
        args.cupti_calls = min(args.cupti_calls, 20)
    names = [name for name, _ in args.variant]
    clash = sorted({n for n in names if names.count(n) > 1 or n in MODES})
    if clash:
        parser.error(f"--variant names must be unique and not a mode name: {clash}")
    args.variants = dict(args.variant)
    args.modes = tuple(args.modes) + tuple(n for n in names if n not in args.modes)
    return args


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The options a result was measured with, for the JSON file."""
    return {
        "modes": list(args.modes),
        "variants": getattr(args, "variants", {}),
        "truth_sets": getattr(args, "truth_sets", 1),
        "runs": args.runs,
        "tie_tolerance": args.tie_tolerance,
        "cupti_calls": args.cupti_calls,
        "cupti_graph_replays": args.cupti_graph_replays,
        "quick": args.quick,
        "only": args.only,
        "lead_in": getattr(args, "lead_in", False),
    }


def partial_parts(args: argparse.Namespace) -> list[str]:
    """What makes a run partial (a subset of the full benchmark): ``--only``, timing modes other
    than the default set, ``--variant``; each as a file-name-safe part, empty for a full run."""
    parts = []
    if args.only:
        parts.append("only-" + _slug(args.only))
    base = [m for m in args.modes if m in MODES]
    if set(base) != set(MODES):  # the order of --modes does not make a run partial
        parts.append("modes-" + "-".join(base))
    variants = list(getattr(args, "variants", {}))
    if variants:
        parts.append("variant-" + "-".join(_slug(v) for v in variants))
    return parts


def result_name(args: argparse.Namespace, gpu_slug: str) -> str:
    """``tuning-<gpu>[-quick][-lead-in][-partial-<what>].json``: a partial run
    (:func:`partial_parts`) gets its own name, so it never replaces the file of a full run, and
    so does a ``--lead-in`` run (its graph timer measures differently)."""
    parts = partial_parts(args)
    partial = "-partial-" + "-".join(parts) if parts else ""
    lead_in = "-lead-in" if getattr(args, "lead_in", False) else ""
    return f"tuning-{gpu_slug}{'-quick' if args.quick else ''}{lead_in}{partial}.json"


def _slug(text: str, limit: int = 40) -> str:
    # Labels hold '->', '+', '|', '@' and spaces: keep letters and digits for a portable name.
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:limit] or "x"


def unmatched_only(only: str, labels: list[str], quick: bool) -> str:
    """The one-line error for an ``--only`` that selects no case: it names a few valid labels."""
    names = list(dict.fromkeys(labels))
    shown = ", ".join(repr(n) for n in names[:6]) + (", ..." if len(names) > 6 else "")
    return (
        f"error: --only {only!r} matches no case of the "
        f"{'quick' if quick else 'full'} set; give text a label contains ({shown}), "
        "optionally TEXT@M for one bucket"
    )
