"""Cache file safety: writers killed mid-save, concurrent writers, unusable files, the blocklist
in the file, and ``graphtune cache verify|merge|unblock``."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import time

import pytest

from graphtune.autotuner import CacheEntry, CacheKey, TuningCache, persist, save_target
from graphtune.autotuner.entries import BlockedTactic
from graphtune.autotuner.fingerprint import environment_fingerprint
from graphtune.cli.main import main
from graphtune.errors import CacheFileError


def key(i: int, op: str = "gemm") -> CacheKey:
    return CacheKey(op, ("m.A", "m.B"), ((i, 64),), ("float32",), "wallclock", device="cpu")


def entry(tactic, time_us: float | None = 2.0, index: int = 1) -> CacheEntry:
    return CacheEntry(("m.A", "m.B")[index], index, tactic, time_us, 4.0)


def write_cache(path, n: int = 3, blocked: tuple = ()) -> TuningCache:
    cache = TuningCache()
    for i in range(n):
        cache.put(key(i + 1), entry([i, "old"]))
    for tactic in blocked:
        cache.block(BlockedTactic("m.B", tactic, "crash: exit code 7", "gemm", "1x64"))
    cache.save(path)
    return cache


# ---------------------------------------------------------------- a save killed half-way


def _dying_writer(path: str, how: str, ready) -> None:
    from graphtune.autotuner import TuningCache, persist

    def fault(tmp) -> None:
        ready.set()
        if how == "exit":
            os._exit(9)  # the process dies between the complete temp file and the rename
        time.sleep(600)  # paused here until the parent SIGKILLs it

    persist._after_temp_write = fault
    cache = TuningCache()
    cache.put(key(99), entry(["new"]))
    cache.save(path)


@pytest.mark.slow
def test_writer_killed_mid_save_leaves_old_file_intact(tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")
    runs = []
    for how in ("exit", "kill"):
        path = tmp_path / how / "cache.json"
        path.parent.mkdir()
        write_cache(path)
        ready = ctx.Event()
        proc = ctx.Process(target=_dying_writer, args=(str(path), how, ready))
        proc.start()
        runs.append((how, path, path.read_bytes(), ready, proc))
    for how, path, before, ready, proc in runs:
        assert ready.wait(120), "the writer never reached the fault point"
        if how == "kill":
            proc.kill()
        proc.join(60)
        assert proc.exitcode == (9 if how == "exit" else -9)
        assert path.read_bytes() == before, "the old file must be untouched"
        assert len(persist.load(path, strict=True)) == 3
        assert list(path.parent.glob(".cache.json.*.tmp")), "the dead writer's temp file"
        # The dead writer's lock died with it; the next save takes it, cleans up, loses nothing.
        cache = TuningCache()
        cache.put(key(50), entry(["after"]))
        assert persist.save(path, dict(cache.items()), lock_timeout_s=10) == 4
        assert not list(path.parent.glob(".cache.json.*.tmp"))


def test_failed_rename_keeps_old_file_and_removes_temp(tmp_path, monkeypatch) -> None:
    path = tmp_path / "cache.json"
    write_cache(path)
    before = path.read_bytes()

    def refuse(src, dst) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    cache = TuningCache()
    cache.put(key(7), entry(["x"]))
    with pytest.raises(CacheFileError, match="No space left"):
        cache.save(path)
    assert path.read_bytes() == before
    assert not list(tmp_path.glob(".cache.json.*.tmp"))


def test_a_failed_save_keeps_the_picks_in_a_fallback_file_it_names(tmp_path, monkeypatch) -> None:
    path = tmp_path / "cache.json"
    write_cache(path, n=2)

    def disk_full(tmp) -> None:  # the target's disk only: the temporary folder has room
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(persist, "_after_temp_write", disk_full)
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path / "tmp"))
    cache = TuningCache()
    cache.put(key(7), entry(["x"]))
    with pytest.raises(CacheFileError, match="No space left") as info:
        cache.save(path)
    (kept,) = (tmp_path / "tmp").glob("graphtune-*-cache.json")
    assert str(kept) in str(info.value) and "\n" not in str(info.value)
    # The fallback holds what the file would have held: its two entries and the new one.
    monkeypatch.undo()
    assert len(persist.load(kept, strict=True)) == 3 and len(persist.load(path)) == 2
    assert cache.unsaved(path) == 1  # so `graphtune tune` does not claim the picks were kept


def test_a_lock_timeout_advises_merging_the_fallback_which_keeps_every_entry(
    tmp_path, monkeypatch, capsys
) -> None:
    # Without the lock the file is never read: the fallback holds only this save's entry, so
    # copying it over the file would drop the file's two entries.
    from filelock import FileLock

    path = tmp_path / "cache.json"
    write_cache(path, n=2)
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path / "tmp"))
    cache = TuningCache()
    cache.put(key(7), entry(["x"]))
    # A re-measurement of a key the file holds, slower than the file's: a save keeps it (it is
    # the newer measurement), so the advised merge must too ("faster wins" kept the file's).
    cache.put(key(2), entry(["new"], time_us=3.0))
    with FileLock(str(save_target.lock_path(path))), pytest.raises(CacheFileError) as info:
        persist.save(path, dict(cache.items()), lock_timeout_s=0.2)
    message = str(info.value)
    (kept,) = (tmp_path / "tmp").glob("graphtune-*-cache.json")
    assert "within 0.2 s" in message and "copy it to" not in message
    advice = f"graphtune cache merge {path} {kept} --prefer b -o {path}"
    assert advice in message
    monkeypatch.undo()
    assert len(persist.load(kept, strict=True)) == 2
    assert main(advice.split()[1:]) == 0
    merged = persist.load(path, strict=True)
    assert set(merged) == {key(1), key(2), key(7)}
    assert merged[key(2)].tactic == ["new"]  # as the failed save would have written it


def test_a_save_removes_only_its_own_stale_temp_files(tmp_path) -> None:
    # ``t.json.rank1`` is another cache with its own lock: its writer may be mid-save while
    # ``t.json`` saves, and a prefix match on ``.t.json.`` would delete its temporary file.
    others = [tmp_path / ".t.json.rank1.ab12cd34.tmp", tmp_path / ".t.json.tmp.ab12cd34.tmp"]
    for other in others:
        other.write_text("{}")
    own = tmp_path / ".t.json.ab12cd34.tmp"  # left by a writer of t.json that died
    own.write_text("{")
    write_cache(tmp_path / "t.json", n=1)
    assert all(other.exists() for other in others) and not own.exists()
    assert len(persist.load(tmp_path / "t.json", strict=True)) == 1


# ---------------------------------------------------------------- concurrent writers

WRITERS, SAVES = 3, 8


def _writer(path: str, writer: int, barrier) -> None:
    from graphtune.autotuner import TuningCache
    from graphtune.autotuner.entries import BlockedTactic

    barrier.wait()
    for i in range(SAVES):
        cache = TuningCache()  # fresh: only the file carries earlier entries forward
        cache.put(key(100 * writer + i + 1, op=f"op{writer}"), entry([writer, i]))
        cache.block(BlockedTactic("m.B", [writer, i], "timeout", f"op{writer}"))
        cache.save(path)


@pytest.mark.slow
def test_three_processes_writing_one_file_lose_nothing(tmp_path) -> None:
    path = str(tmp_path / "cache.json")
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=_writer, args=(path, w, barrier)) for w in range(WRITERS)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=180)
    assert [proc.exitcode for proc in procs] == [0] * WRITERS
    loaded = persist.load_file(path, strict=True)
    expected = {(w, i) for w in range(WRITERS) for i in range(SAVES)}
    assert {tuple(e.tactic) for e in loaded.entries.values()} == expected
    assert {tuple(b.tactic) for b in loaded.blocklist.values()} == expected


# ---------------------------------------------------------------- unusable files


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"format_version": 2, "fingerprint": {}, "entries": [{"key": ', "truncated"),
        ("\udcff", "corrupt"),
        ('{"format_version": 2, "fingerprint": FP, "entries": [], "time": NaN}', "NaN"),
        ('{"format_version": 2, "fingerprint": FP, "entries": [], "blocklist": [3]}', "blocklist"),
        ('{"format_version": 1, "fingerprint": FP, "entries": []}', "format_version 1"),
        ('{"format_version": 3, "fingerprint": FP, "entries": []}', "format_version 3"),
        ('{"format_version": 2, "fingerprint": {"gpu": "Z100"}, "entries": []}', "environment"),
    ],
)
def test_unusable_file_skipped_with_one_warning_naming_file_and_reason(
    tmp_path, caplog, text: str, reason: str
) -> None:
    path = tmp_path / "cache.json"
    text = text.replace("FP", json.dumps(environment_fingerprint()))
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    caplog.set_level(logging.WARNING)
    cache = TuningCache()
    assert cache.load(path) == 0 and not cache.blocklist()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert str(path) in warnings[0].getMessage() and reason in warnings[0].getMessage()
    assert f"graphtune cache verify {path}" in warnings[0].getMessage()  # a CLI user's next step


def test_blocklist_round_trip_and_unblock(tmp_path) -> None:
    path = tmp_path / "cache.json"
    write_cache(path, blocked=([1, 2], "x"))
    cache = TuningCache()
    cache.load(path, strict=True)
    assert cache.blocked("m.B", (1, 2)) is not None and cache.blocked("m.B", "x") is not None
    cache.clear_blocklist()
    cache.save(path)  # saving merges: clearing memory does not clear the file
    assert len(persist.load_file(path).blocklist) == 2
    removed = persist.unblock(path, tactic=[1, 2], match_tactic=True)
    assert [b.tactic for b in removed] == [[1, 2]]
    assert [b.tactic for b in persist.load_file(path).blocklist.values()] == ["x"]
    assert len(persist.load(path)) == 3, "entries are untouched"


def test_a_tactic_blocked_again_after_an_unblock_is_saved(tmp_path) -> None:
    path = tmp_path / "cache.json"
    write_cache(path, n=1, blocked=(3,))
    cache = TuningCache()
    cache.load(path, strict=True)
    persist.unblock(path, runner_id="m.B")  # `graphtune cache unblock`, from another process
    cache.clear_blocklist()  # this process retries the blocked tactics...
    again = BlockedTactic("m.B", 3, "crash: exit code -11 (again)", "gemm", "1x64")
    cache.block(again)  # ...and tactic 3 crashes again
    cache.save(path)
    assert list(persist.load_file(path).blocklist.values()) == [again]
    cache.save(path)  # nothing new: the file keeps it, memory does not write it twice
    assert cache.unsaved(path) == 0


def test_file_without_blocklist_keeps_its_layout(tmp_path) -> None:
    path = tmp_path / "cache.json"
    write_cache(path)
    assert "blocklist" not in json.loads(path.read_text())


# ---------------------------------------------------------------- CLI: verify, merge, unblock


def test_verify_ok_and_blocklist_summary(tmp_path, capsys) -> None:
    path = tmp_path / "cache.json"
    write_cache(path, blocked=(5,))
    assert main(["cache", "verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "3 entries, 1 blocked" in out and "crash: exit code 7" in out


def test_verify_lists_every_problem(tmp_path, capsys) -> None:
    path = tmp_path / "cache.json"
    write_cache(path, n=4)
    doc = json.loads(path.read_text())
    doc["fingerprint"]["torch"] = "0.1"
    doc["entries"][0]["value"]["runner_index"] = 5
    doc["entries"][1]["value"]["time_us"] = -1.0
    del doc["entries"][2]["value"]["tactic"]
    doc["entries"].append(doc["entries"][3])  # a usable key twice: the last copy is used
    doc["blocklist"] = [{"tactic": 1}]
    path.write_text(json.dumps(doc))
    assert main(["cache", "verify", str(path)]) == 1
    captured = capsys.readouterr()
    for text in (
        "torch: '0.1' (file)",
        "runner_index 5",
        "time_us is -1.0",
        "entry 2: malformed",
        "entry 3: the same key as entry 4",
        "blocklist item 0: malformed",
    ):
        assert text in captured.out, text
    assert captured.err.startswith("error:") and "problems (listed above)" in captured.err


def test_verify_counts_ignored_entries_not_their_problems(tmp_path, capsys) -> None:
    path = tmp_path / "cache.json"
    write_cache(path, n=2)
    doc = json.loads(path.read_text())
    doc["entries"][0]["value"].update(runner_index=5, time_us=-1.0)  # one entry, two problems
    path.write_text(json.dumps(doc))
    assert main(["cache", "verify", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out.count("ignored: entry 0") == 2
    assert "ignore the 1 entry listed above and use the other 1;" in captured.err


@pytest.mark.parametrize(
    "content, message",
    [(None, "does not exist"), ("{", "invalid JSON"), ('{"format_version": 0}', "format_version")],
)
def test_verify_unreadable_files(tmp_path, capsys, content, message) -> None:
    path = tmp_path / "cache.json"
    if content is not None:
        path.write_text(content)
    assert main(["cache", "verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert message in err and len([x for x in err.splitlines() if x.startswith("error:")]) == 1


def test_merge_rule_faster_wins_ties_keep_a_blocklists_union(tmp_path, capsys) -> None:
    a, b, c = (tmp_path / n for n in ("a.json", "b.json", "c.json"))
    ca, cb = TuningCache(), TuningCache()
    ca.put(key(1), entry("a1", 5.0))  # B faster -> B
    cb.put(key(1), entry("b1", 4.0))
    ca.put(key(2), entry("a2", 3.0))  # tie -> A
    cb.put(key(2), entry("b2", 3.0))
    ca.put(key(3), entry("a3", None, 0))  # A failed, B timed -> B
    cb.put(key(3), entry("b3", 9.0))
    ca.put(key(4), entry("a4", 1.0))  # only A
    cb.put(key(5), entry("b5", 1.0))  # only B
    ca.block(BlockedTactic("m.B", 1, "reason A"))
    cb.block(BlockedTactic("m.B", 1, "reason B"))
    cb.block(BlockedTactic("m.B", 2, "only B"))
    ca.save(a)
    cb.save(b)
    assert main(["cache", "merge", str(a), str(b), "-o", str(c)]) == 0
    assert "5 entries" in capsys.readouterr().out
    merged = persist.load_file(c, strict=True)
    tactics = {k.shapes[0][0]: e.tactic for k, e in merged.entries.items()}
    assert tactics == {1: "b1", 2: "a2", 3: "b3", 4: "a4", 5: "b5"}
    assert {b.tactic: b.reason for b in merged.blocklist.values()} == {1: "reason A", 2: "only B"}


def test_merge_into_a_holds_its_lock_so_a_save_meanwhile_is_kept(tmp_path, monkeypatch) -> None:
    import threading

    from graphtune.autotuner import cache_reader, maintenance

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    ca, cb, writer = TuningCache(), TuningCache(), TuningCache()
    ca.put(key(1), entry("a1", 1.0))
    cb.put(key(2), entry("b2", 1.0))
    writer.put(key(3), entry("w3", 1.0))
    ca.save(a)
    cb.save(b)
    read = cache_reader.read_document
    racers: list[threading.Thread] = []

    def read_then_race(path):
        doc = read(path)
        if path == a and not racers:  # another process saves to A right after the merge read it
            racers.append(threading.Thread(target=writer.save, args=(a,)))
            racers[0].start()
            time.sleep(0.3)  # without the lock its save lands here and the merge overwrites it
        return doc

    monkeypatch.setattr(cache_reader, "read_document", read_then_race)
    maintenance.merge_files(a, b, a)
    racers[0].join(timeout=30)
    merged = persist.load_file(a, strict=True).entries
    assert sorted(k.shapes[0][0] for k in merged) == [1, 2, 3]


def test_merge_refuses_other_environment_unless_forced(tmp_path, capsys) -> None:
    a, b, c = (tmp_path / n for n in ("a.json", "b.json", "c.json"))
    write_cache(a)
    write_cache(b, n=5)
    doc = json.loads(b.read_text())
    doc["fingerprint"]["gpu"] = "NVIDIA Z100"
    b.write_text(json.dumps(doc))
    assert main(["cache", "merge", str(a), str(b), "-o", str(c)]) == 1
    assert "different environments" in capsys.readouterr().err and not c.exists()
    assert main(["cache", "merge", str(a), str(b), "-o", str(c), "--force"]) == 0
    assert len(persist.load(c, strict=True)) == 5  # A's fingerprint, which matches here
    (tmp_path / "bad.json").write_text("{")
    assert main(["cache", "merge", str(a), str(tmp_path / "bad.json"), "-o", str(c)]) == 1
    assert "bad.json" in capsys.readouterr().err


def test_unblock_cli_and_show_lists_blocklist(tmp_path, capsys) -> None:
    path = tmp_path / "cache.json"
    write_cache(path, blocked=(1, [2, 3]))
    assert main(["cache", "show", str(path)]) == 0
    assert "2 blocked tactics" in capsys.readouterr().out
    assert main(["cache", "unblock", str(path), "--tactic", "[2, 3]"]) == 0
    assert "Removed 1" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # a usage error: the tactic is not JSON
        main(["cache", "unblock", str(path), "--tactic", "{oops"])
    assert exit_info.value.code == 2
    assert main(["cache", "unblock", str(path)]) == 0
    assert "Removed 1" in capsys.readouterr().out
    assert not persist.load_file(path).blocklist
    assert main(["cache", "unblock", str(tmp_path / "none.json")]) == 1
