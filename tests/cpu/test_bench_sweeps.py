"""What every exhaustive sweep script in benchmarks/ does without a GPU."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import _sweep  # noqa: E402
import attention_sweep  # noqa: E402
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
    )
    assert runner.compiled == [{"b": 1}, {"b": 2}]  # the fallback is torch: nothing to compile
    assert runner.ran == [("copy0", -1), ("copy1", {"b": 1}), ("copy0", {"b": 2})]
    rows = swept["rows"]
    assert [r["offered"] for r in rows] == [True, True, False]
    assert rows[1]["tb_s"] == 4.0 and rows[2]["tb_s"] is None
    assert rows[2]["error"] == "launch failed" and rows[0]["error"] is None
