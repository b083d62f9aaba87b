"""``cache clear|unblock|merge`` and their lock files: a folder that cannot hold one gives a clear
error, and a command with nothing to write or an unusable input leaves none behind."""

from __future__ import annotations

import json

import pytest
from test_faults_cache import write_cache

from graphtune.autotuner import maintenance, persist, save_target
from graphtune.cli.main import main
from graphtune.errors import CacheFileError


class ReadOnlyLock:
    """``FileLock`` in a read-only folder (root ignores permission bits, so this stands in)."""

    def __init__(self, path, timeout=None):
        self.path = path

    def acquire(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", self.path)

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        return None


def test_clear_in_a_read_only_folder_is_a_cache_file_error(tmp_path, monkeypatch, capsys) -> None:
    path = tmp_path / "c.json"
    write_cache(path)
    monkeypatch.setattr(save_target, "FileLock", ReadOnlyLock)
    with pytest.raises(CacheFileError, match="Cannot lock tuning cache"):
        with save_target.locked(path):
            pass
    assert main(["cache", "clear", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Cannot lock tuning cache" in err and "Permission denied" in err and "[Errno" not in err
    assert path.exists()


def test_unblock_with_nothing_to_remove_neither_locks_nor_writes(tmp_path, monkeypatch) -> None:
    path = tmp_path / "c.json"
    write_cache(path)
    (tmp_path / "c.json.lock").unlink()
    before = path.stat().st_mtime_ns
    monkeypatch.setattr(persist, "FileLock", ReadOnlyLock)
    assert persist.unblock(path) == []
    assert main(["cache", "unblock", str(path)]) == 0
    assert path.stat().st_mtime_ns == before and not (tmp_path / "c.json.lock").exists()


def test_unblock_malformed_removes_the_items_it_cannot_parse(tmp_path, capsys) -> None:
    path = tmp_path / "c.json"
    write_cache(path, blocked=(3, 4))
    doc = json.loads(path.read_text())
    doc["blocklist"][0]["shapes"] = [1, 64]  # a list where a string belongs
    path.write_text(json.dumps(doc))
    assert main(["cache", "unblock", str(path)]) == 1
    assert "unblock FILE --malformed" in capsys.readouterr().err  # the load error says how
    assert main(["cache", "unblock", str(path), "--malformed"]) == 0
    assert "blocklist item 0" in capsys.readouterr().out
    loaded = persist.load_file(path, strict=True)
    assert len(loaded.entries) == 3 and len(loaded.blocklist) == 1  # the good item stays
    assert main(["cache", "unblock", str(path), "--malformed"]) == 0  # none left: no write


def test_merge_with_an_unusable_input_leaves_no_output_lock(tmp_path, capsys) -> None:
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    write_cache(a)
    b.write_text('{"format_version": 2, "entr')
    assert main(["cache", "merge", str(a), str(b), "-o", str(out)]) == 1
    assert "corrupt" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "out.json.lock").exists()
    with pytest.raises(CacheFileError):
        maintenance.merge_files(a, b, out)
    assert not (tmp_path / "out.json.lock").exists()


def test_clear_of_a_file_that_is_no_cache_leaves_no_lock_file(tmp_path, capsys) -> None:
    # As unblock and merge: the file's kind is checked before its lock file is made.
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    assert main(["cache", "clear", str(notes)]) == 1
    assert "is not a graphtune tuning cache" in capsys.readouterr().err
    assert notes.read_text() == "hello\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
