"""``graphtune tune``: tunes a preset's ops into a cache file and reuses it on the next run."""

from __future__ import annotations

import json

from graphtune.cli.main import main


def test_tune_preset_writes_cache_and_second_run_reuses_it(tmp_path, capsys):
    cache = tmp_path / "tune.json"
    args = [
        "tune",
        "--model",
        "tiny",
        "--cache",
        str(cache),
        "--max-batch",
        "2",
        "--device",
        "cpu",
        "--ops",
        "rms_norm,silu_and_mul",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "graphtune.rms_norm" in out and "graphtune.silu_and_mul" in out
    assert "6 (op, bucket) picks" in out  # 2 norm variants + silu, buckets 1 and 2
    assert json.loads(cache.read_text())
    assert main(args) == 0
    assert "nothing to tune" in capsys.readouterr().out


def test_tune_rejects_unknown_model_and_ops(tmp_path, capsys):
    assert main(["tune", "--model", "no-such", "--cache", str(tmp_path / "c.json")]) == 2
    assert "preset" in capsys.readouterr().err
    assert (
        main(
            [
                "tune",
                "--model",
                "tiny",
                "--cache",
                str(tmp_path / "c.json"),
                "--device",
                "cpu",
                "--ops",
                "bogus",
            ]
        )
        == 2
    )
    assert "unknown op groups" in capsys.readouterr().err
