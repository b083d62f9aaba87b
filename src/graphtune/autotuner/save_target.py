"""Where a cache file is saved: its lock file, the checks on the target before any work, and
moving a file that is in the way aside (``FILE.unusable[.N]``) so a save loses nothing. Shared by
the tuning cache (:mod:`graphtune.autotuner.persist`), the misses record
(:mod:`graphtune.autotuner.json_update`) and ``graphtune cache``."""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from os import PathLike
from pathlib import Path

from filelock import FileLock, Timeout

from graphtune.atomic_files import real_path
from graphtune.errors import CacheFileError

logger = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 60.0


def lock_path(path: str | PathLike[str]) -> Path:
    """The lock file guarding ``path``."""
    return Path(str(path) + ".lock")


def check_lockable(path: str | PathLike[str]) -> None:
    """Fails now, with the real reason, when a save
    (:func:`graphtune.autotuner.persist.save`) could not lock and write ``path``.

    Opens an existing lock file, and creates (then removes) a temporary file of its own next to
    ``path``, as a save does. Without this a lock file that cannot be created (a read-only or
    foreign folder) can look like a lock held by another process, which some ``filelock``
    versions wait out for the whole timeout. The lock file itself is never created or removed
    here: another process may be holding it (removing a held lock file lets a third process lock
    a new one at the same time). A folder that does not exist yet passes (saving creates it).

    Raises:
        CacheFileError: The lock file or a file in the folder cannot be created or opened.
    """
    path = real_path(path)
    check_regular_target(path)
    folder = path.parent
    if not folder.is_dir():
        return
    lock = lock_path(path)
    try:
        if lock.exists():
            os.close(os.open(lock, os.O_RDWR))
        # Creating a file of our own name proves the lock file could be created too.
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".check", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise CacheFileError(
            f"Cannot lock or write tuning cache {path}: {reason} ({exc.filename}); pass a cache "
            "path in a folder you can write"
        ) from None


def check_regular_target(path: str | PathLike[str]) -> None:
    """Refuses a save target that exists but is not a regular file: ``os.replace`` would put a
    plain file in place of a FIFO, a socket or a device such as ``/dev/null``.

    Raises:
        CacheFileError: ``path`` exists and is not a regular file.
    """
    path = Path(path)
    if not_a_file(path) not in (None, "is a folder"):
        raise CacheFileError(
            f"Cannot write {path}: it is not a regular file (a device, FIFO or socket), which "
            "graphtune would replace; pass the path of a file"
        )


def not_a_file(path: str | PathLike[str]) -> str | None:
    """Why the existing ``path`` is no place to save a file (completing "it ..."): a folder, or
    not a regular file (a FIFO, socket or device); ``None`` for a regular file or no file."""
    path = Path(path)
    if path.is_dir():
        return "is a folder"
    if path.exists() and not path.is_file():
        return "is not a regular file (a device, FIFO or socket)"
    return None


def move_aside(
    path: Path, reason: str, what: str = "tuning cache", *, advice: str | None = None
) -> None:
    """Renames a file that is in the way of a save but is not what is saved there (someone's file
    at a mistyped path, a file damaged by hand) to a free ``<name>.unusable[.N]`` next to it, so
    the save loses nothing; the warning says where it went.

    Args:
        path: The file in the way.
        reason: Why it is unusable, completing "it ..." in the warning (``"is not JSON"``).
        what: What the save writes there, named in the warning (``"tuning cache"``,
            ``"misses record"``).
        advice: The warning's last sentence (default: pass another path if that file was not
            meant to be a ``what``).

    Raises:
        CacheFileError: ``path`` is a folder (never moved).
    """
    if path.is_dir():
        raise CacheFileError(f"Cannot save the {what} at {path}: it is a folder; pass a file path")
    for n in itertools.count():  # never over an earlier one: each holds someone's file
        aside = path.with_name(f"{path.name}.unusable" + (f".{n}" if n else ""))
        if not aside.exists() and not aside.is_symlink():
            break
    os.replace(path, aside)
    if advice is None:
        advice = f"Pass another path if that file was not meant to be a {what}."
    logger.warning(
        "Moved %s to %s before saving the %s there: it %s. %s", path, aside, what, reason, advice
    )


@contextmanager
def locked(path: str | PathLike[str]) -> Iterator[Path]:
    """Holds ``path``'s file lock for a read-merge-write of the caller's own (``cache merge``
    into one of its inputs); write with :func:`write_atomic` ``(..., lock=False)`` inside.

    Raises:
        CacheFileError: The lock could not be taken (held elsewhere, or its file cannot be
            created or opened).
    """
    path = real_path(path)
    lock = FileLock(str(lock_path(path)), timeout=LOCK_TIMEOUT_S)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except Timeout:
        raise CacheFileError(f"Could not lock {lock_path(path)} to write {path}.") from None
    except OSError as exc:  # as check_lockable says it: a read-only or foreign folder
        raise CacheFileError(
            f"Cannot lock tuning cache {path}: {exc.strerror or type(exc).__name__} "
            f"({exc.filename or lock_path(path)}); use a cache in a folder you can write"
        ) from None
    try:
        yield path
    finally:
        lock.release()
