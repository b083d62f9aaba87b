"""Entry point of the ``graphtune`` command and ``python -m graphtune``.

Every failure a user can cause ends in one ``error: ...`` line on stderr, never a traceback: exit
code 2 for a usage error (argparse, :class:`graphtune.cli._args.Parser`), 1 for a failure (a
:class:`~graphtune.errors.GraphtuneError`, a file that cannot be read or written, memory that
runs out) and 130 on Ctrl-C, after the command has kept what it finished. When the reader of
stdout goes away (``graphtune cache show FILE | head -1``) the command stops quietly with exit
code 141, as a shell reports a command that SIGPIPE stopped: no error line, since nothing failed
that the user must fix, but not 0 either, since the output was cut short.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from graphtune import env
from graphtune._version import __version__
from graphtune.cli._args import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Parser,
)
from graphtune.errors import GraphtuneError, one_line

# Each module defines ``register(subparsers)``, adding its subcommands with a ``handler`` default
# that takes the parsed namespace and returns an exit code. Building the parser imports no torch
# (the modules import it inside their handlers), so ``--help`` stays fast.
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
    parser = Parser(
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
    if not sys.stderr.isatty():
        # No terminal for progress bars: long work reports as log records instead (INFO,
        # graphtune.reporting), shown at the default level so a logged run never looks hung.
        logging.getLogger("graphtune.reporting").setLevel(min(level, logging.INFO))
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_OK
    try:
        env.check_switches()  # a junk on/off value is refused before any work
        return int(handler(args) or 0)
    except KeyboardInterrupt as exc:
        # A command that kept partial work says what in the interrupt's message.
        kept = f"; {exc.args[0]}" if exc.args else ""
        print(f"error: interrupted (Ctrl-C){kept}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except GraphtuneError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:  # before OSError: a closed pipe is the reader's choice, no failure
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:
        where = _out_of_memory(exc)
        if where is None:
            raise  # a bug: the traceback is what a report needs
        print(
            f"error: out of {where} memory ({one_line(exc)[:200]}); {_smaller_hint(args)}",
            file=sys.stderr,
        )
        return EXIT_FAILURE


def _silence_stdout() -> None:
    """Points stdout at the null device, as the Python docs advise for a closed pipe: the
    interpreter flushes stdout on exit, and the data still buffered would raise again there."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # stdout is no file (main() called in-process with captured output): nothing to do


#: (namespace attribute, flag) of each command's batch and context sizes, for the hint after an
#: out-of-memory error: the commands name them differently.
_BATCH_FLAGS = (
    ("batch_sizes", "--batch-sizes"),
    ("max_batch", "--max-batch"),
    ("batch", "--batch"),
)
_CONTEXT_FLAGS = (("context", "--context"), ("max_seq_len", "--max-seq-len"))


def _smaller_hint(args: argparse.Namespace) -> str:
    """What to make smaller, naming the flags of the command that ran out of memory."""

    def named(word: str, flags: tuple[tuple[str, str], ...]) -> str:
        flag = next((f for attr, f in flags if hasattr(args, attr)), None)
        return f"{word} ({flag})" if flag else word

    batch, context = named("batch", _BATCH_FLAGS), named("context", _CONTEXT_FLAGS)
    return f"use a smaller {batch}, {context} or model"


def _out_of_memory(exc: BaseException) -> str | None:
    """``"device"`` or ``"host"`` when ``exc`` is an allocation that failed, else ``None``.

    torch raises ``torch.OutOfMemoryError`` for a device, but a plain ``RuntimeError`` naming its
    CPU allocator for host memory (a KV cache of a billion positions on the CPU)."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is not None and isinstance(exc, oom):
        return "device"
    if isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    ):
        return "host"
    return None


if __name__ == "__main__":
    sys.exit(main())
