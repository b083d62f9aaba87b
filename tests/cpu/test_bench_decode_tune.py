"""``graphtune bench decode --tune`` on the CPU: the tuned step reported beside the untuned one,
the tuning cache it uses and records (saved under ``GRAPHTUNE_CACHE_ONLY=1`` too), no GPU-busy
time read with ``--tp`` above 1, and what finished kept when tuning fails.

The Triton kernels run under Triton's CPU interpreter (set before anything imports Triton), and
a fake timer makes the last candidate of every profile the fastest (as in test_engine_tune.py).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # see test_ops_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fake_timers import last_wins_tuner  # noqa: E402

from graphtune.autotuner import AutoTuner  # noqa: E402


def _tuner() -> AutoTuner:
    return last_wins_tuner()


def test_bench_decode_tune_reports_tuned_beside_untuned(tmp_path, capsys, monkeypatch):
    import json

    import graphtune.autotuner
    from graphtune.cli.main import main

    # The CLI builds a default AutoTuner; make it the fake-timer one (the real wall-clock timer
    # would time Triton's CPU interpreter here, minutes instead of a second).
    made = []
    monkeypatch.setattr(graphtune.autotuner, "AutoTuner", lambda: made.append(_tuner()) or made[-1])
    cache, out_json = tmp_path / "tc.json", tmp_path / "d.json"
    args = "bench decode --model tiny --batch-sizes 1,2 --context 8 --steps 1 --repeats 1".split()
    args += ["--device", "cpu", "--tune", "--tuning-cache", str(cache), "--json", str(out_json)]
    assert main(args) == 0
    captured = capsys.readouterr()
    # 8 single ops and 5 fused stages, 2 buckets (as test_engine_tune.py's first test tunes).
    assert "tuning: 26 (op, bucket) profiles tuned" in captured.out
    assert "tuning: 26 (op, bucket) profiles tuned" in captured.err
    data = json.loads(out_json.read_text())
    assert data["tuning_profiles"] == 26 and data["tuning_fallbacks"] == {}
    for r in data["results"]:
        assert r["eager_ms"] > 0 and r["tuned_eager_ms"] > 0 and r["tuned_over_untuned"] > 0
        assert r["tuned_max_abs_diff"] < 1e-5 and r["graph_ms"] is None
    assert data["tuning_seconds"] >= 0
    assert data["tuning_cold_l2"] is False  # auto: tiny's weights fit in the CPU's cache
    assert cache.is_file()
    # Cold L2 is part of the key: the GEMMs and fused stages (9 of them x 2 buckets) are tuned
    # again under their cold-L2 keys; the file answers the other 8 profiles.
    assert main([*args, "--tune-l2", "cold"]) == 0
    assert "tuning: 18 (op, bucket) profiles tuned" in capsys.readouterr().err
    assert made[-1].stats.profiles_tuned + made[-1].stats.untimed_picks == 18
    timings = {e["key"]["timing"] for e in json.loads(cache.read_text())["entries"]}
    assert timings == {"fake", "fake+cold_l2"}
    data = json.loads(out_json.read_text())
    assert data["tuning_cold_l2"] is True and data["tuning_refinements"] is None
    # --refine-in-step times the whole step on the GPU: off CUDA it is refused, not ignored.
    assert main([*args, "--refine-in-step"]) == 1
    assert "--refine-in-step times the whole step on the GPU" in capsys.readouterr().err
    assert main([*args[: args.index("--tune")], "--compare-compile"]) == 1
    assert "--compare-compile captures CUDA graphs" in capsys.readouterr().err


def test_bench_decode_tune_uses_checks_and_records_graphtune_cache(tmp_path, capsys, monkeypatch):
    import json

    import graphtune.autotuner
    from graphtune.cli.main import main

    monkeypatch.setattr(graphtune.autotuner, "AutoTuner", _tuner)
    args = "bench decode --model tiny --batch-sizes 1 --context 4 --steps 1 --repeats 1".split()
    args += ["--device", "cpu", "--tune", "--json", str(tmp_path / "d.json")]
    # A folder where GRAPHTUNE_CACHE points is refused before the run, not renamed away.
    folder = tmp_path / "folder"
    folder.mkdir()
    monkeypatch.setenv("GRAPHTUNE_CACHE", str(folder))
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "GRAPHTUNE_CACHE (the default of --tuning-cache)" in err and "batch 1" not in err
    assert folder.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["folder"]
    # A usable file is the run's cache, and the JSON says so.
    cache = tmp_path / "env.json"
    monkeypatch.setenv("GRAPHTUNE_CACHE", str(cache))
    assert main(args) == 0
    assert json.loads((tmp_path / "d.json").read_text())["config"]["tuning_cache"] == str(cache)
    assert cache.is_file()


def test_bench_decode_tune_saves_its_cache_under_graphtune_cache_only(
    tmp_path, capsys, monkeypatch
):
    import graphtune.autotuner
    from graphtune.cli.main import main

    # GRAPHTUNE_CACHE_ONLY is meant for serving: --tune still tunes and saves what it tuned.
    monkeypatch.setattr(graphtune.autotuner, "AutoTuner", _tuner)
    monkeypatch.setenv("GRAPHTUNE_CACHE_ONLY", "1")
    cache = tmp_path / "bt.json"
    args = "bench decode --model tiny --batch-sizes 1 --context 8 --steps 1 --repeats 1".split()
    args += ["--device", "cpu", "--tune", "--tuning-cache", str(cache)]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "tuning: 13 (op, bucket) profiles tuned" in err and "Traceback" not in err
    assert cache.is_file()


def test_bench_decode_reads_no_busy_time_of_tuned_steps_with_tp_above_1(monkeypatch):
    """With --tp 2, NCCL kernels' durations include waiting, so no step's GPU-busy time is read:
    not the untuned step's, and not the tuned or tuned-unfused step's either."""
    import contextlib
    from types import SimpleNamespace

    from graphtune.bench import decode
    from graphtune.bench.decode_results import BatchResult, DecodeBenchConfig, DecodeBenchReport

    class FakeStep(SimpleNamespace):
        def __call__(self, tokens, positions, rows):
            return tokens

    busy_calls: list[object] = []
    nothing = (None, None, [], {})
    monkeypatch.setattr(decode, "_busy", lambda fn, eager_ms=None: busy_calls.append(fn) or nothing)
    monkeypatch.setattr(decode, "timed_ms", lambda *a: 1.0)
    monkeypatch.setattr(decode, "rank_agreement", lambda tuner, parallel: 1.0)
    monkeypatch.setattr(decode.autotuner, "autotune", lambda *a, **kw: contextlib.nullcontext())
    fake_step = FakeStep(
        model=None, cache=None, parallel=object(), tuner=None, ops=SimpleNamespace(gemm_cold_l2=0)
    )
    monkeypatch.setattr(decode, "build_step", lambda *a, **kw: fake_step)
    tuned_report = SimpleNamespace(
        seconds=0.0,
        compile_seconds=0.0,
        compile_seconds_by_op={},
        profiles_tuned=0,
        rows=[],
        fusion_checks=[],
        refinements=[],
        summary=lambda: "",
    )
    monkeypatch.setattr(decode, "tune_step", lambda *a, **kw: tuned_report)
    cfg = DecodeBenchConfig(batch_sizes=(1,), tune=True, tp=2, compare_unfused=True)
    run = decode._Run(
        step=fake_step,
        inputs=[(torch.ones(1), torch.zeros(1), torch.zeros(1))],
        results=[BatchResult(1)],
        device=torch.device("cuda"),  # only its type is read here
        cfg=cfg,
        runners=("eager",),
        report=DecodeBenchReport(config={}, model={}, provenance={}),
        log=lambda line: None,
        bar=SimpleNamespace(done=lambda: None),
    )
    decode._time_tuned(run, SimpleNamespace(stats=SimpleNamespace(fallbacks={})))
    assert busy_calls == []
    assert run.results[0].tuned_busy_ms is None and run.results[0].tuned_unfused_ms == 1.0


@pytest.mark.parametrize(
    "error", [torch.OutOfMemoryError("out of memory (fake)"), KeyError("bug")], ids=["oom", "bug"]
)
def test_a_failure_while_tuning_keeps_the_finished_measurements(
    tmp_path, capsys, monkeypatch, error
):
    import json

    import graphtune.bench.decode as decode
    from graphtune.cli.main import main

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(decode, "tune_step", fail)
    out_json = tmp_path / "d.json"
    args = "bench decode --model tiny --batch-sizes 1,2 --context 8 --steps 1 --repeats 1".split()
    args += ["--device", "cpu", "--tune", "--json", str(out_json)]
    if isinstance(error, torch.OutOfMemoryError):
        assert main(args) == 1
    else:  # a bug still reaches the user with its traceback
        with pytest.raises(KeyError):
            main(args)
    captured = capsys.readouterr()
    assert "eager ms" in captured.out  # the table of what finished
    data = json.loads(out_json.read_text())
    assert [r["eager_ms"] > 0 for r in data["results"]] == [True, True]
    assert any("tuning the step" in note for note in data["notes"])  # the phase that failed
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    if isinstance(error, torch.OutOfMemoryError):
        (line,) = errors
        assert "--context" in line and "--max-seq-len" not in line  # bench decode's own flag
    else:
        assert errors == []
