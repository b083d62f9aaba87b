"""``graphtune tune``: tunes a preset's step into a cache file and reuses it on the next run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_timers import EveryCandidateEqual

import graphtune.autotuner
from graphtune.cli.main import main


def test_tune_preset_writes_cache_and_second_run_reuses_it(tmp_path, capsys, monkeypatch):
    made = []
    real = graphtune.autotuner.AutoTuner
    monkeypatch.setattr(
        graphtune.autotuner,
        "AutoTuner",
        lambda timer=None: (
            made.append(real(timer=EveryCandidateEqual(), show_progress=False)) or made[-1]
        ),
    )
    cache = tmp_path / "tune.json"
    args = ["tune", "--model", "tiny", "--cache", str(cache), "--max-batch", "2", "--device", "cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for op in (
        "graphtune.gemm",
        "graphtune.rms_norm",
        "graphtune.silu_and_mul",
        "decode_attention",
    ):
        assert op in out
    # What the step runs: 4 GEMM keys, the norm, rope, silu and attention, then the 5 fused
    # stages (QKV, O-projection, MLP, down, LM head); buckets 1 and 2.
    assert "26 (op, bucket) picks" in out
    assert "running the step at batch 2" in out
    # Prepared (inputs, tactic) pairs of every runner, not only Triton ones.
    assert "s recording the step and preparing " in out and "Triton tactics" not in out
    assert json.loads(cache.read_text())
    assert main(args) == 0
    assert "nothing to tune" in capsys.readouterr().out
    assert made[-1].stats.profiles_tuned == 0


def test_tune_tunes_and_saves_under_graphtune_cache_only(tmp_path, capsys, monkeypatch):
    # GRAPHTUNE_CACHE_ONLY makes serving's autotune() blocks look-ups only; `tune` still tunes.
    real = graphtune.autotuner.AutoTuner
    monkeypatch.setattr(
        graphtune.autotuner,
        "AutoTuner",
        lambda timer=None: real(timer=EveryCandidateEqual(), show_progress=False),
    )
    monkeypatch.setenv("GRAPHTUNE_CACHE_ONLY", "1")
    cache = tmp_path / "tune.json"
    args = ["tune", "--model", "tiny", "--cache", str(cache), "--max-batch", "1", "--device", "cpu"]
    assert main(args) == 0
    assert "picks added to" in capsys.readouterr().out
    assert json.loads(cache.read_text())["entries"]


def test_tune_rejects_unknown_model_and_bad_sizes(tmp_path, capsys):
    # A failure (the model does not exist): exit 1 and one error line.
    assert main(["tune", "--model", "no-such", "--cache", str(tmp_path / "c.json")]) == 1
    assert "not a preset" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists() and not (tmp_path / "c.json.lock").exists()
    # Usage errors (argparse): exit 2.
    args = ["tune", "--model", "tiny", "--cache", str(tmp_path / "c.json"), "--device", "cpu"]
    for bad, flag in ((["--max-batch", "0"], "--max-batch"), (["--dtype", "float12"], "--dtype")):
        with pytest.raises(SystemExit) as exit_info:
            main([*args, *bad])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.startswith(f"error: argument {flag}")


def _recorded_misses(tmp_path):
    """A serving process's misses file (one SiLU-and-mul call of 3 rows) and a cache path."""
    import torch

    from graphtune.autotuner import AutoTuner, autotune
    from graphtune.ops import silu_and_mul

    misses, cache = tmp_path / "misses.json", tmp_path / "c.json"
    serving = AutoTuner(show_progress=False)
    with autotune(None, serving, tune=False, misses_path=misses):
        silu_and_mul(torch.randn(3, 16), tuner=serving, max_m=4)
    return misses, cache


def test_tune_from_misses_runs_through_the_tune_command(tmp_path, capsys):
    misses, cache = _recorded_misses(tmp_path)
    args = ["tune", "--from-misses", str(misses), "--cache", str(cache), "--timing", "wallclock"]
    assert main(args) == 0  # no --model needed
    assert "1 of 1 recorded calls tuned" in capsys.readouterr().out
    (entry,) = json.loads(cache.read_text())["entries"]
    assert entry["key"]["op"] == "graphtune.silu_and_mul" and entry["key"]["shapes"][0][0] == 2
    assert main(["tune", "--cache", str(cache)]) == 1  # neither --model nor --from-misses
    assert "--model" in capsys.readouterr().err
    before = cache.read_text()
    # Options of a model's step would be ignored: refused when given, even at their defaults.
    for extra in (
        ["--model", "tiny"],
        ["--max-batch", "8"],
        ["--dtype", "float32"],
        ["--max-batch", "64"],
        ["--max-seq-len", "2048"],
        ["--dtype", "auto"],
    ):
        assert main([*args, *extra]) == 1
        named = "--model" if extra[0] == "--model" else " ".join(extra)  # a path says little
        assert f"{named} (options of a model's step) has no use with it" in capsys.readouterr().err
    assert main([*args, "--max-batch", "64", "--max-seq-len", "2048", "--dtype", "auto"]) == 1
    err = capsys.readouterr().err
    assert "--max-batch 64, --max-seq-len 2048, --dtype auto (options" in err
    assert cache.read_text() == before  # refused before any tuning


def test_tune_from_misses_counts_cached_records_apart_from_tuned_ones(tmp_path, capsys):
    import torch

    from graphtune.autotuner import AutoTuner, autotune
    from graphtune.ops import silu_and_mul

    misses, cache = tmp_path / "misses.json", tmp_path / "c.json"
    serving = AutoTuner(show_progress=False)
    with autotune(None, serving, tune=False, misses_path=misses):
        for rows in (3, 1):  # two buckets, two records
            silu_and_mul(torch.randn(rows, 16), tuner=serving, max_m=4)
    data = json.loads(misses.read_text())
    assert len(data["misses"]) == 2
    first = tmp_path / "first.json"
    first.write_text(json.dumps({**data, "misses": data["misses"][:1]}))
    tune = ["tune", "--cache", str(cache), "--timing", "wallclock", "--from-misses"]
    assert main([*tune, str(first)]) == 0
    assert "1 of 1 recorded calls tuned into" in capsys.readouterr().out
    # One record's pick is in the cache file now, the other's is not.
    assert main([*tune, str(misses)]) == 0
    out = capsys.readouterr().out
    assert f"1 of 2 recorded calls already in {cache}; 1 tuned" in out and "tuned into" not in out
    assert len(json.loads(cache.read_text())["entries"]) == 2
    assert main([*tune, str(misses)]) == 0
    out = capsys.readouterr().out
    assert "every recorded shape was already in the cache file; nothing to tune" in out
    assert f"2 of 2 recorded calls already in {cache}; 0 tuned" in out and "tuned into" not in out


def test_tune_from_misses_does_not_call_skipped_records_cached(tmp_path, capsys):
    misses, cache = _recorded_misses(tmp_path)
    data = json.loads(misses.read_text())
    data["misses"][0]["op"] = "no.such.op"
    misses.write_text(json.dumps(data))
    args = ["tune", "--from-misses", str(misses), "--cache", str(cache), "--timing", "wallclock"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "already in the cache" not in out
    assert "no pick was tuned: all 1 recorded calls were skipped" in out


def test_tune_from_misses_reads_records_saved_before_keys_named_the_device(tmp_path, capsys):
    misses, cache = _recorded_misses(tmp_path)
    data = json.loads(misses.read_text())
    for record in data["misses"]:
        del record["key"]["device"]  # as a misses file written before session 54
    misses.write_text(json.dumps(data))
    args = ["tune", "--from-misses", str(misses), "--cache", str(cache), "--timing", "wallclock"]
    assert main(args) == 0
    assert "1 of 1 recorded calls tuned" in capsys.readouterr().out
    (entry,) = json.loads(cache.read_text())["entries"]
    assert entry["key"]["device"] == "cpu"


# In a fresh process without the TRITON_INTERPRET other test modules set: interpreted Triton
# tactics would be candidates (and take minutes to time) on the CPU.
_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
_ENV.update(PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"), GRAPHTUNE_NO_PROGRESS="1")
#: ``graphtune`` with decode attention, too, reduced to its torch runner (argv[1] == "1"): a
#: device where every op has one candidate.
_TUNE = """
import sys
import graphtune.ops.attention as attention
if sys.argv.pop(1) == "1":
    attention.RUNNERS = attention.RUNNERS[:1]
from graphtune.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _tune(tmp_path, lone: bool, max_batch: int) -> str:
    args = ["tune", "--model", "tiny", "--cache", str(tmp_path / "c.json"), "--device", "cpu"]
    done = subprocess.run(
        [sys.executable, "-c", _TUNE, "1" if lone else "0", *args, "--max-batch", str(max_batch)],
        capture_output=True,
        text=True,
        env=_ENV,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_tune_says_when_every_op_has_a_single_candidate(tmp_path):
    out = _tune(tmp_path, lone=True, max_batch=4)
    assert "nothing to tune on cpu: every op of the step has a single candidate" in out
    # Single ops and fused stages at buckets 1, 2 and 4.
    assert "39 (op, bucket) picks were taken without timing" in out
    # Saved all the same, so the engine's look-ups find a pick.
    assert len(json.loads((tmp_path / "c.json").read_text())["entries"]) == 39


def test_tune_counts_the_picks_taken_without_timing(tmp_path):
    # On a CPU only decode attention has two runners (SDPA and the matmul one).
    assert "24 of 26 picks had a single candidate on cpu" in _tune(
        tmp_path, lone=False, max_batch=2
    )
