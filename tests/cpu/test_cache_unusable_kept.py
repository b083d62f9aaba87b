"""A save over a cache of another environment or version keeps that file; the format_version
and strict-mode messages say what to do."""

from __future__ import annotations

import json
import logging

import pytest
from test_faults_cache import entry, key, write_cache

from graphtune.autotuner import TuningCache, maintenance, persist
from graphtune.autotuner.fingerprint import environment_fingerprint
from graphtune.errors import CacheFileError


def _other(path, **changes) -> str:
    """Rewrites the cache at ``path`` with ``changes``; returns its new text."""
    doc = json.loads(path.read_text())
    doc.update(changes)
    text = json.dumps(doc)
    path.write_text(text)
    return text


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"fingerprint": {**environment_fingerprint(), "gpu": "NVIDIA Z100"}}, "environment"),
        ({"format_version": 1}, "format_version 1"),
        ({"format_version": "2"}, "must be the integer 2"),
        ({"format_version": 2.0}, "must be the integer 2 (a JSON integer, not float)"),
    ],
)
def test_a_save_over_an_unusable_cache_moves_it_aside_and_says_where(
    tmp_path, caplog, changes, reason
) -> None:
    path = tmp_path / "c.json"
    write_cache(path, n=3)
    old = _other(path, **changes)
    cache = TuningCache()
    cache.put(key(99), entry([9, "new"]))
    with caplog.at_level(logging.WARNING):
        assert cache.save(path) == 1
    assert list(persist.load(path)) == [key(99)]
    # The old picks are not gone: the file is next to the new one, byte for byte.
    aside = tmp_path / "c.json.unusable"
    assert aside.read_text() == old
    assert str(aside) in caplog.text and reason in caplog.text


def test_a_second_unusable_cache_goes_to_the_next_free_name(tmp_path) -> None:
    path = tmp_path / "c.json"
    (tmp_path / "c.json.unusable").write_text("earlier")
    write_cache(path)
    old = _other(path, fingerprint={**environment_fingerprint(), "torch": "0.1"})
    write_cache(path, n=1)
    assert (tmp_path / "c.json.unusable").read_text() == "earlier"
    assert (tmp_path / "c.json.unusable.1").read_text() == old


def test_format_version_as_a_string_says_it_must_be_the_integer(tmp_path) -> None:
    path = tmp_path / "c.json"
    write_cache(path)
    _other(path, format_version="2")
    with pytest.raises(CacheFileError, match=r"'2' \(str\); it must be the integer 2"):
        persist.load(path, strict=True)
    report = maintenance.verify_file(path)
    assert not report.ok and "must be the integer 2" in report.problems[0]


@pytest.mark.parametrize("version", [2.0, True])
def test_format_version_that_only_equals_2_is_refused(tmp_path, capsys, version) -> None:
    from graphtune.cli.main import main

    # The docs ask for the JSON integer 2: 2.0 (and true, which Python calls 1) is another value.
    path = tmp_path / "c.json"
    write_cache(path)
    _other(path, format_version=version)
    kind = type(version).__name__
    with pytest.raises(CacheFileError, match=rf"\({kind}\); it must be the integer 2"):
        persist.load(path, strict=True)
    assert persist.load(path) == {}
    assert main(["cache", "verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"a JSON integer, not {kind}" in err and err.count("\n") == 1


def test_strict_mode_error_names_the_setting_and_the_fix_not_a_skip(tmp_path, monkeypatch) -> None:
    path = tmp_path / "c.json"
    path.write_text("{")
    monkeypatch.setenv("GRAPHTUNE_STRICT_CACHE", "1")
    with pytest.raises(CacheFileError) as info:
        TuningCache().load(path)
    message = str(info.value)
    assert "GRAPHTUNE_STRICT_CACHE" in message and "cache verify" in message
    assert "Skipping" not in message and "ignored" not in message
    assert path.read_text() == "{"  # strict loading never touches the file
