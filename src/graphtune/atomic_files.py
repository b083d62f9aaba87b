"""Writing a file atomically, and keeping the data when the file cannot be written.

A leaf module (standard library only) so that both the tuning cache (``graphtune.autotuner``) and
the benchmark results (``graphtune.bench``) use one implementation.

:func:`write_atomically` writes a temporary file next to the target, ``fsync``s it and renames it
over the target (``os.replace``): a reader sees the old file or the new one, never half of one,
and a writer killed at any point leaves the old file intact. A symlink is resolved first
(:func:`real_path`): its target is replaced, and the link stays a link. The temporary file of
``NAME`` is ``.NAME.XXXXXXXX.tmp`` (8 random characters): two different targets can never have
the same temporary name (equal length and equal prefix would make the names equal), so
:func:`remove_stale_temp_files`, which matches exactly that form, removes only temporary files
of its own target, never another file's in-progress one (``t.json`` vs ``t.json.rank1``).

:func:`write_with_fallback` (and :func:`write_fallback`, for a caller that tried the target
itself) writes the data to a file in the system's temporary folder when the target cannot be
written (a read-only folder, a full disk) and returns where it went.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
import tempfile
from collections.abc import Callable
from os import PathLike
from pathlib import Path

logger = logging.getLogger(__name__)

_RANDOM_CHARS = 8
# mkstemp's alphabet too, so temporary files of older graphtune versions are cleaned up as well.
_RANDOM = f"[a-z0-9_]{{{_RANDOM_CHARS}}}"


def real_path(path: str | PathLike[str]) -> Path:
    """``path`` with every symlink resolved (``os.path.realpath``; a missing file is fine): a
    save through a link writes and locks the link's target, and the link stays a link."""
    return Path(os.path.realpath(path))


def file_id(path: str | PathLike[str]) -> str:
    """The file a save to ``path`` writes, as text (:func:`real_path`): the key under which
    what was saved there is remembered (``TuningCache``, ``MissLog``), so a save through a link
    and one to its target count as saves to one file."""
    return os.path.realpath(path)


def temp_file(path: str | PathLike[str]) -> tuple[int, Path]:
    """Creates ``path``'s next temporary file (next to it) and opens it for writing.

    The file gets the mode ``path`` should have once it is renamed over ``path``: ``path``'s own
    mode when it exists, else that of any new file the user creates (``0o666`` less the umask).

    Returns:
        The open file descriptor and the temporary file's path.

    Raises:
        OSError: The folder cannot be written.
    """
    path = Path(path)
    try:
        keep: int | None = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:  # no file yet (or none we can see): a new file's mode
        keep = None
    # A new file is opened with 0o666 and the kernel takes the umask (and a folder's default
    # ACL) off, as for any file the user creates: the umask is never read, since reading it
    # means setting it (os.umask) and setting it back, and a thread creating a file meanwhile
    # would get the wrong mode. A replaced file's mode is copied onto a 0o600 file before any
    # byte is written, so a private file's data is never readable by others, even briefly.
    create_mode = 0o666 if keep is None else 0o600
    while True:
        name = f".{path.name}.{secrets.token_hex(_RANDOM_CHARS // 2)}.tmp"
        tmp = path.with_name(name)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, create_mode)
        except FileExistsError:
            continue
        if keep is not None and keep != 0o600:
            try:
                os.fchmod(fd, keep)
            except OSError as exc:  # a file system without modes (FAT, some mounts): keep 0600
                logger.debug("could not give %s the mode of %s: %s", tmp, path, exc)
        return fd, tmp


def is_temp_file_of(path: str | PathLike[str], candidate: str | PathLike[str]) -> bool:
    """Whether ``candidate`` is a temporary file that :func:`temp_file` makes for ``path``."""
    path, candidate = Path(path), Path(candidate)
    pattern = re.escape(f".{path.name}.") + _RANDOM + re.escape(".tmp")
    return candidate.parent == path.parent and re.fullmatch(pattern, candidate.name) is not None


def remove_stale_temp_files(path: str | PathLike[str]) -> None:
    """Deletes ``path``'s temporary files that a writer killed mid-write left behind.

    Call it only while holding ``path``'s lock, when every writer creates its temporary file
    only while holding that lock: any such file that exists then belongs to a writer that died.
    """
    path = real_path(path)
    try:
        children = list(path.parent.iterdir())
    except OSError as exc:
        logger.debug("could not list %s for stale temporary files: %s", path.parent, exc)
        return
    for stale in children:
        if not is_temp_file_of(path, stale):
            continue
        try:
            stale.unlink()
            logger.info("removed %s, left behind by a save that was interrupted", stale)
        except OSError as exc:  # another user's file, or already gone: harmless
            logger.debug("could not remove stale temporary file %s: %s", stale, exc)


def write_atomically(
    path: str | PathLike[str],
    data: bytes,
    *,
    before_replace: Callable[[Path], None] | None = None,
) -> None:
    """Writes ``data`` to ``path`` through a synced temporary file and ``os.replace``.

    Args:
        path: The target; its folder is created when missing.
        data: The file's new content.
        before_replace: Called with the complete temporary file just before the rename (a
            fault-injection seam for tests).

    Raises:
        OSError: The temporary file could not be written or renamed (it is removed).
    """
    path = real_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file(path)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if before_replace is not None:
            before_replace(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class FallbackFailed(OSError):
    """Neither the target nor the fallback file could be written (:func:`write_with_fallback`);
    callers raise their own error type naming both."""

    def __init__(self, target: Path, first: str, fallback: Path, second: str) -> None:
        super().__init__(f"could not write {target} ({first}) nor {fallback} ({second})")
        self.target, self.first, self.fallback, self.second = target, first, fallback, second


def new_fallback_file(path: str | PathLike[str]) -> Path:
    """Creates (empty) and returns a new file for ``path``'s data when ``path`` cannot be
    written: ``graphtune-PID-XXXXXXXX-NAME`` in the system's temporary folder, a name no other
    save has taken (two caches of one name in different folders never share a fallback).

    Raises:
        OSError: The temporary folder cannot be created or written.
    """
    folder = Path(tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(
        prefix=f"graphtune-{os.getpid()}-", suffix=f"-{Path(path).name}", dir=folder
    )
    os.close(fd)
    return Path(name)


def write_with_fallback(
    path: str | PathLike[str],
    data: bytes,
    *,
    write: Callable[[Path, bytes], None] = write_atomically,
) -> tuple[Path, str | None]:
    """Writes ``data`` to ``path`` with ``write``, or to a :func:`new_fallback_file` when that
    fails.

    Returns:
        The file holding the data, and ``None`` or (when it is the fallback) why ``path`` could
        not be written.

    Raises:
        FallbackFailed: Neither could be written (it names both files and both reasons).
    """
    target = Path(path)
    try:
        write(target, data)
        return target, None
    except OSError as exc:
        first = f"{type(exc).__name__}: {exc}"
    return write_fallback(target, data, first, write=write), first


def write_fallback(
    path: str | PathLike[str],
    data: bytes,
    why: str,
    *,
    write: Callable[[Path, bytes], None] = write_atomically,
) -> Path:
    """Writes ``data``, which could not be written to ``path`` (``why``), to a
    :func:`new_fallback_file` instead.

    Returns:
        The fallback file.

    Raises:
        FallbackFailed: The fallback could not be written either.
    """
    pattern = f"graphtune-{os.getpid()}-XXXXXXXX-{Path(path).name}"
    fallback = Path(tempfile.gettempdir()) / pattern  # for the message when none is made
    try:
        fallback = new_fallback_file(path)
        write(fallback, data)
    except OSError as exc:
        if fallback.name != pattern:
            fallback.unlink(missing_ok=True)
        raise FallbackFailed(Path(path), why, fallback, f"{type(exc).__name__}: {exc}") from None
    return fallback
