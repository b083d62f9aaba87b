"""The blocklist matches a tactic by its canonical text: a dtype or device keeps its tag there,
so blocking ``torch.float16`` never blocks the string ``"torch.float16"``; plain JSON tactics keep
the text they always had, so the items of files saved before still block what they blocked."""

from __future__ import annotations

import json

import pytest
import torch
from test_faults_cache import write_cache

from graphtune.autotuner import TuningCache, persist
from graphtune.autotuner.entries import BlockedTactic, tactic_text
from graphtune.cli.main import main


def _blocking(tactic) -> TuningCache:
    cache = TuningCache()
    cache.block(BlockedTactic("m.R", tactic, "crash: exit code -11", "op", "1x8"))
    return cache


@pytest.mark.parametrize(
    "blocked, other",
    [
        (torch.float16, "torch.float16"),
        ("torch.float16", torch.float16),
        ({"acc": torch.float32}, {"acc": "torch.float32"}),
        ([torch.bfloat16, 2], ["torch.bfloat16", 2]),
        (torch.device("cpu"), "cpu"),
        # A dict whose one key is a tag is not the tagged value itself.
        ({"__dtype__": "float16"}, torch.float16),
        ({"__dict__": [[1, 2]]}, {1: 2}),
        ({"__tuple__": [1, 2]}, (1, 2)),
    ],
)
def test_a_typed_tactic_and_its_text_are_two_tactics(blocked, other) -> None:
    cache = _blocking(blocked)
    assert cache.blocked("m.R", blocked) is not None
    assert cache.blocked("m.R", other) is None
    assert tactic_text(blocked) != tactic_text(other)


# What tactic_text gave for plain JSON tactics before dtypes were tagged (the texts a user's
# `cache unblock --tactic` and a distributed run's ranks compare): unchanged. A one-key dict
# whose key is a tag (`{"__tuple__": [1]}`) is written as its pairs now, so `--tactic` reads it.
OLD_TEXTS = [
    (3, "3"),
    (-1, "-1"),
    ("a", '"a"'),
    (None, "null"),
    (True, "true"),
    (1.5, "1.5"),
    ((64, 2), "[64,2]"),
    ({"b": 1, "a": (2, 3)}, '{"a":[2,3],"b":1}'),
    ({1: 2, "1": 3}, '{"__dict__":[["1",3],[1,2]]}'),
    ({"x": {2: 1}}, '{"x":{"__dict__":[[2,1]]}}'),
]


@pytest.mark.parametrize("tactic, text", OLD_TEXTS)
def test_plain_json_tactics_keep_their_text(tactic, text) -> None:
    assert tactic_text(tactic) == text


def test_an_older_files_blocklist_still_blocks_its_tactics(tmp_path) -> None:
    # Items as a graphtune before this change wrote them (the file holds the typed encoding).
    path = tmp_path / "old.json"
    write_cache(path, n=1)
    doc = json.loads(path.read_text())
    stored = [3, {"__tuple__": [64, 2]}, {"block": 64}, {"__dict__": [[1, 2]]}]
    stored.append({"__dtype__": "float16"})
    doc["blocklist"] = [
        {"runner_id": "m.B", "tactic": t, "reason": "crash", "op": "gemm", "shapes": "1x64"}
        for t in stored
    ]
    path.write_text(json.dumps(doc, indent=1))
    cache = TuningCache()
    assert cache.load(path, strict=True) == 1
    for tactic in (3, (64, 2), [64, 2], {"block": 64}, {1: 2}, torch.float16):
        assert cache.blocked("m.B", tactic) is not None, tactic
    for tactic in (4, "3", {"1": 2}, "torch.float16"):
        assert cache.blocked("m.B", tactic) is None, tactic
    # A save and a reload keep them blocking.
    cache.save(path)
    again = persist.load_file(path).blocklist
    assert len(again) == 5 and ("m.B", '{"__dtype__":"float16"}') in again


def test_unblock_takes_a_dtype_tactic_as_cache_show_prints_it(tmp_path, capsys) -> None:
    path = tmp_path / "c.json"
    write_cache(path, n=1, blocked=(torch.float16, "torch.float16"))
    assert main(["cache", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert '{"__dtype__":"float16"}' in out and '"torch.float16"' in out
    assert main(["cache", "unblock", str(path), "--tactic", '{"__dtype__":"float16"}']) == 0
    assert "Removed 1 blocked tactic(s)" in capsys.readouterr().out
    assert [b.tactic for b in persist.load_file(path).blocklist.values()] == ["torch.float16"]
    assert main(["cache", "unblock", str(path), "--tactic", '{"__dtype__":"float99"}']) == 1
    err = capsys.readouterr().err
    assert "--tactic" in err and "unknown torch dtype" in err and err.count("\n") == 1


def test_unblock_takes_a_dict_with_a_tag_key_as_cache_show_prints_it(tmp_path, capsys) -> None:
    # Its text was {"__tuple__":[1,2]}, which --tactic decoded as the tuple (1, 2): removed 0.
    path = tmp_path / "c.json"
    write_cache(path, n=1, blocked=({"__tuple__": [1, 2]},))
    assert main(["cache", "show", str(path)]) == 0
    (text,) = [t for b, t in persist.load_file(path).blocklist]
    assert text in capsys.readouterr().out
    assert main(["cache", "unblock", str(path), "--tactic", text]) == 0
    assert "Removed 1 blocked tactic(s)" in capsys.readouterr().out
    assert not persist.load_file(path).blocklist
