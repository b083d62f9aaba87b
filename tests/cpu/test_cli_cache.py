"""``graphtune cache show|clear`` through the real CLI entry point."""

from __future__ import annotations

import json

from graphtune.autotuner import CacheEntry, CacheKey, TuningCache
from graphtune.autotuner.fingerprint import environment_fingerprint
from graphtune.cli.main import main


def _cache_file(tmp_path):
    path = tmp_path / "cache.json"
    cache = TuningCache()
    key = CacheKey("gemm", ("m.Torch", "m.Tiled"), ((16, 64), (64, 32)), ("bfloat16",) * 2, "graph")
    cache.put(key, CacheEntry("m.Tiled", 1, {"block": 64}, 4.0, 10.0))
    cache.save(path)
    return path


def test_show_prints_fingerprint_and_entries(tmp_path, capsys) -> None:
    path = _cache_file(tmp_path)
    assert main(["cache", "show", str(path)]) == 0
    out = capsys.readouterr().out
    for text in (
        "gpu",
        "torch",
        environment_fingerprint()["torch"],
        "format_version",
        "Matches this environment",
        "gemm",
        "Tiled",
        "16x64, 64x32",
        "bfloat16",
        "graph",
        '{"block": 64}',
        "2.500",
    ):
        assert text in out, text


def test_show_flags_other_environment(tmp_path, capsys) -> None:
    path = _cache_file(tmp_path)
    doc = json.loads(path.read_text())
    doc["fingerprint"]["gpu"] = "NVIDIA Z100"
    path.write_text(json.dumps(doc))
    assert main(["cache", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "skips this file" in out and "NVIDIA Z100" in out


def test_show_reports_corrupt_and_missing_files(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format_version": 1, "entr')
    assert main(["cache", "show", str(bad)]) == 1
    assert "corrupt" in capsys.readouterr().err
    assert main(["cache", "show", str(tmp_path / "none.json")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_clear_removes_file_and_lock(tmp_path, capsys) -> None:
    path = _cache_file(tmp_path)
    lock = tmp_path / "cache.json.lock"
    lock.touch()
    assert main(["cache", "clear", str(path)]) == 0
    assert "Removed" in capsys.readouterr().out
    assert not path.exists() and not lock.exists()
    assert main(["cache", "clear", str(path)]) == 1
    assert "no tuning cache" in capsys.readouterr().err


def test_cache_without_action_prints_usage(capsys) -> None:
    # Like bare ``graphtune``: the group's help, exit 0.
    assert main(["cache"]) == 0
    assert "show" in capsys.readouterr().out
