"""Save targets a tuning cache save must not lose picks on: a folder or FIFO at the cache path,
a symlinked cache, an output of another environment, and fallback files of two failed saves."""

from __future__ import annotations

import json
import logging
import os

import pytest
from test_faults_cache import entry, key, write_cache

from graphtune.autotuner import TuningCache, persist
from graphtune.errors import CacheFileError

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


def _fallbacks(folder) -> list:
    return sorted(folder.glob("graphtune-*")) if folder.is_dir() else []


@pytest.mark.parametrize("kind", ["folder", pytest.param("fifo", marks=needs_fifo)])
def test_a_save_to_a_folder_or_fifo_keeps_the_picks_in_a_fallback(tmp_path, monkeypatch, kind):
    spare = tmp_path / "tmp"
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(spare))
    target = tmp_path / "cache.json"
    target.mkdir() if kind == "folder" else os.mkfifo(target)
    cache = TuningCache()
    cache.put(key(9), entry([1]))
    with pytest.raises(CacheFileError) as info:
        cache.save(target)
    (kept,) = _fallbacks(spare)
    assert str(kept) in str(info.value)
    monkeypatch.undo()
    assert set(persist.load(kept, strict=True)) == {key(9)}
    assert target.is_dir() if kind == "folder" else target.is_fifo()
    assert not list(tmp_path.glob("cache.json.*"))  # nothing moved aside, no lock file


def test_loading_a_folder_never_promises_to_move_it_aside(tmp_path, caplog) -> None:
    folder = tmp_path / "cache.json"
    folder.mkdir()
    with caplog.at_level(logging.WARNING, logger="graphtune"):
        assert persist.load(folder) == {}
    (record,) = [r for r in caplog.records if str(folder) in r.getMessage()]
    assert ".unusable" not in record.getMessage()


def _other_environment(path) -> str:
    from graphtune.autotuner.fingerprint import environment_fingerprint

    doc = json.loads(path.read_text())
    doc["fingerprint"] = {**environment_fingerprint(), "gpu": "NVIDIA Z100"}
    path.write_text(json.dumps(doc))
    return path.read_text()


def test_merge_keeps_an_output_of_another_environment_as_unusable(tmp_path) -> None:
    from graphtune.cli.main import main

    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    write_cache(a, n=2)
    write_cache(b, n=3)
    write_cache(c, n=5)
    before = _other_environment(c)
    assert main(["cache", "merge", str(a), str(b), "-o", str(c)]) == 0
    assert (tmp_path / "c.json.unusable").read_text() == before
    assert len(persist.load(c, strict=True)) == 3


def test_a_save_through_a_symlink_updates_its_target_and_keeps_the_link(tmp_path) -> None:
    from filelock import FileLock

    from graphtune.autotuner import save_target

    real = tmp_path / "shared" / "real.json"
    real.parent.mkdir()
    write_cache(real, n=2)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    cache = TuningCache()
    cache.put(key(9), entry([1]))
    cache.save(link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert set(persist.load(real, strict=True)) == {key(1), key(2), key(9)}
    # The lock is the target's: a save through the link waits for a holder of the real name.
    with FileLock(str(save_target.lock_path(real))), pytest.raises(CacheFileError):
        persist.save(link, {key(3): entry([3])}, lock_timeout_s=0.1)


def test_two_failed_saves_of_one_file_name_keep_separate_fallbacks(tmp_path, monkeypatch) -> None:
    spare = tmp_path / "tmp"
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(spare))
    kept = {}
    for model, k in (("llama", 1), ("qwen", 2)):
        (tmp_path / model).write_text("a file where the folder should be")
        cache = TuningCache()
        cache.put(key(k), entry([k]))
        with pytest.raises(CacheFileError) as info:
            cache.save(tmp_path / model / "tuning.json")
        (kept[model],) = [p for p in _fallbacks(spare) if str(p) in str(info.value)]
    monkeypatch.undo()
    assert kept["llama"] != kept["qwen"]
    assert set(persist.load(kept["llama"], strict=True)) == {key(1)}
    assert set(persist.load(kept["qwen"], strict=True)) == {key(2)}


@needs_fifo
def test_tune_from_misses_refuses_a_fifo_without_opening_it(tmp_path) -> None:
    import threading

    from graphtune.autotuner import load_misses

    fifo = tmp_path / "m.json"
    os.mkfifo(fifo)
    raised: list[Exception] = []

    def load() -> None:
        try:
            load_misses(fifo)
        except Exception as exc:  # checked below
            raised.append(exc)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(10)
    hung = reader.is_alive()
    if hung:  # blocked in open(): release it before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
    assert not hung and len(raised) == 1 and isinstance(raised[0], CacheFileError)
    assert fifo.is_fifo()


def test_unblock_malformed_names_a_file_that_is_no_cache(tmp_path, capsys) -> None:
    from graphtune.cli.main import main

    notes = tmp_path / "notes.json"
    notes.write_text('{"hidden_size": 64}')
    assert main(["cache", "unblock", str(notes), "--malformed"]) == 1
    assert str(notes) in capsys.readouterr().err
    assert notes.read_text() == '{"hidden_size": 64}'


def test_moving_aside_never_replaces_an_earlier_unusable_file(tmp_path) -> None:
    path = tmp_path / "c.json"
    (tmp_path / "c.json.unusable").write_text("old 0")
    for n in range(1, 1000):
        (tmp_path / f"c.json.unusable.{n}").write_text(f"old {n}")
    path.write_text("someone's notes")
    cache = TuningCache()
    cache.put(key(1), entry([1]))
    cache.save(path)
    assert (tmp_path / "c.json.unusable.999").read_text() == "old 999"
    assert (tmp_path / "c.json.unusable.1000").read_text() == "someone's notes"


def test_a_json_update_through_a_symlink_locks_and_writes_its_target(tmp_path) -> None:
    # The misses record's read-merge-write (json_update), as the cache save above.
    from filelock import FileLock

    from graphtune.autotuner import json_update, save_target

    real = tmp_path / "shared" / "misses.json"
    real.parent.mkdir()
    real.write_text('{"n": 1}\n')
    link = tmp_path / "link.json"
    link.symlink_to(real)

    def merge(old):
        return {"n": (old or {"n": 0})["n"] + 1}

    json_update.update_json(link, merge, problem=lambda doc: None, what="record")
    assert link.is_symlink() and json.loads(real.read_text()) == {"n": 2}
    with FileLock(str(save_target.lock_path(real))), pytest.raises(CacheFileError):
        json_update.update_json(link, merge, problem=lambda doc: None, lock_timeout_s=0.1)
