"""Entry point of the ``graphtune`` command and ``python -m graphtune``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from graphtune._version import __version__

# Each module defines ``register(subparsers)``, adding its subcommands with a ``handler`` default
# that takes the parsed namespace and returns an exit code. Imported lazily so ``--help`` stays fast
# and one broken optional dependency does not take every command down.
_COMMAND_MODULES = (
    "graphtune.cli.cache_cmd",
    "graphtune.cli.demo",
    "graphtune.cli.generate",
    "graphtune.cli.bench",
    "graphtune.cli.tune",
    "graphtune.cli.check_tactics",
)


def build_parser() -> argparse.ArgumentParser:
    """Builds the argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="graphtune",
        description="CUDA graph runner and graph-replay autotuner for LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"graphtune {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI and returns its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # What the command line was, for the provenance of results (also when called in-process).
    args.argv = list(sys.argv[1:] if argv is None else argv)
    # The CLI is an application, so it (and only it) configures logging.
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
