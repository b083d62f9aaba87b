"""``graphtune bench decode``'s report: the spread of the timed repeats and its warning, on
injected timings (a scripted clock behind the benchmark's wall-clock timer)."""

from __future__ import annotations

import itertools
import json

import pytest

from graphtune.autotuner.timing import WallClockTimer
from graphtune.bench import timing
from graphtune.bench.decode_report import format_report
from graphtune.bench.decode_results import BatchResult, DecodeBenchReport
from graphtune.bench.decode_spread import SPREAD_WARNING, spread_warning
from graphtune.cli.main import main

STEPS = 2


class ScriptedClock:
    """Seconds for a wall-clock timer whose windows of ``STEPS`` calls last ``ms_per_step``
    each, in turn (the timer reads the clock at the start and at the stop of every window)."""

    def __init__(self, ms_per_step: list[float]) -> None:
        self.durations = itertools.cycle(ms_per_step)
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:
            self.now += next(self.durations) * STEPS / 1e3
        return self.now


def _bench(monkeypatch, tmp_path, ms_per_step: list[float]) -> tuple[list[str], dict]:
    clock = ScriptedClock(ms_per_step)
    monkeypatch.setattr(
        timing, "call_timer", lambda device, repeats: WallClockTimer(samples=repeats, clock=clock)
    )
    out_json = tmp_path / "decode.json"
    args = "bench decode --model tiny --batch-sizes 1,8 --context 8 --repeats 3".split()
    args += ["--steps", str(STEPS), "--device", "cpu", "--json", str(out_json)]
    assert main(args) == 0
    return out_json, json.loads(out_json.read_text())


def test_noisy_repeats_are_recorded_and_warned_about_once_below_the_table(
    monkeypatch, tmp_path, capsys
):
    # The user's busy 2-core machine: batch 8 at 47.6 / 5.3 / 76.1 ms per step.
    _, data = _bench(monkeypatch, tmp_path, [47.6, 5.3, 76.1])
    out = capsys.readouterr().out
    for r in data["results"]:
        assert r["eager_ms"] == pytest.approx(47.6)
        entry = r["repeat_spread"]["eager_ms"]
        assert entry["min_ms"] == pytest.approx(5.3) and entry["repeats"] == 3
        assert entry["spread"] == pytest.approx((76.1 - 5.3) / 47.6)  # range / median below 4
        assert r["graph_ms"] is None  # the JSON keeps every field
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, out
    (warning,) = warnings
    assert "busy" in warning and "OMP_NUM_THREADS=1" in warning and "--repeats" in warning
    assert "149%" in warning and "eager ms at batch 8; 2 of 2 timings over 20%" in warning
    lines = out.splitlines()
    table_end = max(i for i, line in enumerate(lines) if line.startswith("└"))
    assert lines.index(warning) > table_end
    assert all(not line.startswith("┏") for line in lines[table_end:])  # under the first table


def test_quiet_repeats_print_no_warning(monkeypatch, tmp_path, capsys):
    _, data = _bench(monkeypatch, tmp_path, [10.0, 10.5, 11.0])
    out = capsys.readouterr().out
    assert data["results"][0]["repeat_spread"]["eager_ms"]["spread"] == pytest.approx(1 / 10.5)
    assert "warning" not in out and "OMP_NUM_THREADS" not in out


def _report(spreads: dict[int, dict[str, float]], device: str = "cpu") -> DecodeBenchReport:
    report = DecodeBenchReport(
        config={"context": 8, "dtype": "float32", "device": device, "steps": 20, "repeats": 5},
        model={"name": "tiny", "parameters": 110_000},
        provenance={},
    )
    for batch, by_column in spreads.items():
        r = BatchResult(batch, eager_ms=1.0)
        r.repeat_spread = {
            column: {"min_ms": 0.9, "spread": s, "repeats": 5} for column, s in by_column.items()
        }
        report.results.append(r)
    report.derive()
    return report


def test_the_warning_threshold_is_a_spread_above_20_percent():
    assert SPREAD_WARNING == 0.20
    assert spread_warning(_report({1: {"eager_ms": 0.20}, 8: {"eager_ms": 0.05}})) is None
    assert spread_warning(_report({1: {}})) is None  # nothing timed yet
    noisy = _report({1: {"eager_ms": 0.21}, 8: {"eager_ms": 0.5, "tuned_eager_ms": 0.3}})
    line = spread_warning(noisy)
    assert line is not None and "\n" not in line
    # The worst timing is named, with how many went over.
    assert "50%" in line and "eager ms at batch 8" in line and "3 of 3 timings over 20%" in line
    assert format_report(noisy).count(line) == 1


def test_the_warning_advises_threads_on_cpu_only():
    cpu = spread_warning(_report({1: {"graph_ms": 0.4}}, device="cpu"))
    cuda = spread_warning(_report({1: {"graph_ms": 0.4}}, device="cuda:0"))
    assert cpu is not None and "OMP_NUM_THREADS=1" in cpu and "graph ms at batch 1" in cpu
    assert cuda is not None and "OMP_NUM_THREADS" not in cuda and "--repeats" in cuda


def _header(text: str) -> str:
    return text.split("┡")[0]


def test_a_cpu_table_leaves_out_the_columns_no_row_measured_and_says_what_the_rest_mean():
    report = _report({1: {}, 8: {}})
    text = format_report(report)
    header = _header(text)
    assert "eager ms" in header and "tokens/s" in header
    for empty in ("graph", "GPU-busy", "speed-up", "busy", "floor"):
        assert empty not in header
    lines = text.splitlines()
    table_end = max(i for i, line in enumerate(lines) if line.startswith("└"))
    legend = lines[table_end + 1]
    assert legend == (
        "ms per decode step: median of 5 repeats of 20 back-to-back steps; "
        "tokens/s = batch / eager ms"
    )
    assert lines[0].strip() == "decode step: tiny (0.11 M params), context 8, float32, cpu"
    # The JSON keeps every field, null where not measured.
    data = report.to_json()["results"][0]
    assert data["graph_ms"] is None and data["floor_ms"] is None and data["busy_ms"] is None
    assert data["speedup"] is None and data["graph_over_busy"] is None


def test_a_column_measured_for_some_rows_stays_and_the_legend_names_it():
    report = _report({1: {}, 8: {}}, device="cuda:0")
    first = report.results[0]
    first.graph_ms, first.busy_ms, first.floor_ms = 0.5, 0.4, 0.3
    report.derive()
    text = format_report(report)
    header = _header(text)
    for column in ("graph ms", "GPU-busy", "speed-up", "graph /", "floor ms"):
        assert column in header
    assert "compile" not in header and "tuned" not in header
    (legend,) = [line for line in text.splitlines() if line.startswith("ms per decode step")]
    assert "tokens/s = batch / graph ms, else eager ms" in legend
    assert "speed-up = eager / graph" in legend and "graph / busy = graph ms / GPU-busy" in legend
    assert "floor = (weights + KV read) / measured copy bandwidth" in legend
    assert "compile" not in legend and "tuned" not in legend


def test_the_cli_table_on_cpu_has_no_empty_columns(monkeypatch, tmp_path, capsys):
    _bench(monkeypatch, tmp_path, [10.0, 10.0, 10.0])
    out = capsys.readouterr().out
    assert "eager ms" in out and "ms per decode step: median of 3 repeats of 2" in out
    assert " - " not in _header(out) + out.split("┡")[1].split("└")[0]
