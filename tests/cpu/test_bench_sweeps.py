"""What every exhaustive sweep script in benchmarks/ (and fused_ops.py, a sweep of fused stages)
does without a GPU."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from failing_writes import fail_writes_in

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import _sweep  # noqa: E402
import attention_sweep  # noqa: E402
import fused_ops  # noqa: E402
import gemm_sweep  # noqa: E402
import gemv_sweep  # noqa: E402

from graphtune.autotuner import FALLBACK_TACTIC  # noqa: E402
from graphtune.autotuner.entries import tactic_text  # noqa: E402


@pytest.mark.parametrize("script", [attention_sweep, gemv_sweep, gemm_sweep])
def test_main_without_cuda_exits_2_with_a_reason(script, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exited:
        script.main(["--out", str(tmp_path)])
    assert exited.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "script,argv,message",
    [
        (gemv_sweep, ["--ops", "qkv,lm_head"], "--ops: unknown op 'lm_head'"),
        (gemv_sweep, ["--batches", "8,32"], "--batches must lie in 1..16"),
        (gemv_sweep, ["--batches", "eight"], "--batches: expected comma-separated integers"),
        (gemv_sweep, ["--model", "llama-9b"], "--model: unknown model preset 'llama-9b'"),
        (gemm_sweep, ["--ops", "qkv,lm_head"], "--ops: unknown op 'lm_head'"),
        (gemm_sweep, ["--batches", "1"], "--batches must be >= 2"),
        (gemm_sweep, ["--batches", "x"], "--batches: expected comma-separated integers"),
        (gemm_sweep, ["--model", "llama-9b"], "--model:"),
        (gemm_sweep, ["--replays", "0"], "--replays: must be >= 1"),
        (attention_sweep, ["--replays", "x"], "--replays: expected an integer"),
    ],
)
def test_bad_arguments_of_a_projection_sweep_are_usage_errors(
    script, argv, message, tmp_path, capsys
):
    with pytest.raises(SystemExit) as exited:
        script.main(["--out", str(tmp_path), *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


class _Runner:
    """Stands in for a Triton runner: records what is compiled and run."""

    def __init__(self) -> None:
        self.compiled: list = []
        self.ran: list = []

    def precompile(self, inputs, tactics):
        self.compiled += tactics
        return {tactic_text(t): ("ConfigError: no" if t == {"b": 2} else None) for t in tactics}

    def forward(self, inputs, tactic):
        self.ran.append((inputs[0], tactic))


def test_sweep_runner_times_every_candidate_and_compiles_only_triton_tactics(monkeypatch):
    def fake_truth(fns, calls, *, replays):
        for i, fn in enumerate(fns):
            fn(i)  # a call with index i takes copy i % copies
        return [
            {"per_call_us": us, "kernels_per_call": 1, "error": err}
            for us, err in ((4.0, None), (2.0, None), (math.inf, "launch failed"))
        ]

    monkeypatch.setattr(_sweep, "cupti_graph_sweep", fake_truth)
    runner = _Runner()
    candidates = [FALLBACK_TACTIC, {"b": 1}, {"b": 2}]
    swept = _sweep.sweep_runner(
        runner,
        [["copy0"], ["copy1"]],
        candidates,
        {_sweep.tactic_key({"b": 1})},
        8_000_000,
        replays=3,
        calls_per_graph=20,
        l2_bytes=4_000_000,
    )
    assert runner.compiled == [{"b": 1}, {"b": 2}]  # the fallback is torch: nothing to compile
    assert runner.ran == [("copy0", -1), ("copy1", {"b": 1}), ("copy0", {"b": 2})]
    rows = swept["rows"]
    assert [r["offered"] for r in rows] == [True, True, False]
    assert rows[1]["tb_s"] == 4.0 and rows[2]["tb_s"] is None
    assert rows[2]["error"] == "launch failed" and rows[0]["error"] is None


MIB = 2**20


@pytest.mark.parametrize(("copies", "copy_mib"), [(9, 12), (13, 8), (2, 64), (16, 4)])
def test_sweep_graphs_walk_whole_rounds_of_the_weight_copies(monkeypatch, copies, copy_mib):
    # 20 calls over 9 copies (llama-1b qkv on an H100's 50 MiB L2) restarted each replay on
    # copies read 2 calls before, so 2 of 20 weights per replay came from L2 (13 copies: 7).
    graphs = []

    def fake_truth(fns, calls, *, replays):
        graphs.extend(calls)
        return [{"per_call_us": 1.0, "kernels_per_call": 1, "error": None} for _ in fns]

    monkeypatch.setattr(_sweep, "cupti_graph_sweep", fake_truth)
    swept = _sweep.sweep_runner(
        _Runner(),
        [[f"copy{i}"] for i in range(copies)],
        [FALLBACK_TACTIC],
        set(),
        copy_mib * MIB,
        replays=1,
        calls_per_graph=20,
        l2_bytes=50 * MIB,
    )
    calls = graphs[0]
    assert calls >= 20 and calls % copies == 0 and swept["calls_per_graph"] == calls
    assert _sweep.warm_calls(copies, calls, copy_mib * MIB, 50 * MIB) == 0
    assert swept["warm_calls_per_replay"] == 0
    assert swept["copies_over_l2"] == pytest.approx(copies * copy_mib / 50)


def test_warm_calls_counts_replay_boundary_reuse_and_the_cap_is_reported(monkeypatch, caplog):
    assert _sweep.warm_calls(9, 20, 12 * MIB, 50 * MIB) == 2
    assert _sweep.warm_calls(13, 20, 8 * MIB, 50 * MIB) == 7
    monkeypatch.setattr(
        _sweep,
        "cupti_graph_sweep",
        lambda fns, calls, *, replays: [{"per_call_us": 1.0, "kernels_per_call": 1, "error": None}],
    )
    # 16 copies (the cap) of 1 MiB total far less than an L2: the result and a warning say so.
    swept = _sweep.sweep_runner(
        _Runner(),
        [[i] for i in range(16)],
        [FALLBACK_TACTIC],
        set(),
        MIB,
        replays=1,
        calls_per_graph=20,
        l2_bytes=50 * MIB,
    )
    assert swept["calls_per_graph"] == 32 and swept["warm_calls_per_replay"] == 32
    assert "capped below 2x" in caplog.text


def test_sweep_projections_makes_cases_once_per_batch_and_sweeps_ops_in_order(capsys):
    made: list[int] = []

    def cases_of(m):
        made.append(m)
        return {"o": ("o", m), "down": ("down", m)}

    def sweep_one(op, case):
        return {"case": case, "candidates": 3, "compile_s": 1.0, "sweep_s": 0.5}

    sweeps = _sweep.sweep_projections([8, 128], ["down", "o"], cases_of, sweep_one)
    assert made == [8, 128]
    assert [s["case"] for s in sweeps] == [("down", 8), ("o", 8), ("down", 128), ("o", 128)]
    assert "batch 128 o: 3 candidates, compile 1.0 s, sweep 0.5 s" in capsys.readouterr().out


def test_fused_ops_checks_out_first_and_exits_1_when_the_result_went_elsewhere(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(fused_ops.bench, "require_cuda_or_exit", lambda script: "cpu")
    monkeypatch.setattr(fused_ops.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(fused_ops.bench, "provenance", lambda **kw: {})
    monkeypatch.setattr(fused_ops, "table", lambda found: "table")
    monkeypatch.setattr(fused_ops, "run_case", lambda *a: {"tuning_s": 0.0, "seconds": 0.0})
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as exited:  # checked before tuning, not after
        fused_ops.main(["--out", str(tmp_path / "afile"), "--cases", "llama-1b:1"])
    assert exited.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err
    # The write fails late: the path printed is where the data is, and the exit status says so.
    out, spare = fail_writes_in(monkeypatch, tmp_path)
    assert fused_ops.main(["--out", str(out), "--cases", "llama-1b:1"]) == 1
    (kept,) = spare.iterdir()
    captured = capsys.readouterr()
    assert str(kept) in captured.err and "wrote" not in captured.out + captured.err
    assert fused_ops.main(["--out", str(tmp_path), "--cases", "llama-1b:1"]) == 0
    assert f"wrote {tmp_path / 'fused-ops-h200.json'}" in capsys.readouterr().err
