"""``graphtune cache show|clear`` through the real CLI entry point, and ``cache show`` into a
pipe whose reader is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from filelock import FileLock
from test_cli_errors import ENV

from graphtune.autotuner import CacheEntry, CacheKey, TuningCache, persist, save_target
from graphtune.autotuner.fingerprint import environment_fingerprint
from graphtune.cli.main import main


def _cache_file(tmp_path):
    path = tmp_path / "cache.json"
    cache = TuningCache()
    key = CacheKey(
        "gemm",
        ("m.Torch", "m.Tiled"),
        ((16, 64), (64, 32)),
        ("bfloat16",) * 2,
        "graph",
        device="cuda",
    )
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
        '{"block":64}',
        "2.500",
    ):
        assert text in out, text


def test_show_prints_names_tactics_and_reasons_as_literal_text(
    tmp_path, capsys, monkeypatch
) -> None:
    from graphtune.autotuner.entries import BlockedTactic

    # Rich reads "[false,128]" as a style tag (an empty cell) and "[/]" as a closing tag with
    # nothing to close (a MarkupError): every cell, and the title's path, must print as given.
    monkeypatch.chdir(tmp_path)  # a short path: the title is not wrapped
    path = "c[/].json"
    cache = TuningCache()
    ops = ["[/]", "[bold red]loud", "x[/y]", "g"]
    tactics = [(False, 128), [None, 2], {"split_k": [True]}, "[/]"]
    for rows, (op, tactic) in enumerate(zip(ops, tactics, strict=True), 1):
        k = CacheKey(op, ("m.R[/]",), ((rows, 8),), ("float32",), "wallclock", device="cpu")
        cache.put(k, CacheEntry("m.R[/]", 0, tactic, 1.0, 2.0))
    cache.block(BlockedTactic("m.R[/]", (True, 32), "crash [/] [bold]x", "[/]", "1x8"))
    cache.save(path)
    assert main(["cache", "show", path]) == 0
    out = capsys.readouterr().out
    cells = ("[false,128]", "[null,2]", '{"split_k":[true]}', '"[/]"', "[bold red]loud", "x[/y]")
    for text in (f"tuning cache {path}", *cells, "R[/]", "[true,32]", "crash [/] [bold]x"):
        assert text in out, text


def test_tables_print_markup_as_text() -> None:
    from graphtune.reporting import render_table

    text = render_table("t [/]", ("[b]col", "n"), [("[false,1]", 1.0), ("[/x]", None)])
    for cell in ("t [/]", "[b]col", "[false,1]", "[/x]"):
        assert cell in text, cell


def test_progress_labels_print_markup_as_text(monkeypatch) -> None:
    import io

    from rich.console import Console

    from graphtune import reporting

    # The bar's label holds the op name ("tuning OP"); a terminal shows it as given.
    shown = io.StringIO()
    terminal = Console(file=shown, force_terminal=True, width=100, color_system=None)
    monkeypatch.setattr(reporting, "Console", lambda **kwargs: terminal)
    with reporting.progress("tuning [/]", 2, enabled=True) as bar:
        bar.advance()
        bar.advance("tuning [red]x[/]")
    assert "tuning [/] " in shown.getvalue() and "tuning [red]x[/] " in shown.getvalue()


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


def test_clear_removes_the_file_under_its_lock_and_keeps_the_lock_file(
    tmp_path, capsys, monkeypatch
) -> None:
    path = _cache_file(tmp_path)
    lock = save_target.lock_path(path)
    lock.touch()
    inode = lock.stat().st_ino
    # A save in progress holds the lock: clear waits for it (here: times out) and removes nothing.
    monkeypatch.setattr(persist, "LOCK_TIMEOUT_S", 0.2)
    with FileLock(str(lock)):
        assert main(["cache", "clear", str(path)]) == 1
    assert "Could not lock" in capsys.readouterr().err and path.exists()
    assert main(["cache", "clear", str(path)]) == 0
    assert "Removed" in capsys.readouterr().out
    # The lock file stays: a process waiting on it must lock the same file as the next one.
    assert not path.exists() and lock.exists() and lock.stat().st_ino == inode
    assert main(["cache", "clear", str(path)]) == 1
    assert "no tuning cache" in capsys.readouterr().err


def test_clear_through_a_link_removes_the_file_it_names_and_keeps_the_link(
    tmp_path, capsys
) -> None:
    path = _cache_file(tmp_path)
    link = tmp_path / "link.json"
    link.symlink_to(path.name)
    assert main(["cache", "clear", str(link)]) == 0
    out = capsys.readouterr().out
    assert f"Removed tuning cache {path} (what {link} resolves to)" in out
    assert f"the link {link} stays" in out
    assert not path.exists() and link.is_symlink()
    assert persist.load(path) == {}  # its picks are gone, not just the link
    assert main(["cache", "clear", str(link)]) == 1
    assert "no tuning cache" in capsys.readouterr().err


def test_cache_without_action_prints_usage(capsys) -> None:
    # Like bare ``graphtune``: the group's help, exit 0.
    assert main(["cache"]) == 0
    assert "show" in capsys.readouterr().out


def test_tactics_with_tuple_keys_survive_a_reload_and_the_cache_commands(tmp_path, capsys) -> None:
    from graphtune.autotuner.entries import BlockedTactic

    path = tmp_path / "cache.json"
    key = CacheKey("op", ("m.R",), ((4, 2),), ("float32",), "graph", device="cuda")
    tactic = {(64, 128): {"warps": 4}}  # a dict keyed by tile: JSON holds it as its pairs
    cache = TuningCache()
    cache.put(key, CacheEntry("m.R", 0, tactic, 1.0, 2.0))
    cache.block(BlockedTactic("m.R", {(32, 64): 2}, "crash", "op", "4x2"))
    cache.save(path)
    loaded = TuningCache()
    assert loaded.load(path, strict=True) == 1 and loaded.get(key).tactic == tactic
    for command in (["verify"], ["show"], ["unblock", "--runner", "R"]):
        assert main(["cache", command[0], str(path), *command[1:]]) == 0, command
    assert '[[64,128],{"warps":4}]' in capsys.readouterr().out.replace(" ", "")


def test_unblock_changes_only_the_blocklist_and_keeps_entries_loading_ignores(
    tmp_path, capsys
) -> None:
    from graphtune.autotuner.entries import BlockedTactic

    path = tmp_path / "c.json"
    cache = TuningCache()
    k = CacheKey("op", ("m.R",), ((1, 8),), ("float32",), "wallclock", device="cpu")
    cache.put(k, CacheEntry("m.R", 0, 3, 1.0, 2.0))
    cache.block(BlockedTactic("m.R", 7, "crash: exit code -11", "op", "1x8"))
    cache.block(BlockedTactic("m.R", (64, 2), "timeout", "op", "1x8"))
    cache.save(path)
    doc = json.loads(path.read_text())
    usable = doc["entries"][0]
    no_device = json.loads(json.dumps(usable))  # as a graphtune before keyed devices saved it
    del no_device["key"]["device"]
    no_device["key"]["shapes"] = [[2, 8]]
    bad_index = json.loads(json.dumps(usable))
    bad_index["key"]["shapes"], bad_index["value"]["runner_index"] = [[4, 8]], 5
    duplicate = json.loads(json.dumps(usable))
    duplicate["value"]["tactic"] = 9
    doc["entries"] += [no_device, bad_index, duplicate]
    path.write_text(json.dumps(doc, indent=1))
    entries = json.dumps(doc["entries"])
    assert main(["cache", "unblock", str(path), "--tactic", "7"]) == 0
    assert "Removed 1 blocked tactic(s)" in capsys.readouterr().out
    after = json.loads(path.read_text())
    assert json.dumps(after["entries"]) == entries  # all four, each as it was
    assert after["blocklist"] == doc["blocklist"][1:] and after["fingerprint"] == doc["fingerprint"]
    assert main(["cache", "unblock", str(path)]) == 0
    after = json.loads(path.read_text())
    assert json.dumps(after["entries"]) == entries and "blocklist" not in after


def test_unblock_and_merge_of_missing_files_leave_no_lock_files(tmp_path, capsys) -> None:
    missing, out = tmp_path / "missing.json", tmp_path / "out.json"
    assert main(["cache", "unblock", str(missing)]) == 1
    assert main(["cache", "merge", str(missing), str(missing), "-o", str(out)]) == 1
    assert capsys.readouterr().err.count("does not exist") == 2
    assert list(tmp_path.iterdir()) == []


def test_show_into_a_closed_pipe_stops_quietly_with_141(tmp_path) -> None:
    # As `graphtune cache show FILE | head -1`: the reader is gone before the first line, so
    # every write fails (EPIPE), the way it fails when head exits early.
    path = _cache_file(tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "graphtune", "cache", "show", str(path)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr  # 128 + SIGPIPE, as a shell reports it
    assert done.stderr == ""  # no error line, no traceback, no "Exception ignored" at exit
