"""An existing cache (or misses) file that cannot be read (EACCES, EIO) is never moved aside or
replaced: the save fails as on an unwritable file, with its picks in a fallback file."""

from __future__ import annotations

import errno
import json
import logging
import pathlib

import pytest

from graphtune.autotuner import CacheEntry, CacheKey, TuningCache, persist
from graphtune.autotuner.calls import CallRecord, MissLog
from graphtune.errors import CacheFileError

KEY = CacheKey("op", ("m.R",), ((4, 8),), ("float32",), "wallclock", device="cpu")
NEW = CacheKey("new", ("m.R",), ((4, 8),), ("float32",), "wallclock", device="cpu")
ENTRY = CacheEntry("m.R", 0, 3, 1.0, 2.0)


@pytest.fixture
def unreadable(monkeypatch):
    """Makes reading the given files fail with EACCES (the tests run as root, which chmod
    does not stop)."""
    paths: set[pathlib.Path] = set()
    real = pathlib.Path.read_text

    def read_text(self, *args, **kwargs):
        if self.resolve() in paths:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    return lambda path: paths.add(pathlib.Path(path).resolve())


@pytest.fixture
def spare(tmp_path, monkeypatch):
    folder = tmp_path / "spare"
    folder.mkdir()
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(folder))
    return folder


def test_a_cache_that_cannot_be_read_is_kept_and_the_save_fails(
    tmp_path, unreadable, spare, caplog
) -> None:
    path = tmp_path / "team.json"
    persist.save(path, {KEY: ENTRY})
    before = path.read_bytes()
    unreadable(path)
    cache = TuningCache()
    with caplog.at_level(logging.WARNING):
        assert cache.load(path) == 0
    assert "a save there fails too" in caplog.text
    cache.put(NEW, ENTRY)
    with pytest.raises(CacheFileError) as raised:
        cache.save(path)
    message = str(raised.value)
    assert "cannot be read" in message and "never moved aside" in message
    assert path.read_bytes() == before  # neither moved aside nor replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spare", "team.json", "team.json.lock"]
    (fallback,) = spare.iterdir()
    assert str(fallback) in message
    assert [e["key"]["op"] for e in json.loads(fallback.read_text())["entries"]] == ["new"]
    assert cache.unsaved(path) == 1


def test_a_misses_file_that_cannot_be_read_is_kept_and_the_save_fails(
    tmp_path, unreadable, spare
) -> None:
    path = tmp_path / "misses.json"
    path.write_text('{"format": "graphtune-misses", "version": 1, "misses": []}\n')
    unreadable(path)
    log = MissLog()
    log.add(KEY, lambda: CallRecord("op", ("m.R",), {}, (), {}, KEY.to_json()))
    with pytest.raises(CacheFileError, match="Permission denied"):
        log.save(path)
    assert path.read_bytes().decode().startswith('{"format": "graphtune-misses"')
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "misses.json",
        "misses.json.lock",
        "spare",
    ]
    assert len(list(spare.iterdir())) == 1
