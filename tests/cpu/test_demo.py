"""``graphtune demo`` tunes, prints the picks, saves and re-uses its cache."""

from __future__ import annotations

import pytest
import torch

from graphtune.autotuner import AutoTuner, TuningPolicy, persist
from graphtune.autotuner.timing import WallClockTimer
from graphtune.cli.demo_ops import ChunkedMatmul, EinsumMatmul, Softmax, TorchMatmul, demo
from graphtune.cli.main import main


@pytest.fixture(autouse=True)
def one_thread():
    # Keeps the demo's matmuls quick when other processes share the cores (no barrier stalls).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_demo_runners_agree_with_torch() -> None:
    a, b = torch.randn(40, 32), torch.randn(32, 24)
    expected = a @ b
    for tactic in ChunkedMatmul().get_valid_tactics([a, b], None) + [-1]:
        torch.testing.assert_close(ChunkedMatmul().forward([a, b], tactic), expected)
    torch.testing.assert_close(EinsumMatmul().forward([a, b]), expected)
    torch.testing.assert_close(TorchMatmul().forward([a, b]), expected)
    x = torch.randn(5, 7)
    for tactic in Softmax().get_valid_tactics([x], None):
        torch.testing.assert_close(Softmax().forward([x], tactic), torch.softmax(x, -1))


def test_demo_function_with_a_quick_timer() -> None:
    quick = WallClockTimer(samples=1)
    tuner = AutoTuner(
        timer=quick, show_progress=False, policy=TuningPolicy(rounds=1, remeasure_top=0)
    )
    text = demo(tuner, torch.device("cpu"))
    assert "matmul" in text and "softmax" in text and "speed-up" in text
    assert tuner.stats.profiles_tuned == 8 and tuner.stats.fallbacks == {}
    assert tuner.stats.hits == 10  # five serving steps, two ops each, all from the cache


def test_demo_tunes_under_cache_only_and_counts_serving_alone(tmp_path, monkeypatch) -> None:
    # GRAPHTUNE_CACHE_ONLY is for serving; the demo tunes and saves all the same, and its
    # serving line counts only the five serving steps (no tuning-phase misses).
    monkeypatch.setenv("GRAPHTUNE_CACHE_ONLY", "1")
    tuner = AutoTuner(
        timer=WallClockTimer(samples=1), show_progress=False, policy=TuningPolicy(rounds=1)
    )
    path = tmp_path / "demo.json"
    text = demo(tuner, torch.device("cpu"), cache_path=path)
    assert "serving: 10 cache hits, 0 misses, 0 fallbacks" in text
    assert f"picks saved to {path}" in text and "came from" not in text
    assert len(persist.load(path, strict=True)) == 8


def test_demo_cli_saves_then_reuses_cache(tmp_path, capsys, monkeypatch) -> None:
    import graphtune.autotuner

    # The CLI path as is, with a one-sample timer so the test stays fast on a busy machine.
    monkeypatch.setattr(
        graphtune.autotuner,
        "AutoTuner",
        lambda **kw: AutoTuner(timer=WallClockTimer(samples=1), policy=TuningPolicy(rounds=1)),
    )
    path = tmp_path / "demo.json"
    assert main(["demo", "--cache", str(path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "graphtune autotuning picks" in out and "TorchMatmul" in out
    assert len(persist.load(path, strict=True)) == 8
    assert main(["demo", "--cache", str(path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "Every pick came from" in out and "picks saved" not in out


def test_demo_checks_the_graphtune_cache_file(tmp_path, capsys, monkeypatch) -> None:
    # The default cache (GRAPHTUNE_CACHE) gets --cache's checks: a folder there is refused, not
    # renamed away and replaced by a cache file.
    folder = tmp_path / "folder"
    folder.mkdir()
    monkeypatch.setenv("GRAPHTUNE_CACHE", str(folder))
    assert main(["demo", "--device", "cpu"]) == 1
    assert "GRAPHTUNE_CACHE (the default of --cache): " in capsys.readouterr().err
    assert folder.is_dir() and [p.name for p in tmp_path.iterdir()] == ["folder"]


@pytest.fixture
def interrupted_demo(monkeypatch):
    """The CLI's demo with a one-sample timer and Ctrl-C arriving as softmax tunes: matmul's
    four bucket picks are finished by then."""
    import graphtune.autotuner

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(
        graphtune.autotuner,
        "AutoTuner",
        lambda **kw: AutoTuner(timer=WallClockTimer(samples=1), policy=TuningPolicy(rounds=1)),
    )
    monkeypatch.setattr(Softmax, "forward", ctrl_c)


def test_demo_ctrl_c_says_how_many_picks_the_cache_file_kept(tmp_path, capsys, interrupted_demo):
    path = tmp_path / "demo.json"
    assert main(["demo", "--cache", str(path), "--device", "cpu"]) == 130
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"error: interrupted (Ctrl-C); 4 finished picks kept in {path}"
    assert len(persist.load(path, strict=True)) == 4  # what the message claims is on disk


def test_demo_ctrl_c_counts_only_this_runs_picks_not_those_the_file_held(
    tmp_path, capsys, interrupted_demo
):
    path = tmp_path / "demo.json"
    assert main(["demo", "--cache", str(path), "--device", "cpu"]) == 130  # 4 picks saved
    capsys.readouterr()
    # The second run finds matmul's picks in the file and is interrupted before making any.
    assert main(["demo", "--cache", str(path), "--device", "cpu"]) == 130
    (line,) = capsys.readouterr().err.splitlines()
    assert line == "error: interrupted (Ctrl-C); nothing was tuned yet"
    assert len(persist.load(path, strict=True)) == 4


def test_demo_ctrl_c_without_a_cache_file_claims_nothing_kept(
    capsys, monkeypatch, interrupted_demo
):
    monkeypatch.delenv("GRAPHTUNE_CACHE", raising=False)
    assert main(["demo", "--device", "cpu"]) == 130
    (line,) = capsys.readouterr().err.splitlines()
    assert "4 finished picks not kept: no --cache file" in line and "kept in" not in line
