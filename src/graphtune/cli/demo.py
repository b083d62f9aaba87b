"""``graphtune demo``: tune a small op set on the best device present and print the picks.

The ops and the tuning run are in :mod:`graphtune.cli.demo_ops` (imported when the command runs,
so building the parser imports no torch).
"""

from __future__ import annotations

import argparse

from graphtune.cli._args import cache_file, device_name, tuning_cache_path
from graphtune.cli._interrupted import interrupted_picks

DESCRIPTION = (
    "Tunes two small ops on the best device present and prints the picks: matmul (torch.matmul, "
    "a row-chunked torch.mm whose tactic is the chunk height, torch.einsum) and softmax "
    "(torch.softmax, exp(log_softmax), an explicit max-subtract / exp / normalise), over a few "
    "row-count buckets; then serves a few calls from the picks. On CUDA it times with the graph "
    "timer in bf16, on a CPU with the wall clock in float32 (a few seconds)."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="tune a small op set on the best device present and print the picks",
        description=DESCRIPTION,
    )
    parser.add_argument(
        "--cache",
        metavar="FILE",
        type=cache_file,
        default=None,
        help="load picks from / save them to this cache file (default: the file GRAPHTUNE_CACHE "
        "names, else none)",
    )
    parser.add_argument(
        "--device",
        type=device_name,
        default="auto",
        help="device to tune on: auto (cuda when available, else cpu), cpu, cuda or cuda:N",
    )
    parser.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Tunes the demo ops, prints the picks, then serves a few calls from the cache."""
    from graphtune import autotuner
    from graphtune.cli.demo_ops import demo
    from graphtune.engine.devices import resolve_device

    device = resolve_device(args.device)
    cache = tuning_cache_path(args.cache, "--cache")
    tuner = autotuner.AutoTuner(policy=autotuner.TuningPolicy(rounds=3, remeasure_top=2))
    try:
        print(demo(tuner, device, cache_path=cache))
    except KeyboardInterrupt:
        # main() prints this after "interrupted (Ctrl-C)": the user learns whether the picks
        # finished before the interrupt survive, and where.
        raise KeyboardInterrupt(interrupted_picks(tuner, cache)) from None
    return 0
