"""The process-default tuner (:func:`get_tuner`) and the :func:`autotune` context manager."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from os import PathLike

from graphtune import env
from graphtune.autotuner.distributed import DistributedTuning, align_cache
from graphtune.autotuner.tuner import SUMMARY_COLUMNS, AutoTuner
from graphtune.errors import CacheFileError, ConfigError
from graphtune.reporting import render_table

logger = logging.getLogger(__name__)

_default_tuner: AutoTuner | None = None
_default_lock = threading.Lock()


@dataclass(eq=False)
class _Block:
    """One open ``autotune()`` block: whether it tunes, and the strategy it asked for."""

    tuning: bool
    distributed: DistributedTuning | None


@dataclass
class _OpenBlocks:
    """The ``autotune()`` blocks open on one tuner, from any thread, and the tuner's mode and
    strategy before the first of them. Blocks of several threads overlap in time and end in any
    order, so the tuner's state is derived from the set of open blocks instead of each block
    restoring what it saw on entry."""

    outside: tuple[bool, DistributedTuning | None]
    blocks: list[_Block] = field(default_factory=list)


_open: weakref.WeakKeyDictionary[AutoTuner, _OpenBlocks] = weakref.WeakKeyDictionary()
_open_lock = threading.Lock()


def _enter(tuner: AutoTuner, block: _Block) -> None:
    with _open_lock:
        state = _open.get(tuner)
        if state is None:
            state = _open[tuner] = _OpenBlocks((tuner.tuning_mode, tuner.distributed))
        state.blocks.append(block)
        _apply(tuner, state)


def _leave(tuner: AutoTuner, block: _Block) -> bool:
    """Closes ``block``; returns whether it was the tuner's last open block."""
    with _open_lock:
        state = _open[tuner]
        state.blocks.remove(block)
        if state.blocks:
            _apply(tuner, state)
            return False
        del _open[tuner]
        tuner.tuning_mode, tuner.distributed = state.outside
        return True


def _apply(tuner: AutoTuner, state: _OpenBlocks) -> None:
    """Tuning while any open block tunes; the strategy of the latest open block that set one."""
    tuner.tuning_mode = any(b.tuning for b in state.blocks)
    chosen = [b.distributed for b in state.blocks if b.distributed is not None]
    tuner.distributed = chosen[-1] if chosen else state.outside[1]


def get_tuner() -> AutoTuner:
    """The process-default :class:`AutoTuner` (created on first use)."""
    global _default_tuner
    with _default_lock:
        if _default_tuner is None:
            _default_tuner = AutoTuner()
        return _default_tuner


@contextmanager
def autotune(
    cache_path: str | PathLike[str] | None = None,
    tuner: AutoTuner | None = None,
    *,
    tune: bool | None = None,
    strict: bool | None = None,
    distributed: str | DistributedTuning | None = None,
    misses_path: str | PathLike[str] | None = None,
) -> Iterator[AutoTuner]:
    """Turns tuning on for the block; loads the cache file before and saves it after.

    Args:
        cache_path: Cache file; ``None`` uses ``GRAPHTUNE_CACHE`` (no file when that is unset).
        tuner: The tuner to use; the process default when ``None``.
        tune: ``False`` makes the block cache-only: the file is loaded and looked up, a miss
            runs the fallback (and is recorded in ``tuner.misses``) instead of tuning, and
            nothing is saved. ``None`` tunes unless ``GRAPHTUNE_CACHE_ONLY=1``.
        strict: Passed to the cache load (raise on an unusable file instead of warning).
        distributed: A distributed tuning strategy for the block (replaces the tuner's own
            ``distributed`` until the block ends); ``None`` keeps the tuner's.
        misses_path: Where to save ``tuner.misses`` when the block ends (merged with the file;
            for ``graphtune tune --from-misses``); ``None`` uses ``GRAPHTUNE_MISSES`` (not saved
            when that is unset too).

    Blocks on one tuner may be nested or overlap from several threads: the tuner tunes while
    any open block tunes (a cache-only block does not stop another block's tuning; a thread that
    must only look up while another tunes needs a tuner of its own), uses the strategy of the
    latest open block that set one, and gets its mode, strategy and tactic worker back when the
    last block ends.

    Raises:
        ConfigError: ``cache_path`` or ``misses_path`` is neither ``None`` nor a path.

    Yields:
        The tuner, in tuning mode (cache-only: not, unless another open block tunes). With a
        collective distributed strategy every rank's cache is the same one first
        (:func:`~graphtune.autotuner.distributed.align_cache`).
    """
    for name, value in (("cache_path", cache_path), ("misses_path", misses_path)):
        if value is not None and not isinstance(value, (str, PathLike)):
            raise ConfigError(
                f"autotune({name}={value!r}): {name} must be a path (a str or os.PathLike) or "
                "None; pass the file's path, e.g. autotune('tuning.json')."
            )
    tuner = tuner if tuner is not None else get_tuner()
    path = cache_path if cache_path is not None else env.default_cache_path()
    misses = misses_path if misses_path is not None else env.default_misses_path()
    tuning = (not env.cache_only()) if tune is None else bool(tune)
    if path is not None:
        tuner.cache.load(path, strict=strict)
    strategy = DistributedTuning.resolve(distributed) if distributed is not None else None
    block = _Block(tuning, strategy)
    _enter(tuner, block)
    try:
        align_cache(tuner.cache, tuner.distributed, tuning)  # ranks looking up other caches hang
    except BaseException:
        _leave(tuner, block)
        raise
    first_row = len(tuner.summary_rows())
    try:
        yield tuner
    except BaseException:
        if _leave(tuner, block):
            tuner.close()
        if path is not None and tuning:
            _save_quietly(tuner, path)  # keep what was tuned before the error, without masking it
        raise
    finally:
        if misses is not None and len(tuner.misses):
            _save_misses_quietly(tuner, misses)
    if _leave(tuner, block):
        tuner.close()  # not before: another open block may be tuning through the worker
    rows = tuner.summary_table_rows(first_row)
    if rows:
        logger.info("%s", render_table("graphtune autotuning picks", SUMMARY_COLUMNS, rows))
    if path is not None and tuning and tuner.cache.unsaved(path):
        # Only with something to write: a block that tuned nothing (every profile failed, or
        # all were loaded) leaves the file as it is, or absent, rather than an empty one.
        tuner.cache.save(path)


def _save_quietly(tuner: AutoTuner, path: str | PathLike[str]) -> None:
    if not tuner.cache.unsaved(path):
        return
    try:
        tuner.cache.save(path)
    except CacheFileError as exc:
        logger.warning("could not save the tuning cache after an error: %s", exc)


def _save_misses_quietly(tuner: AutoTuner, path: str | PathLike[str]) -> None:
    try:
        count = tuner.misses.save(path)
    except CacheFileError as exc:
        logger.warning("could not save the record of missed shapes: %s", exc)
        return
    logger.info("%d missed shape(s) recorded in %s", count, path)
