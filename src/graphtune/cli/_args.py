"""What every command shares: the parser class, argument types, device flags, output paths.

Building the parser imports no torch (``graphtune --help`` stays fast): devices and dtypes are
checked by spelling here and against the running torch by the command that uses them.

Conventions (every command): each flag has help text and its default shown; a usage error is
one ``error:`` line on stderr and exit code 2; a failure is one ``error:`` line and exit 1
(:mod:`graphtune.cli.main`); Ctrl-C stops with one line and exit 130.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from graphtune import env
from graphtune.errors import ConfigError
from graphtune.integer_text import parse_integer

logger = logging.getLogger(__name__)

#: Exit codes: done, a failure (a model that cannot load, a file that cannot be written, ...), a
#: usage error (argparse), interrupted by Ctrl-C (128 + SIGINT, as shells report it), stdout's
#: reader gone (``| head``; 128 + SIGPIPE, as a shell reports a command the pipe stopped).
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 0, 1, 2, 130, 141

#: ``--dtype`` values: ``auto`` is bfloat16 on CUDA and float32 elsewhere.
DTYPES = ("auto", "bfloat16", "float16", "float32")

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already says its default; a
    switch (``store_true``) is off by default and says nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.nargs == 0 or action.default is None:
            return text
        if isinstance(action.default, (tuple, list)):  # as typed: 1,8 rather than (1, 8)
            return f"{text} (default: {','.join(map(str, action.default))})"
        return super()._get_help_string(action) or text


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose help shows every default and whose usage errors are one line.

    Subcommand parsers made with ``add_subparsers().add_parser`` are of this class too.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Prints ``error: <message>`` and where to read the usage; exits with 2."""
        usage_error(self.prog, message)


def usage_error(prog: str, message: str) -> NoReturn:
    """A usage error found after parsing (flags that conflict): one ``error:`` line naming
    where to read the usage, exit 2, as :meth:`Parser.error` prints it."""
    print(f"error: {message} (see '{prog} --help')", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def positive_int(text: str) -> int:
    """``argparse`` type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """``argparse`` type: an integer >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = parse_integer(text)  # the one rule: int() alone takes 1_0 and other scripts' digits
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def kv_cache_length(text: str) -> int:
    """``argparse`` type of an engine's ``--max-seq-len``: an integer >= the engine's
    ``MIN_SEQ_LEN``, so the flag is refused before any work and by its name, not by the engine's
    argument check after the model loaded."""
    from graphtune.engine.arguments import MIN_SEQ_LEN  # imports torch: only when given

    return _int_at_least(text, MIN_SEQ_LEN)


def batch_sizes(text: str) -> tuple[int, ...]:
    """``argparse`` type: comma-separated batch sizes, each an integer >= 1 given once, in the
    order given."""
    parts = [part.strip() for part in text.split(",")]
    try:
        values = tuple(parse_integer(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1,8, got {text!r}"
        ) from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be integers >= 1, got {text!r}")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(
            f"batch size {repeated[0]} is given twice in {text!r}; give each size once"
        )
    return values


def seed_value(text: str) -> int:
    """``argparse`` type: a seed, an integer in ``[0, 2**63)`` (what a torch generator takes)."""
    value = _int_at_least(text, 0)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"must be below 2**63, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """``argparse`` type: a finite number >= 0 (a tolerance)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def device_name(text: str) -> str:
    """``argparse`` type: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (availability is checked by
    :func:`graphtune.engine.devices.resolve_device` when the command runs)."""
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use auto, cpu, cuda or cuda:N")
    return text


def add_device_arguments(
    parser: argparse.ArgumentParser, *, dtype: bool = True, dtype_unset: bool = False
) -> None:
    """Adds ``--device`` (and ``--dtype``); with ``dtype_unset``, ``--dtype`` is ``None`` when
    not given (the command resolves it as ``auto``), so the command can tell a given ``auto``
    from none and refuse it where it has no use."""
    parser.add_argument(
        "--device",
        type=device_name,
        default="auto",
        help="auto (cuda when available, else cpu), cpu, cuda or cuda:N",
    )
    if dtype:
        parser.add_argument(
            "--dtype",
            choices=DTYPES,
            default=None if dtype_unset else "auto",
            help="weight and activation dtype (auto: bfloat16 on CUDA, float32 on CPU"
            + ("; default: auto)" if dtype_unset else ")"),
        )


def usage(parser: argparse.ArgumentParser) -> int:
    """Handler of a bare command group (``graphtune bench``): its help, exit 0, as bare
    ``graphtune`` does."""
    parser.print_help()
    return EXIT_OK


def check_output_path(
    path: Path | None, flag: str, *, results: bool = False, result_json: bool = False
) -> None:
    """Checks before any work that ``path`` can be written (``None`` and ``-`` pass), by creating
    and removing a temporary file next to it (permission bits do not tell for root or for
    read-only file systems).

    Args:
        path: The file the command will write.
        flag: The option that named it, for the messages.
        results: ``path`` takes a command's results (``--json``, ``--plot``): a graphtune tuning
            cache or misses file already there is refused, since writing would destroy picks or
            misses that took long to gather (``--plot`` replaces any other file).
            The tuning-cache paths pass ``False`` and check the file's kind themselves
            (:func:`check_cache_path`).
        result_json: ``path`` takes a result JSON (``--json``; implies ``results``): a file
            already there must be a graphtune result
            (:func:`~graphtune.bench.results.graphtune_result_file`) or empty (0 bytes, as
            ``mktemp`` makes one), so an earlier run's result is replaced but a mistyped path
            never destroys other data (a model's weights).

    Raises:
        ConfigError: The folder is missing or not writable, or ``path`` is a folder or another
            file that is not a regular one, or (``results``) a tuning cache or misses file, or
            (``result_json``) any file but a graphtune result; the message names ``flag`` and
            the reason.
    """
    if path is None or str(path) == "-":
        return
    folder = path.parent
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file name")
    if path.exists() and not path.is_file():
        raise ConfigError(
            f"{flag} {path} is not a regular file (a device, FIFO or socket), which graphtune "
            "would replace with its own; give a file path"
        )
    if (results or result_json) and path.is_file():
        from graphtune.bench.results import graphtune_data_file, graphtune_result_file

        empty = path.stat().st_size == 0  # holds no data (mktemp's file)
        if not (result_json and (empty or graphtune_result_file(path))):
            kind = graphtune_data_file(path)
            if kind is not None:
                raise ConfigError(
                    f"{flag} {path} is {kind}, and writing the results would replace it; give "
                    "another path, or move that file away"
                )
            if result_json:
                raise ConfigError(
                    f"{flag} {path} exists and is not an earlier graphtune result (the only "
                    f"file {flag} replaces); choose another path or remove the file"
                )
    refuse_file_above(path, f"{flag} {path}", "give another path")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: the folder {folder} does not exist; create it first")
    reason = _unwritable(folder)
    if reason is not None:
        raise ConfigError(
            f"{flag} {path}: cannot write to the folder {folder} ({reason}); pass a writable path"
        )


def check_script_output(
    path: Path, flag: str = "--out", parser: argparse.ArgumentParser | None = None
) -> None:
    """:func:`check_output_path` for a benchmark script's result file, before its measurements
    (a result that cannot land at ``path`` is found late otherwise): a refusal is a usage error,
    exit 2, through ``parser.error`` when the script has its parser at hand, else one ``error:``
    line. A missing folder is made first, as the result's write would make it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # a file in the way, no permission: check_output_path says which, in one line
    try:
        check_output_path(path, flag)
    except ConfigError as exc:
        if parser is not None:
            parser.error(str(exc))
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


def refuse_file_above(path: Path, label: str, fix: str) -> None:
    """Refuses ``path`` when its nearest existing parent is a file, not a folder (no file can
    be made under it); ``label`` names the input and ``fix`` ends the message.

    Raises:
        ConfigError: That parent is a file.
    """
    for folder in path.parents:
        if folder.exists():
            if not folder.is_dir():
                raise ConfigError(f"{label}: {folder} is a file, not a folder; {fix}")
            return


def _unwritable(folder: Path) -> str | None:
    """Why a file cannot be created in the existing ``folder`` now, or ``None`` when it can."""
    try:
        tempfile.NamedTemporaryFile(dir=folder, prefix=".graphtune-check-").close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def report_written(flag: str, requested: Path, written: Path) -> bool:
    """Prints where ``flag``'s output went; ``False`` when it is not ``requested``.

    ``requested`` passed :func:`check_output_path` before the work, so a different ``written``
    means the write failed late (a full disk, a folder made read-only meanwhile) and the data went
    to the temporary folder: the command must then exit 1, since a script would find the old file
    or none at ``requested``.
    """
    if Path(written) == Path(requested):
        print(f"wrote {written}", file=sys.stderr)
        return True
    print(
        f"error: {flag} {requested} could not be written; the data is in {written} instead",
        file=sys.stderr,
    )
    return False


#: Why ``-`` names no tuning cache, where ``--json -`` is stdout.
CACHE_NOT_A_STREAM = (
    "a tuning cache must be a file, not '-' (a stream: a cache is read and saved in place); "
    "give a file path"
)


def cache_file(text: str) -> Path:
    """``argparse`` type of a tuning-cache flag: a path, ``-`` refused as a usage error."""
    if text == "-":
        raise argparse.ArgumentTypeError(CACHE_NOT_A_STREAM)
    return Path(text)


def check_cache_path(path: Path, flag: str) -> None:
    """Checks before any work that a tuning cache can be saved at ``path``: as
    :func:`check_output_path`, and a file already there must be a graphtune tuning cache (a save
    moves one of another version or environment aside to ``FILE.unusable``, and never touches
    someone's other file at a mistyped path), and its lock must be takable.

    Raises:
        ConfigError: ``path`` is ``-``, cannot be written, or holds a file that is not a tuning
            cache.
        CacheFileError: The lock file cannot be created or opened.
    """
    from graphtune.autotuner.cache_reader import not_a_cache_file
    from graphtune.autotuner.save_target import check_lockable

    if str(path) == "-":  # GRAPHTUNE_CACHE=-, or a caller that took no cache_file flag
        raise ConfigError(f"{flag} -: {CACHE_NOT_A_STREAM}")
    check_output_path(path, flag)
    reason = not_a_cache_file(path) if path.exists() else None
    if reason is not None:
        raise ConfigError(
            f"{flag} {path} is not a graphtune tuning cache (it {reason}), and saving the picks "
            "would replace it; give another path, or move that file away"
        )
    check_lockable(path)


def tuning_cache_path(path: Path | None, flag: str) -> Path | None:
    """The tuning cache file a command uses, checked with :func:`check_cache_path`: ``path``
    (given as ``flag``), else the file ``GRAPHTUNE_CACHE`` names, else ``None`` (no file).

    Resolved here rather than left to ``autotune(None)``, which falls back to
    ``GRAPHTUNE_CACHE`` on its own: that file would then skip the checks and go unrecorded.

    ``GRAPHTUNE_MISSES`` is checked too (:func:`check_misses_path`).

    Raises:
        ConfigError: The file cannot be written or is not a tuning cache (the message names
            ``flag`` or ``GRAPHTUNE_CACHE``), or ``GRAPHTUNE_MISSES`` is unfit.
        CacheFileError: Its lock file cannot be created or opened.
    """
    if path is None:
        path = env.default_cache_path()
        if path is not None:
            check_cache_path(path, f"GRAPHTUNE_CACHE (the default of {flag}):")
            check_misses_path(path)
        return path
    check_cache_path(path, flag)
    check_misses_path(path)
    return path


def lookup_cache_path(path: Path | None, flag: str) -> Path | None:
    """The tuning cache file a command only looks picks up in (it never saves one): ``path``
    (given as ``flag``), else the file ``GRAPHTUNE_CACHE`` names (with a warning when that file
    does not exist yet: its look-ups all miss), else ``None``. A file given as ``flag`` must exist
    and be a graphtune tuning cache (one of another version or environment passes: loading it
    warns and skips it); ``GRAPHTUNE_MISSES`` is checked too (:func:`check_misses_path`).

    Raises:
        ConfigError: The file is missing, or cannot be read as a tuning cache.
    """
    from graphtune.autotuner.cache_reader import not_a_cache_file

    label = flag
    if path is None:
        path = env.default_cache_path()
        if path is None:
            return None
        label = f"GRAPHTUNE_CACHE (the default of {flag}):"
        if not path.exists():
            # Set once for every command: a file no tuning run has written yet is the normal
            # first run, as for the library's look-ups, not a typo in this command. Its path is
            # kept, so the look-ups (and GRAPHTUNE_MISSES's record of them) still happen.
            logger.warning("%s %s does not exist yet: every op runs untuned", label, path)
            check_misses_path(path)
            return path
    fix = "pass the file `graphtune tune --cache FILE` wrote, or leave it out"
    if not path.exists():
        raise ConfigError(
            f"{label} {path} does not exist, and this command only reads a tuning cache (it "
            f"never saves one); {fix}"
        )
    reason = not_a_cache_file(path)
    if reason is not None:
        raise ConfigError(
            f"{label} {path} cannot be read as a graphtune tuning cache (it {reason}); {fix}"
        )
    check_misses_path(path)
    return path


def check_misses_path(cache: Path | None) -> None:
    """Checks before any work the file ``GRAPHTUNE_MISSES`` names, where a run that looks picks
    up in ``cache`` records the shapes that missed: it must not be a folder, a tuning cache or
    ``cache`` itself (the record would replace it), nor a non-empty file that is no misses
    record (someone's file: the save would move it aside), and its folder must be writable (a folder
    not there yet passes: the save creates it, unless a file is where a folder must be). Nothing
    to check when it is unset.

    Raises:
        ConfigError: One of those; the message names ``GRAPHTUNE_MISSES`` and the fix.
    """
    from graphtune.autotuner.cache_reader import not_a_cache_file
    from graphtune.autotuner.misses_file import not_a_misses_file

    path = env.default_misses_path()
    if path is None:
        return
    name = f"GRAPHTUNE_MISSES={path}"
    if path.is_dir():
        raise ConfigError(f"{name} is a folder; set it to a file, e.g. {path / 'misses.json'}")
    if path.exists() and not path.is_file():
        raise ConfigError(
            f"{name} is not a regular file (a device, FIFO or socket); set it to a file"
        )
    if cache is not None and path.resolve() == cache.resolve():
        raise ConfigError(
            f"{name} names the tuning cache of this run too, which the record of missed shapes "
            "would replace; set it to another file"
        )
    if path.is_file() and not_a_cache_file(path) is None:
        raise ConfigError(
            f"{name} holds a graphtune tuning cache, which the record of missed shapes would "
            "replace; set it to another file"
        )
    # As check_cache_path: someone's other file there is refused, not moved aside after the run.
    reason = not_a_misses_file(path) if path.is_file() and path.stat().st_size else None
    if reason is not None:
        raise ConfigError(
            f"{name} is not a graphtune misses file (it {reason}), and recording the misses "
            f"would move it to {path}.unusable; set it to another file, or move that file away"
        )
    refuse_file_above(path, name, "set it to another path, or unset it")
    folder = path.parent
    reason = _unwritable(folder) if folder.is_dir() else None
    if reason is not None:
        raise ConfigError(
            f"{name}: cannot write to the folder {folder} ({reason}); set it to a writable path, "
            "or unset it"
        )


def check_distinct_outputs(*outputs: tuple[str, Path | None]) -> None:
    """Refuses two output flags naming one file (the second write would replace the first's
    data); ``None`` and ``-`` (stdout) are skipped.

    Raises:
        ConfigError: Two of ``outputs`` (``(flag, path)`` pairs) resolve to the same file.
    """
    seen: dict[Path, str] = {}
    for flag, path in outputs:
        if path is None or str(path) == "-":
            continue
        where = path.resolve()
        if where in seen:
            raise ConfigError(
                f"{seen[where]} and {flag} both name {path}, so one would replace the other; "
                "give them different files"
            )
        seen[where] = flag


def timing_timer(timing: str, device: Any) -> Any:
    """The timer ``--timing`` names for ops on ``device`` (``None`` for ``auto``: the tuner
    picks), checked here so the error speaks of the flag.

    Raises:
        ConfigError: A CUDA timer (graph, events) for ops that do not run on CUDA.
    """
    if timing == "auto":
        return None
    if timing in ("graph", "events") and getattr(device, "type", None) != "cuda":
        raise ConfigError(
            f"--timing {timing} times CUDA work, and the ops run on {device}; use --timing "
            "wallclock (or auto)"
        )
    from graphtune.autotuner.timing import resolve_timer

    return resolve_timer(timing, device)
