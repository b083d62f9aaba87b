"""Saving the record of missed shapes loses nothing: unreadable old records stay, a failed
write goes to a fallback file it names, and a tuning cache or a folder is never moved aside."""

from __future__ import annotations

import json
import re
import tempfile
from types import SimpleNamespace

import pytest
import torch
from test_faults_cache import write_cache
from test_misses import Plain

from graphtune import atomic_files
from graphtune.autotuner import AutoTuner, DynamicTensorSpec, TuningConfig, json_update
from graphtune.autotuner.calls import load_misses
from graphtune.cli import generate
from graphtune.cli.main import main
from graphtune.errors import CacheFileError

CONFIG = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 4)),))


def missed(rows: int = 4) -> AutoTuner:
    tuner = AutoTuner(show_progress=False)
    tuner.choose_one("op", [Plain()], CONFIG, [torch.randn(rows, 3)])
    return tuner


def test_a_save_keeps_old_records_it_cannot_parse_and_loading_names_them(tmp_path) -> None:
    path = tmp_path / "m.json"
    assert missed(4).misses.save(path) == 1
    doc = json.loads(path.read_text())
    damaged = {k: v for k, v in doc["misses"][0].items() if k != "runners"}
    doc["misses"] = [damaged]
    path.write_text(json.dumps(doc))
    assert missed(2).misses.save(path) == 2
    assert damaged in json.loads(path.read_text())["misses"]  # kept as it was
    with pytest.raises(CacheFileError, match=r"record 1 \(op 'op'\).*field 'runners' is missing"):
        load_misses(path)


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("runners", "abc", "field 'runners' is 'abc', not a list of runner ids"),
        ("runners", [1], r"field 'runners' is \[1\], not a list of runner ids"),
        ("count", -3, "field 'count' is -3, not an integer >= 1"),
        ("count", 2.5, "field 'count' is 2.5, not an integer >= 1"),
        ("count", True, "field 'count' is True, not an integer >= 1"),
    ],
)
def test_a_record_field_of_another_type_is_malformed_not_converted(
    tmp_path, field, value, says
) -> None:
    # Read leniently, "abc" was three runners and 2.5 two misses: refused as malformed, as a
    # missing field is (kept as it is by a save, named by its index when loading).
    path = tmp_path / "m.json"
    assert missed(4).misses.save(path) == 1
    doc = json.loads(path.read_text())
    doc["misses"][0][field] = value
    path.write_text(json.dumps(doc))
    with pytest.raises(CacheFileError, match=rf"record 0 \(op 'op'\) .*is malformed: {says}; fix"):
        load_misses(path)
    assert missed(2).misses.save(path) == 2
    assert doc["misses"][0] in json.loads(path.read_text())["misses"]  # kept as it was


@pytest.mark.parametrize("version", ["1", 1.0, True])
def test_a_misses_version_that_only_equals_1_is_refused_as_a_cache_version_is(
    tmp_path, caplog, version
) -> None:
    # One rule and one wording with the tuning cache's format_version (cache_reader.
    # version_problem): the message says what the field must be instead of "1; reads 1".
    path = tmp_path / "m.json"
    text = json.dumps({"format": "graphtune-misses", "version": version, "misses": []})
    path.write_text(text)
    kind = type(version).__name__
    rule = f"version {version!r} ({kind}); it must be the integer 1 ("
    with pytest.raises(CacheFileError, match=re.escape(f"m.json has {rule}")) as info:
        load_misses(path)
    assert "this graphtune reads 1" not in str(info.value)
    assert missed(4).misses.save(path) == 1  # moved aside, saying why the same way
    assert (tmp_path / "m.json.unusable").read_text() == text
    assert f"is a misses file of {rule}" in caplog.text


def test_a_failed_misses_write_goes_to_a_fallback_file_it_names(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(atomic_files.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    def refuse(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(json_update, "write_atomically", refuse)
    path = tmp_path / "m.json"
    with pytest.raises(CacheFileError) as info:
        missed().misses.save(path)
    (fallback,) = (tmp_path / "tmp").rglob("*m.json*")
    assert str(fallback) in str(info.value) and not path.exists()
    assert len(load_misses(fallback)) == 1  # `tune --from-misses` reads it as it is


def test_a_partial_fallback_is_never_advised_to_replace_the_file(tmp_path, monkeypatch) -> None:
    # The lock timed out, so the file was never read: the fallback holds only this save's
    # records, and copying it over the file would drop the file's own.
    from filelock import FileLock

    from graphtune.autotuner import save_target

    monkeypatch.setattr(atomic_files.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = tmp_path / "m.json"
    missed(4).misses.save(path)
    update = json_update.update_json

    def quick(*args, **kwargs):
        return update(*args, **{**kwargs, "lock_timeout_s": 0.1})

    monkeypatch.setattr(json_update, "update_json", quick)
    with FileLock(str(save_target.lock_path(path))), pytest.raises(CacheFileError) as info:
        missed(2).misses.save(path)
    message = str(info.value)
    assert "only if" in message and "copy it to the path" not in message
    assert len(load_misses(path)) == 1  # the file as it was


def test_a_misses_save_to_a_fifo_keeps_the_records_in_a_fallback(tmp_path, monkeypatch) -> None:
    import os

    monkeypatch.setattr(atomic_files.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fifo = tmp_path / "m.json"
    os.mkfifo(fifo)
    with pytest.raises(CacheFileError, match="not a regular file") as info:
        missed().misses.save(fifo)
    (fallback,) = (tmp_path / "tmp").rglob("*m.json*")
    assert str(fallback) in str(info.value) and len(load_misses(fallback)) == 1


def test_generate_exits_1_and_names_where_the_misses_went(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("GRAPHTUNE_MISSES", str(tmp_path / "m.json"))
    engine = SimpleNamespace(tuner=missed())

    def fail(path):
        raise CacheFileError("Could not write ...; it is in /tmp/x instead")

    monkeypatch.setattr(engine.tuner.misses, "save", fail)
    assert generate._save_misses(engine) is False  # run_generate then returns 1
    assert "/tmp/x" in capsys.readouterr().err


def test_a_misses_save_never_moves_a_tuning_cache_or_a_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(atomic_files.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cache = tmp_path / "c.json"
    write_cache(cache)
    text = cache.read_text()
    folder = tmp_path / "d"
    folder.mkdir()
    for target in (cache, folder):
        with pytest.raises(CacheFileError, match="pass another path") as info:
            missed().misses.save(target)
        assert "instead" in str(info.value)  # the misses went to a fallback file it names
    assert cache.read_text() == text and folder.is_dir()
    assert not list(tmp_path.glob("*.unusable*"))


GENERATE = ["generate", "--model", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "1"]
GENERATE += ["--device", "cpu", "--runner", "eager"]


TARGETS = ["cache", "folder", "other cache", "read-only", "file as folder", "notes"]


@pytest.mark.parametrize("target", TARGETS)
def test_generate_refuses_an_unfit_misses_path_before_the_run(
    tmp_path, monkeypatch, capsys, target
) -> None:
    cache = tmp_path / "c.json"
    write_cache(cache)
    misses = {
        "cache": cache,
        "folder": tmp_path,
        "other cache": tmp_path / "other.json",
        "read-only": tmp_path / "ro" / "m.json",
        "file as folder": cache / "sub" / "m.json",
        "notes": tmp_path / "notes.txt",
    }[target]
    (tmp_path / "notes.txt").write_text("my notes")
    write_cache(tmp_path / "other.json")
    (tmp_path / "ro").mkdir()
    if target == "read-only":  # as root, permission bits do not stop a write
        real = tempfile.NamedTemporaryFile

        def refuse(*args, dir=None, **kwargs):
            if str(dir) == str(tmp_path / "ro"):
                raise PermissionError(13, "Permission denied")
            return real(*args, dir=dir, **kwargs)

        monkeypatch.setattr("graphtune.cli._args.tempfile.NamedTemporaryFile", refuse)
    monkeypatch.setenv("GRAPHTUNE_MISSES", str(misses))
    assert main([*GENERATE, "--tuning-cache", str(cache)]) == 1
    err = capsys.readouterr().err
    assert "GRAPHTUNE_MISSES" in err and "Traceback" not in err
    assert "tokens" not in err  # refused before the run
    assert cache.exists() and not list(tmp_path.glob("*.unusable*"))


@pytest.mark.parametrize("content, says", [(None, "does not exist"), ("{", "cannot be read")])
def test_generate_only_reads_its_tuning_cache(tmp_path, capsys, content, says) -> None:
    cache = tmp_path / "c.json"
    if content is not None:
        cache.write_text(content)
    assert main([*GENERATE, "--tuning-cache", str(cache)]) == 1
    err = capsys.readouterr().err
    assert says in err and str(cache) in err and "saving" not in err
    assert not (tmp_path / "c.json.lock").exists()


def test_a_graphtune_cache_default_not_written_yet_runs_untuned(
    tmp_path, monkeypatch, capsys, caplog
) -> None:
    # GRAPHTUNE_CACHE is set once for every command: before the first tuning run its file is
    # missing, and generate then runs untuned with one warning (an explicit flag is an error).
    from graphtune.cli._args import lookup_cache_path

    later = tmp_path / "later.json"
    monkeypatch.setenv("GRAPHTUNE_CACHE", str(later))
    assert main(GENERATE) == 0
    assert any("does not exist yet" in r.getMessage() for r in caplog.records)
    assert not later.exists()
    # The path is kept, so the engine still looks picks up and GRAPHTUNE_MISSES records them.
    assert lookup_cache_path(None, "--tuning-cache") == later


def test_tune_refuses_a_misses_record_at_its_own_cache_before_tuning(
    tmp_path, monkeypatch, capsys
) -> None:
    cache = tmp_path / "c.json"
    monkeypatch.setenv("GRAPHTUNE_MISSES", str(cache))
    args = ["tune", "--model", "tiny", "--cache", str(cache), "--device", "cpu", "--max-batch", "1"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "GRAPHTUNE_MISSES" in err and "Traceback" not in err
    assert not cache.exists()  # refused before any tuning


def test_saving_through_a_link_then_to_its_target_counts_each_miss_once(tmp_path) -> None:
    target, link = tmp_path / "misses.json", tmp_path / "link.json"
    link.symlink_to("misses.json")
    tuner = AutoTuner()
    tuner.choose_one("op", [Plain()], TuningConfig(), [torch.randn(3, 3)])
    tuner.misses.save(link)
    tuner.misses.save(target)  # the same file: nothing new to add
    assert [r.count for r in load_misses(target)] == [1]
    assert link.is_symlink()
