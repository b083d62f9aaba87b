"""benchmarks/tuning_time.py: its two phases (the child processes) on the CPU with the tiny model.

The children run as the script runs them, in fresh processes (without ``TRITON_INTERPRET``, so
on the CPU the ops offer their torch paths and nothing slow is interpreted).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tuning_time():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import tuning_time
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return tuning_time


def _phase(phase: str, folder: Path, monkeypatch, *extra: str) -> dict:
    """One phase through the script's own ``run_phase`` (the environment it gives the child)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    tuning_time = _tuning_time()
    argv = ["--model", "tiny", "--max-batch", "2", "--max-seq-len", "32", "--device", "cpu"]
    args = tuning_time.parse_args(argv + list(extra))
    (folder / "triton").mkdir(exist_ok=True)
    return tuning_time.run_phase(
        phase, args, folder / "triton", folder / "bytecode", folder / "cache.json"
    )


def test_cold_then_warm_phase_on_the_tiny_model(tmp_path, monkeypatch) -> None:
    cold = _phase("cold", tmp_path, monkeypatch)
    assert cold["op_calls"] > 0 and cold["profiles_tuned"] + cold["untimed_picks"] > 0
    assert cold["fallbacks"] == {} and (tmp_path / "cache.json").exists()
    # The phase's bytecode goes to the run's folder, which the next phase (and, with
    # --cold-bytecode installed, the cold phase after a first run) starts from.
    assert any((tmp_path / "bytecode").rglob("*.pyc"))
    assert set(cold["phase_seconds"]) <= {"inputs", "tactics", "prepare", "measure", "select"}
    # Per op: the tuned profiles add up to the history's, and each row is filled in.
    rows = cold["by_op"].values()
    assert rows and sum(row["candidates"] for row in rows) == cold["candidates"]
    assert all(row["profiles"] >= 1 and row["seconds"] >= 0.0 for row in rows)
    # The candidates table: every profile's candidates, the winner's row among them.
    table = cold["candidates_table"]
    assert sum(len(p["rows"]) for p in table) == cold["candidates"]
    assert all(0 <= p["winner"] < len(p["rows"]) for p in table)
    assert all(isinstance(row[0], str) and row[3] >= 0 for p in table for row in p["rows"])
    by_runner = cold["compile_by_runner"].values()
    assert sum(row["binaries"] for row in by_runner) == cold["compiled_binaries"]
    assert cold["compile_workers"] is None  # the CPU compiles nothing in worker processes
    warm = _phase("warm", tmp_path, monkeypatch, "--profile", str(tmp_path / "prof"))
    # The profile of the warm phase: the pstats file and the text top list, with the tuning call.
    listed = (tmp_path / "prof" / "tuning-warm.txt").read_text()
    assert "tottime" in listed and "cumulative" in listed and "tune_decode_step" in listed
    assert (tmp_path / "prof" / "tuning-warm.prof").stat().st_size > 0
    assert warm["profiles_tuned"] == 0 and warm["measurements"] == 0 and warm["fallbacks"] == {}
    # Every profile is cached: tune_step records the step (dry runs, not counted) and skips the
    # bucket runs whose calls the cold phase counted.
    assert warm["op_calls"] == 0
    assert all(phase["host_speed"]["python_loop_us"] > 0 for phase in (cold, warm))


def test_the_compile_workers_side_is_summed_from_their_job_log() -> None:
    tuning_time = _tuning_time()
    from graphtune._compile_worker import JobResult

    start = 100.0
    log = [
        JobResult("warm-up", "", None, 100.1, 101.5, 11),
        JobResult("warm-up", "", None, 100.1, 102.0, 12),
        JobResult("compile", "gemv_kernel", None, 102.0, 102.5, 11),
        JobResult("compile", "gemv_kernel", "CompilationError: no", 102.1, 102.4, 12),
        JobResult("compile", "rms_norm_kernel", None, 102.5, 103.5, 11),
    ]
    summary = tuning_time.compile_workers(log, start)
    assert summary["processes"] == 2 and summary["jobs"] == 3 and summary["failed"] == 1
    assert summary["ready_s"] == 2.0  # the last worker to be ready
    assert (summary["first_job_s"], summary["last_job_s"]) == (2.0, 3.5)
    assert abs(summary["job_seconds"] - 1.8) < 1e-9
    kernels = summary["by_kernel"]
    assert list(kernels) == ["rms_norm_kernel", "gemv_kernel"]  # most seconds first
    assert (
        kernels["gemv_kernel"]["jobs"] == 2 and abs(kernels["gemv_kernel"]["seconds"] - 0.8) < 1e-9
    )
    assert tuning_time.compile_workers([], start) is None  # no worker ran (the CPU, a warm start)


# --- main() with the GPU check and the child processes faked ----------------------------------

#: What a phase's child reports, as much as main() and its tables read.
PHASE = {
    "tune_s": 1.0,
    "prepare_s": 0.1,
    "bucket_runs_s": 0.1,
    "check_s": 0.1,
    "check_step_timings": 0,
    "compile_s": 0.0,
    "compiled_binaries": 0,
    "profiles_tuned": 0,
    "untimed_picks": 0,
    "candidates": 1,
    "measurements": 0,
    "raced_out": 0,
    "retimed": 0,
    "median_ms_per_tactic_bucket": 1.0,
    "overall_ms_per_tactic_bucket": 1.0,
    "phase_seconds": {},
    "second_call_s": 0.1,
    "by_op": {},
    "compile_by_runner": {},
    "compile_workers": None,
    "import_s": 0.1,
}


@pytest.fixture
def fake_phases(monkeypatch):
    """``main`` on the CPU: no CUDA check, provenance of an 'h200', phases that return PHASE
    (``tune_s`` 99 under ``--profile``) or fail where ``fail`` names the phase."""
    import torch

    from graphtune import bench

    tuning_time = _tuning_time()
    real = bench.provenance
    monkeypatch.setattr(bench, "require_cuda_or_exit", lambda script: torch.device("cpu"))
    monkeypatch.setattr(bench, "provenance", lambda c, d: {**real(c, "cpu"), "gpu_slug": "h200"})
    state = {"fail": None, "calls": []}

    def run_phase(phase, args, triton, bytecode, cache):
        state["calls"].append(phase)
        if phase == state["fail"]:
            raise RuntimeError(f"{phase} phase failed:\nTraceback ...\nOutOfMemoryError: boom")
        return {**PHASE, "phase": phase, "tune_s": 99.0 if args.profile else 1.0}

    monkeypatch.setattr(tuning_time, "run_phase", run_phase)
    return tuning_time, state


def test_the_result_name_carries_the_model_and_the_profiler(fake_phases, tmp_path, capsys):
    tuning_time, _ = fake_phases
    base = ["--out", str(tmp_path), "--cold-bytecode", "empty"]
    assert tuning_time.main(base) == 0
    assert tuning_time.main([*base, "--profile", str(tmp_path / "prof")]) == 1  # 99 s > 15 s
    assert tuning_time.main([*base, "--model", "llama-3-8b-shape"]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    # Three runs, three files: the profiled or other-model run replaced the plain one before.
    assert names == [
        "tuning-time-h200-llama-1b-shape-profiled.json",
        "tuning-time-h200-llama-1b-shape.json",
        "tuning-time-h200-llama-3-8b-shape.json",
    ]
    plain = json.loads((tmp_path / "tuning-time-h200-llama-1b-shape.json").read_text())
    assert plain["cold"]["tune_s"] == 1.0 and plain["options"]["profiled"] is False


def test_flags_are_checked_up_front(fake_phases, tmp_path, capsys):
    tuning_time, state = fake_phases
    for value in ("0", "-5"):
        with pytest.raises(SystemExit) as exc:
            tuning_time.parse_args(["--max-batch", value])
        assert exc.value.code == 2
        assert f"must be >= 1, got {value}" in capsys.readouterr().err
    keep = tmp_path / "keep"
    argv = ["--out", str(tmp_path), "--cold-bytecode", "empty", "--keep-caches", str(keep)]
    assert tuning_time.main(argv) == 0 and (keep / "triton-cache").is_dir()
    capsys.readouterr()
    state["calls"].clear()
    # The same folder again: one usage line, no phase run (was FileExistsError after the checks).
    with pytest.raises(SystemExit) as exc:
        tuning_time.main(argv)
    assert exc.value.code == 2 and state["calls"] == []
    err = capsys.readouterr().err.strip().splitlines()
    assert "--keep-caches" in err[-1] and "give a new folder or empty this one" in err[-1]


def test_a_failed_phase_keeps_the_finished_ones(fake_phases, tmp_path, capsys):
    tuning_time, state = fake_phases
    state["fail"] = "warm"
    assert tuning_time.main(["--out", str(tmp_path)]) == 1
    assert state["calls"] == ["cold", "cold", "warm"]  # bytecode run, cold, the failed warm
    [path] = tmp_path.glob("*.json")
    assert path.name == "tuning-time-h200-llama-1b-shape-failed.json"
    data = json.loads(path.read_text())
    assert data["cold"]["tune_s"] == 1.0 and data["cold_empty_bytecode"]["phase"] == "cold"
    assert "OutOfMemoryError: boom" in data["warm"]["error"] and data["checks"] is None
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        f"error: warm phase failed: OutOfMemoryError: boom; the phases that finished are in {path}"
    )
    assert json.loads(captured.out.strip().splitlines()[-1])["error"].startswith("warm phase")
    # A cold phase that fails: the warm phase (which needs its caches) does not run.
    state["fail"], state["calls"] = "cold", []
    # --out need not exist: it is made before the phases, as the write made it.
    assert tuning_time.main(["--out", str(tmp_path / "x"), "--cold-bytecode", "empty"]) == 1
    data = json.loads((tmp_path / "x" / path.name).read_text())
    assert state["calls"] == ["cold"] and data["warm"] is None and "error" in data["cold"]


def test_an_unmeasured_median_fails_its_target() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _tuning_time_report import checks
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cold = {"tune_s": 1.0, "median_ms_per_tactic_bucket": None}
    warm = {"tune_s": 0.1, "profiles_tuned": 0, "measurements": 0}
    assert checks(cold, warm)["median_ms_per_tactic_bucket_le"] is False
    assert checks({**cold, "median_ms_per_tactic_bucket": 5.0}, warm)[
        "median_ms_per_tactic_bucket_le"
    ]
