"""Cache keys, the cache file round trip, and every way a cache file can be unusable."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from graphtune.autotuner import (
    AutoTuner,
    CacheEntry,
    CacheKey,
    DynamicTensorSpec,
    TunableRunner,
    TuningCache,
    TuningConfig,
    persist,
)
from graphtune.autotuner.fingerprint import environment_fingerprint
from graphtune.autotuner.identity import runner_id
from graphtune.autotuner.profiles import profile_for
from graphtune.errors import CacheFileError


class R(TunableRunner):
    def __init__(self, extras: tuple = ()) -> None:
        self.extras = extras

    def forward(self, inputs, tactic=-1):
        return inputs[0]

    def cache_key_extras(self) -> tuple:
        return self.extras


def key(op: str = "gemm", m: int = 16, **kw) -> CacheKey:
    fields = {
        "runners": ("mod.A", "mod.B"),
        "shapes": ((m, 64), (64, 32), None),
        "dtypes": ("bfloat16", "bfloat16", "int"),
        "timing": "graph",
        "device": "cuda",
    }
    fields.update(kw)
    return CacheKey(op=op, **fields)


ENTRY = CacheEntry("mod.B", 1, {"block": [64, 32], "stages": 3}, 7.5, 15.0)


def test_runner_identity_includes_extras() -> None:
    assert runner_id(R()) == f"{__name__}.R"
    assert runner_id(R((1, "nt"))) == f'{__name__}.R[1,"nt"]'
    assert runner_id(R(({"b": 1, "a": 2},))) == runner_id(R(({"a": 2, "b": 1},)))


def test_cache_key_separates_what_matters() -> None:
    spec = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0),), max_value=64)
    bf16 = profile_for(spec, [torch.randn(20, 8, dtype=torch.bfloat16)])
    f32 = profile_for(spec, [torch.randn(17, 8)])
    assert bf16.shapes == f32.shapes == ((16, 8),)  # 20 and 17 share a bucket
    assert bf16.dtypes != f32.dtypes
    assert profile_for(spec, [torch.randn(1000, 8)]).shapes == ((64, 8),)  # capped by max_value
    keys = {key(), key(timing="events"), key(op="other"), key(m=32), key(runners=("mod.A",))}
    assert len(keys) == 5 and key() == key()
    assert CacheKey.from_json(json.loads(json.dumps(key().to_json()))) == key()


def test_save_load_round_trip(tmp_path) -> None:
    path = tmp_path / "sub" / "cache.json"
    cache = TuningCache()
    cache.put(key(), ENTRY)
    cache.put(key(m=1), CacheEntry("mod.A", 0, -1, None, None))
    assert cache.save(path) == 2
    doc = json.loads(path.read_text())
    assert doc["format_version"] == persist.FORMAT_VERSION
    assert doc["fingerprint"] == environment_fingerprint()
    assert set(doc["fingerprint"]) >= {"gpu", "compute_capability", "torch", "cuda", "triton"}
    loaded = TuningCache()
    assert loaded.load(path) == 2
    assert loaded.get(key()) == ENTRY and loaded.get(key(m=1)).time_us is None
    assert ENTRY.speedup == pytest.approx(2.0)
    assert not list(tmp_path.glob("sub/.cache.json.*.tmp"))  # no temp file left behind


def test_saved_cache_file_is_readable_as_the_umask_allows(tmp_path) -> None:
    import os

    path = tmp_path / "cache.json"
    cache = TuningCache()
    cache.put(key(), ENTRY)
    old = os.umask(0o022)
    try:
        cache.save(path)
    finally:
        os.umask(old)
    # As any new file of the user's: the umask decides, not a fixed private mode.
    assert path.stat().st_mode & 0o777 == 0o644


def test_save_merges_with_file_and_memory_wins(tmp_path) -> None:
    path = tmp_path / "cache.json"
    first = TuningCache()
    first.put(key(m=1), ENTRY)
    first.put(key(m=2), ENTRY)
    first.save(path)
    second = TuningCache()
    newer = CacheEntry("mod.A", 0, 3, 5.0, 15.0)
    second.put(key(m=2), newer)
    second.put(key(m=4), ENTRY)
    assert second.save(path) == 3
    merged = persist.load(path)
    assert merged[key(m=1)] == ENTRY and merged[key(m=2)] == newer


def test_a_save_does_not_revert_what_another_process_changed_in_the_file(tmp_path) -> None:
    from graphtune.autotuner.entries import BlockedTactic

    path = tmp_path / "cache.json"
    seed = TuningCache()
    seed.put(key(m=1), ENTRY)
    seed.block(BlockedTactic("mod.A", 3, "timeout"))
    seed.save(path)
    long_lived = TuningCache()
    long_lived.load(path)
    # Meanwhile another process re-tunes m=1 and unblocks tactic 3 in the file.
    other = TuningCache()
    retuned = CacheEntry("mod.A", 0, 7, 1.0, 15.0)
    other.put(key(m=1), retuned)
    other.save(path)
    persist.unblock(path)
    long_lived.put(key(m=2), ENTRY)  # what the long-lived process tuned itself
    long_lived.save(path)
    after = persist.load_file(path)
    assert after.entries == {key(m=1): retuned, key(m=2): ENTRY} and not after.blocklist


def test_load_keeps_entries_already_in_memory(tmp_path) -> None:
    path = tmp_path / "cache.json"
    on_disk = TuningCache()
    on_disk.put(key(), ENTRY)
    on_disk.save(path)
    cache = TuningCache()
    mine = CacheEntry("mod.A", 0, 0, 1.0, 15.0)
    cache.put(key(), mine)
    assert cache.load(path) == 0 and cache.get(key()) == mine


def _write(path, **overrides) -> None:
    doc = {
        "format_version": persist.FORMAT_VERSION,
        "fingerprint": environment_fingerprint(),
        "entries": [{"key": key().to_json(), "value": ENTRY.to_json()}],
    }
    doc.update(overrides)
    path.write_text(json.dumps(doc))


BAD_FILES = {
    "other environment": (
        lambda p: _write(p, fingerprint={**environment_fingerprint(), "gpu": "NVIDIA Z100"}),
        "another environment",
    ),
    "wrong version": (lambda p: _write(p, format_version=99), "format_version 99"),
    "truncated": (lambda p: p.write_text('{"format_version": 1, "entries": [{"ke'), "corrupt"),
    "malformed entry": (lambda p: _write(p, entries=[{"key": {"op": "x"}}]), "corrupt"),
    "not a cache": (lambda p: p.write_text("[1, 2]"), "not a graphtune cache"),
    "binary junk": (lambda p: p.write_bytes(b"\x00\xff\x00garbage"), "corrupt"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_unusable_file_is_skipped_with_one_warning(tmp_path, caplog, case: str) -> None:
    make_file, reason = BAD_FILES[case]
    path = tmp_path / "cache.json"
    make_file(path)
    cache = TuningCache()
    with caplog.at_level(logging.WARNING, logger="graphtune"):
        assert cache.load(path) == 0
    assert len(cache) == 0
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    message = record.getMessage()
    assert (
        str(path) in message
        and reason in message
        and f"the next tuning run with this cache moves it aside to {path}.unusable" in message
    )
    with pytest.raises(CacheFileError, match=reason):
        cache.load(path, strict=True)


def test_strict_mode_from_environment(tmp_path, monkeypatch) -> None:
    path = tmp_path / "cache.json"
    path.write_text("{")
    monkeypatch.setenv("GRAPHTUNE_STRICT_CACHE", "1")
    with pytest.raises(CacheFileError, match="corrupt"):
        TuningCache().load(path)
    assert TuningCache().load(path, strict=False) == 0


def test_missing_file_is_a_quiet_first_run(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        assert TuningCache().load(tmp_path / "nope.json", strict=True) == 0
    assert not caplog.records


def test_save_moves_an_unusable_cache_aside_with_warning(tmp_path, caplog) -> None:
    path = tmp_path / "cache.json"
    _write(path, fingerprint={**environment_fingerprint(), "torch": "0.1"})
    cache = TuningCache()
    cache.put(key(m=8), ENTRY)
    with caplog.at_level(logging.WARNING):
        assert cache.save(path) == 1
    assert any("cache.json.unusable" in r.getMessage() for r in caplog.records)
    assert list(persist.load(path)) == [key(m=8)]
    assert (tmp_path / "cache.json.unusable").exists()


def test_save_errors_are_cache_file_errors(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = TuningCache()
    cache.put(key(), ENTRY)
    with pytest.raises(CacheFileError, match="Could not"):
        cache.save(blocker / "cache.json")  # parent is a file
    cache.put(key(m=3), CacheEntry("mod.A", 0, object(), 1.0, 2.0))
    with pytest.raises(CacheFileError, match=r"left out 1 .*\(tactic "):
        cache.save(tmp_path / "cache.json")
    assert list(persist.load(tmp_path / "cache.json")) == [key()]  # the storable one is saved
    # A NaN time is named as the field at fault, not blamed on the (storable) tactic.
    cache = TuningCache()
    cache.put(key(m=5), CacheEntry("mod.A", 0, 3, math.nan, 2.0))
    with pytest.raises(CacheFileError, match=r"left out 1 .*time_us is nan") as caught:
        cache.save(tmp_path / "nan.json")
    assert "(tactic" not in str(caught.value)


def test_serving_process_survives_corrupt_file_via_autotune(tmp_path) -> None:
    from graphtune.autotuner import autotune

    path = tmp_path / "cache.json"
    path.write_text("not json")
    tuner = AutoTuner(show_progress=False)
    with autotune(cache_path=path, tuner=tuner):
        pass
    # Nothing was tuned, so nothing is written: the file stays as it was for someone to look
    # at (a save with entries replaces it, with a warning).
    assert path.read_text() == "not json"
