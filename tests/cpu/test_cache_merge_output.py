"""``graphtune cache merge A B -o C`` merges into an existing C that is neither A nor B, as a save
merges into its file: C's picks whose keys A and B lack are kept, never dropped silently."""

from __future__ import annotations

from graphtune.autotuner import CacheEntry, CacheKey, persist
from graphtune.autotuner.entries import BlockedTactic
from graphtune.autotuner.maintenance import merge_files
from graphtune.cli.main import main


def _key(op: str) -> CacheKey:
    return CacheKey(op, ("m.R",), ((4, 8),), ("float32",), "wallclock", device="cpu")


def _entry(tactic: int, time_us: float) -> CacheEntry:
    return CacheEntry("m.R", 0, tactic, time_us, 10.0)


def test_merge_keeps_the_picks_of_an_existing_output(tmp_path, capsys) -> None:
    a, b, c = (tmp_path / f"{name}.json" for name in "abc")
    persist.save(a, {_key("a_op"): _entry(1, 1.0), _key("shared"): _entry(1, 2.0)})
    persist.save(b, {_key("b_op"): _entry(2, 1.0)})
    blocked = BlockedTactic("m.R", 9, "crash: exit code -11", "c_op")
    persist.save(
        c,
        {_key("c_op"): _entry(3, 1.0), _key("shared"): _entry(3, 1.0)},
        blocklist={blocked.ident: blocked},
    )
    assert main(["cache", "merge", str(a), str(b), "-o", str(c)]) == 0
    assert f"1 kept from {c}" in capsys.readouterr().out
    merged = persist.load_file(c, strict=True)
    tactics = {key.op: entry.tactic for key, entry in merged.entries.items()}
    assert tactics == {"a_op": 1, "b_op": 2, "c_op": 3, "shared": 1}  # A's and B's win C's
    assert list(merged.blocklist) == [blocked.ident]
    assert sorted(p.name for p in tmp_path.iterdir() if "unusable" in p.name) == []


def test_merge_into_a_new_output_or_an_input_counts_nothing_kept(tmp_path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    persist.save(a, {_key("a_op"): _entry(1, 1.0)})
    persist.save(b, {_key("b_op"): _entry(2, 1.0)})
    assert merge_files(a, b, tmp_path / "new.json").kept_output == 0
    report = merge_files(a, b, a)
    assert report.kept_output == 0 and report.entries == 2
