"""Cache commands and saves never destroy a file that is not a tuning cache, never block on a
FIFO, and treat an entry no look-up can use the same way in ``verify``, loading and ``merge``."""

from __future__ import annotations

import json
import logging
import os

import pytest

from graphtune.autotuner import CacheEntry, CacheKey, TuningCache, persist
from graphtune.cli.main import main
from graphtune.errors import CacheFileError

KEY = CacheKey("gemm", ("m.Torch", "m.Tiled"), ((16, 64),), ("bfloat16",), "graph", device="cuda")
OTHER_KEY = CacheKey(
    "gemm", ("m.Torch", "m.Tiled"), ((32, 64),), ("bfloat16",), "graph", device="cuda"
)
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")


def _save(path, *pairs):
    cache = TuningCache()
    for key, entry in pairs:
        cache.put(key, entry)
    cache.save(path)
    return path


def _with_value(path, index, **fields):
    """Edits entry ``index`` of the file as a hand edit would."""
    doc = json.loads(path.read_text())
    doc["entries"][index]["value"].update(fields)
    path.write_text(json.dumps(doc))


def test_clear_refuses_a_file_that_is_not_a_cache_and_keeps_it(tmp_path, capsys) -> None:
    for text in ("[1, 2, 3]", "# notes\n", '{"name": "llama"}'):
        other = tmp_path / "other.json"
        other.write_text(text)
        assert main(["cache", "clear", str(other)]) == 1
        assert "not a graphtune tuning cache" in capsys.readouterr().err
        assert other.read_text() == text


def test_clear_removes_a_cache_of_another_format_version(tmp_path) -> None:
    old = tmp_path / "old.json"
    old.write_text('{"format_version": 1, "entries": []}')
    assert main(["cache", "clear", str(old)]) == 0
    assert not old.exists()


def test_a_save_moves_a_file_that_is_not_a_cache_aside(tmp_path, caplog) -> None:
    path = tmp_path / "cache.json"
    path.write_text("my notes")
    (tmp_path / "cache.json.unusable").write_text("an earlier one")
    with caplog.at_level(logging.WARNING, logger="graphtune"):
        _save(path, (KEY, CacheEntry("m.Tiled", 1, 3, 4.0, 10.0)))
    assert list(persist.load(path)) == [KEY]
    assert (tmp_path / "cache.json.unusable").read_text() == "an earlier one"
    assert (tmp_path / "cache.json.unusable.1").read_text() == "my notes"
    assert any("cache.json.unusable.1" in r.getMessage() for r in caplog.records)


def test_cli_refuses_to_tune_into_a_file_that_is_not_a_cache(tmp_path, capsys) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"hidden_size": 64}')
    assert main(["demo", "--device", "cpu", "--cache", str(config)]) == 1
    assert "is not a graphtune tuning cache" in capsys.readouterr().err
    assert config.read_text() == '{"hidden_size": 64}'


def test_merge_refuses_an_output_that_is_not_a_cache(tmp_path, capsys) -> None:
    a = _save(tmp_path / "a.json", (KEY, CacheEntry("m.Tiled", 1, 3, 4.0, 10.0)))
    b = _save(tmp_path / "b.json", (OTHER_KEY, CacheEntry("m.Tiled", 1, 5, 4.0, 10.0)))
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    assert main(["cache", "merge", str(a), str(b), "-o", str(notes)]) == 1
    assert "is not a graphtune tuning cache" in capsys.readouterr().err
    assert notes.read_text() == "my notes"
    assert main(["cache", "merge", str(a), str(b), "-o", str(a)]) == 0  # a cache may be replaced
    assert set(persist.load(a)) == {KEY, OTHER_KEY}


@needs_fifo
def test_a_fifo_is_refused_without_opening_it(tmp_path, capsys) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for command in (["show"], ["verify"], ["clear"]):
        assert main(["cache", *command, str(fifo)]) == 1
        assert "not a regular file" in capsys.readouterr().err
    assert main(["demo", "--device", "cpu", "--cache", str(fifo)]) == 1
    assert "not a regular file" in capsys.readouterr().err
    with pytest.raises(CacheFileError, match="not a regular file"):
        _save(fifo, (KEY, CacheEntry("m.Tiled", 1, 3, 4.0, 10.0)))
    assert fifo.is_fifo()


def test_an_entry_no_look_up_can_use_is_ignored_everywhere(tmp_path, capsys, caplog) -> None:
    good = CacheEntry("m.Tiled", 1, 3, 4.0, 10.0)
    path = _save(tmp_path / "c.json", (KEY, good), (OTHER_KEY, good))
    _with_value(path, 1, time_us=-5.0)
    # verify: exit 1, the entry listed as ignored (not the whole file skipped)
    assert main(["cache", "verify", str(path)]) == 1
    captured = capsys.readouterr()
    assert "ignored: entry 1" in captured.out and "time_us is -5.0" in captured.out
    assert "ignore the 1 entry" in captured.err and "use the other 1" in captured.err
    # loading: the other entry is used, one warning names the file
    with caplog.at_level(logging.WARNING, logger="graphtune"):
        assert list(persist.load(path)) == [KEY]
    assert sum("Ignoring 1 entries" in r.getMessage() for r in caplog.records) == 1
    # merge: the unusable entry does not beat A's good one, and the output verifies
    a = _save(tmp_path / "a.json", (OTHER_KEY, CacheEntry("m.Tiled", 1, 5, 9.0, 10.0)))
    out = tmp_path / "merged.json"
    assert main(["cache", "merge", str(a), str(path), "-o", str(out)]) == 0
    assert "left out: B" in capsys.readouterr().out
    assert persist.load(out) == {KEY: good, OTHER_KEY: CacheEntry("m.Tiled", 1, 5, 9.0, 10.0)}
    assert main(["cache", "verify", str(out)]) == 0


@pytest.mark.parametrize(
    "field, value",
    [("runner_index", "0"), ("runner_index", True), ("time_us", "4"), ("runner_id", 7)],
)
def test_fields_of_the_wrong_json_type_make_the_file_unusable(tmp_path, capsys, field, value):
    path = _save(tmp_path / "c.json", (KEY, CacheEntry("m.Tiled", 1, 3, 4.0, 10.0)))
    _with_value(path, 0, **{field: value})
    assert main(["cache", "verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"field {field!r}" in err and "skip this file" in err
    assert persist.load(path) == {}


def test_a_key_field_of_the_wrong_type_is_malformed(tmp_path, capsys) -> None:
    path = _save(tmp_path / "c.json", (KEY, CacheEntry("m.Tiled", 1, 3, 4.0, 10.0)))
    doc = json.loads(path.read_text())
    doc["entries"][0]["key"]["op"] = 7
    path.write_text(json.dumps(doc))
    assert main(["cache", "verify", str(path)]) == 1
    assert "field 'op' is 7, expected a string" in capsys.readouterr().err


def test_unblock_takes_the_short_runner_name_and_rejects_an_unknown_one(tmp_path, capsys):
    from graphtune.autotuner.cache import BlockedTactic

    path = tmp_path / "c.json"
    runner = "graphtune.ops.gemm.tiled.TritonGemmRunner"
    blocked = BlockedTactic(runner, {"bm": 16}, "crash: exit code -11")
    persist.save(path, {}, blocklist={blocked.ident: blocked})
    assert main(["cache", "unblock", str(path), "--runner", "nope"]) == 1
    assert runner in capsys.readouterr().err
    assert main(["cache", "unblock", str(path), "--runner", "TritonGemmRunner"]) == 0
    assert "Removed 1 blocked" in capsys.readouterr().out
    assert persist.load_file(path).blocklist == {}
