"""A cache path that cannot be locked fails at once with the real reason; a tuning block that
failed or had nothing to save leaves no empty cache file, no lock file and an existing file as
it was."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from graphtune.autotuner import AutoTuner, autotune, persist, save_target
from graphtune.errors import CacheFileError


def _unwritable_folder(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o500)
        return folder
    if Path("/sys").is_dir():
        return Path("/sys")  # root may write anywhere but there
    pytest.skip("no unwritable folder for root")


def test_unlockable_path_fails_at_once_naming_the_reason(tmp_path):
    path = _unwritable_folder(tmp_path) / "cache.json"
    started = time.perf_counter()
    with pytest.raises(CacheFileError, match="Permission denied") as info:
        persist.save(path, {}, lock_timeout_s=30)
    assert time.perf_counter() - started < 5
    assert "another process" not in str(info.value)
    with pytest.raises(CacheFileError, match="Permission denied"):
        save_target.check_lockable(path)


def test_check_lockable_leaves_nothing_behind(tmp_path):
    path = tmp_path / "cache.json"
    save_target.check_lockable(path)
    assert list(tmp_path.iterdir()) == []
    save_target.check_lockable(tmp_path / "not-yet" / "cache.json")  # save() creates the folder


def test_failed_tuning_leaves_no_empty_cache_and_no_lock(tmp_path):
    path = tmp_path / "cache.json"
    with pytest.raises(RuntimeError, match="boom"), autotune(path, AutoTuner()):
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_a_block_with_nothing_new_writes_nothing(tmp_path):
    path = tmp_path / "cache.json"
    with autotune(path, AutoTuner()):
        pass
    assert list(tmp_path.iterdir()) == []  # was an empty cache file
    persist.save(path, {})
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    with autotune(path, AutoTuner()):  # loads the file, adds nothing
        pass
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


def test_check_lockable_never_removes_a_lock_file_another_process_may_hold(tmp_path):
    # save() runs it before taking the lock: removing a held lock file would let a third process
    # lock a new file at the same path while the holder still writes (two savers at once).
    path = tmp_path / "cache.json"
    lock = save_target.lock_path(path)
    lock.write_text("")
    inode = lock.stat().st_ino
    save_target.check_lockable(path)
    assert lock.exists() and lock.stat().st_ino == inode
