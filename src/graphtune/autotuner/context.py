"""The process-default tuner (:func:`get_tuner`) and the :func:`autotune` context manager."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from os import PathLike

from graphtune import env
from graphtune.autotuner.distributed import DistributedTuning, align_cache
from graphtune.autotuner.tuner import SUMMARY_COLUMNS, AutoTuner
from graphtune.errors import CacheFileError
from graphtune.reporting import render_table

logger = logging.getLogger(__name__)

_default_tuner: AutoTuner | None = None
_default_lock = threading.Lock()


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

    Yields:
        The tuner, in tuning mode (cache-only: not in tuning mode). With a collective distributed
        strategy every rank's cache is the same one first
        (:func:`~graphtune.autotuner.distributed.align_cache`).
    """
    tuner = tuner if tuner is not None else get_tuner()
    path = cache_path if cache_path is not None else env.default_cache_path()
    misses = misses_path if misses_path is not None else env.default_misses_path()
    tuning = (not env.cache_only()) if tune is None else bool(tune)
    if path is not None:
        tuner.cache.load(path, strict=strict)
    previous, previous_dist = tuner.tuning_mode, tuner.distributed
    if distributed is not None:
        tuner.distributed = DistributedTuning.resolve(distributed)
    align_cache(tuner.cache, tuner.distributed, tuning)  # ranks looking up other caches would hang
    first_row = len(tuner.summary_rows())
    tuner.tuning_mode = tuning
    try:
        yield tuner
    except BaseException:
        tuner.tuning_mode, tuner.distributed = previous, previous_dist
        tuner.close()
        if path is not None and tuning:
            _save_quietly(tuner, path)  # keep what was tuned before the error, without masking it
        raise
    finally:
        if misses is not None and len(tuner.misses):
            _save_misses_quietly(tuner, misses)
    tuner.tuning_mode, tuner.distributed = previous, previous_dist
    tuner.close()
    rows = tuner.summary_rows()[first_row:]
    if rows:
        logger.info("%s", render_table("graphtune autotuning picks", SUMMARY_COLUMNS, rows))
    if path is not None and tuning:
        tuner.cache.save(path)


def _save_quietly(tuner: AutoTuner, path: str | PathLike[str]) -> None:
    if not len(tuner.cache) and not tuner.cache.blocklist():
        return  # nothing tuned, loaded or blocked: leave no empty cache file behind
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
