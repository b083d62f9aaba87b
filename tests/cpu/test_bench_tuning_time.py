"""benchmarks/tuning_time.py: its two phases (the child processes) on the CPU with the tiny model.

The children run as the script runs them, in fresh processes (without ``TRITON_INTERPRET``, so
on the CPU the ops offer their torch paths and nothing slow is interpreted).
"""

from __future__ import annotations

import sys
from pathlib import Path

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
