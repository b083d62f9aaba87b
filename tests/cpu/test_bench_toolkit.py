"""The measurement toolkit (graphtune.bench) without a GPU: trace parsing, the in-graph CUPTI
truth against a fake ``torch.cuda``, GPU-busy from a synthetic trace, the timing helpers on fake
and real CPU timers, the provenance schema, the atomic results writer, and the results JSON in
``benchmarks/results/``.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from graphtune.autotuner.timing.base import Measurement
from graphtune.bench import cupti, cupti_graph, graphs, results, schema, timing
from graphtune.errors import ResultsWriteError

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


# --- trace parsing and the in-graph truth ------------------------------------------------------


def event(name: str, ts: float, dur: float, corr: int | None, cat: str = "kernel") -> dict:
    out = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        out["args"] = {"correlation": corr, "stream": 7}
    return out


def replay_trace(
    replays: int, calls: int, *, prologue: bool = True, correlation: bool = True
) -> dict[str, Any]:
    """Graph replays of ``calls`` x (2.0 us GEMM, 0.3 us gap, 0.5 us reduce, 0.2 us gap)."""
    events = []
    for r in range(replays):
        base = 1000.0 * r
        corr = 100 + r if correlation else None
        if prologue:  # the RNG-offset fill of some torch versions, launched outside the graph
            events.append(event("fill", base, 0.4, 900 + r if correlation else None))
        events.append(event("cudaGraphLaunch", base + 1.0, 3.0, corr, cat="cuda_runtime"))
        t = base + 5.0
        for _ in range(calls):
            events.append(event("gemm_splitk", t, 2.0, corr))
            events.append(event("reduce", t + 2.3, 0.5, corr))
            t += 3.0
    return {"traceEvents": events}


def expected_span(calls: int) -> float:
    return ((calls - 1) * 3.0 + 2.8) / calls


def test_device_events_read_correlation():
    trace = replay_trace(1, 2)
    trace["traceEvents"].append(
        {
            "ph": "X",
            "cat": "kernel",
            "name": "k",
            "ts": 9e9,
            "dur": 1.0,
            "args": {"correlation": "42"},
        }
    )
    events = cupti.device_events_from_trace(trace)
    assert [e.correlation for e in events] == [900, 100, 100, 100, 100, 42]
    assert events[1].end_us == pytest.approx(events[1].start_us + 2.0)


def test_graph_calls_for():
    assert cupti_graph.graph_calls_for(2.0) == 25  # 50 us / 2 us
    assert cupti_graph.graph_calls_for(4.61) == 20  # at least 20
    assert cupti_graph.graph_calls_for(0.1) == 200  # capped
    assert cupti_graph.graph_calls_for(None) == 20
    assert cupti_graph.graph_calls_for(math.inf) == 20
    assert cupti_graph.graph_calls_for(0.0) == 20
    with pytest.raises(ValueError):
        cupti_graph.graph_calls_for(1.0, min_calls=0)


def test_split_replays_by_correlation_drops_prologue_work():
    events = cupti.device_events_from_trace(replay_trace(4, 20))
    groups, method = cupti_graph.split_replays(events, replays=4, calls_per_graph=20)
    assert method == "correlation"
    assert [len(g) for g in groups] == [40] * 4
    assert all(e.name != "fill" for g in groups for e in g)
    spans, sums = cupti_graph.replay_spans(groups, 20)
    assert spans == pytest.approx([expected_span(20)] * 4)
    assert sums == pytest.approx([2.5] * 4)


def test_split_replays_by_gaps_without_correlation():
    events = cupti.device_events_from_trace(replay_trace(3, 20, prologue=False, correlation=False))
    groups, method = cupti_graph.split_replays(events, replays=3, calls_per_graph=20)
    assert method == "gaps"
    spans, _ = cupti_graph.replay_spans(groups, 20)
    assert spans == pytest.approx([expected_span(20)] * 3)
    # Without ids the prologue fill cannot be told apart: the groups stop being a multiple of
    # the calls, and that is an error rather than a span stretched by a launch latency.
    events = cupti.device_events_from_trace(replay_trace(3, 20, correlation=False))
    with pytest.raises(ValueError, match="none a multiple"):
        cupti_graph.split_replays(events, replays=3, calls_per_graph=20)


def test_split_replays_drops_a_replay_that_lost_an_activity():
    trace = replay_trace(3, 20)
    lost = next(i for i, e in enumerate(trace["traceEvents"]) if e["name"] == "reduce")
    del trace["traceEvents"][lost]  # replay 0 lost one activity
    events = cupti.device_events_from_trace(trace)
    groups, _ = cupti_graph.split_replays(events, replays=3, calls_per_graph=20)
    assert len(groups) == 2 and all(len(g) == 40 for g in groups)
    with pytest.raises(ValueError):
        cupti_graph.split_replays([], replays=3, calls_per_graph=20)


class FakeStream:
    def wait_stream(self, other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


class FakeGraph:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.captured: list[int] = []
        self.replays = 0
        self.reset_calls = 0
        self.pool = None

    def replay(self) -> None:
        self.replays += 1

    def reset(self) -> None:
        self.reset_calls += 1


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing

    def record(self, stream: Any) -> None:
        return None

    def elapsed_time(self, other: FakeEvent) -> float:
        return 0.075  # ms per replay


class FakeCuda:
    """The torch.cuda calls cupti_graph_time makes, recording what happened."""

    Event = FakeEvent

    def __init__(self) -> None:
        self.graphs: list[FakeGraph] = []
        self.capturing: FakeGraph | None = None
        self.eager: list[int] = []
        self.pools = 0

    def current_stream(self) -> FakeStream:
        return FakeStream()

    def current_device(self) -> int:
        return 0

    def Stream(self, device: Any = None) -> FakeStream:  # noqa: N802 (torch's name)
        return FakeStream()

    @contextlib.contextmanager
    def stream(self, stream: Any):
        yield

    def CUDAGraph(self) -> FakeGraph:  # noqa: N802 (torch's name)
        graph = FakeGraph(self)
        self.graphs.append(graph)
        return graph

    def graph_pool_handle(self) -> tuple[str, int]:
        self.pools += 1
        return ("pool", self.pools)

    @contextlib.contextmanager
    def graph(self, graph: FakeGraph, pool: Any = None, stream: Any = None):
        assert pool is not None, "capture must use a private pool"
        assert stream is not None, "capture must use the warmed-up side stream"
        graph.pool = pool
        self.capturing = graph
        try:
            yield
        finally:
            self.capturing = None  # like torch: the capture always ends

    def call(self, i: int) -> None:
        if self.capturing is not None:
            self.capturing.captured.append(i)
        else:
            self.eager.append(i)


@pytest.fixture
def fake_cuda(monkeypatch):
    cuda = FakeCuda()
    for module in (graphs, cupti_graph):
        monkeypatch.setattr(module, "torch", SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(graphs, "_CAPTURE_STREAMS", {})

    def profile_trace(fn, first, calls, with_cpu):
        graph = cuda.graphs[-1]
        before = graph.replays
        for i in range(calls):
            fn(first + i)
        assert graph.replays - before == calls
        return replay_trace(calls, len(graph.captured))

    monkeypatch.setattr(cupti, "profile_trace", profile_trace)
    return cuda


def test_cupti_graph_time_procedure(fake_cuda):
    result = cupti_graph.cupti_graph_time(fake_cuda.call, replays=5, warmup=3, estimate_us=2.0)
    graph = fake_cuda.graphs[-1]
    assert fake_cuda.eager == [0, 1, 2]  # warm-up, not captured
    assert graph.captured == list(range(3, 28))  # 25 calls: 50 us / 2 us
    assert graph.pool is not None
    # 1 upload replay + 5 profiled + 1 busy-keeping + 5 event-timed replays.
    assert graph.replays == 12
    assert graph.reset_calls == 1
    assert result.calls_per_graph == 25 and result.replays == 5
    assert result.grouping == "correlation"
    assert result.per_call_us == pytest.approx(expected_span(25))
    assert result.kernel_sum_us == pytest.approx(2.5)
    assert result.kernels_per_call == 2
    assert result.kernel_names == ["gemm_splitk", "reduce"]
    assert result.events_per_call_us == pytest.approx(75.0 / 25)
    summary = result.as_dict()
    assert summary["gap_us"] == pytest.approx(expected_span(25) - 2.5)
    json.dumps(summary)


def test_cupti_graph_time_estimates_calls_when_not_given(fake_cuda, monkeypatch):
    seen = {}

    def kernel_time(fn, *, calls, warmup, categories):
        seen["calls"] = calls
        return SimpleNamespace(per_call_us=0.5)

    monkeypatch.setattr(cupti, "cupti_kernel_time", kernel_time)
    result = cupti_graph.cupti_graph_time(fake_cuda.call, replays=2, warmup=0, event_check=False)
    assert seen["calls"] == 10
    assert result.calls_per_graph == 100  # 50 us / 0.5 us
    assert result.events_per_call_us is None
    assert fake_cuda.eager == [0]  # at least one warm-up call
    explicit = cupti_graph.cupti_graph_time(fake_cuda.call, calls_per_graph=7, replays=2)
    assert explicit.calls_per_graph == 7


def test_cupti_graph_time_resets_the_graph_when_capture_fails(fake_cuda):
    def fn(i: int) -> None:
        fake_cuda.call(i)
        if fake_cuda.capturing is not None:
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="not permitted"):
        cupti_graph.cupti_graph_time(fn, replays=3, estimate_us=5.0)
    assert fake_cuda.graphs[-1].reset_calls == 1
    assert fake_cuda.graphs[-1].replays == 0
    with pytest.raises(ValueError):
        cupti_graph.cupti_graph_time(fn, replays=0, estimate_us=5.0)


def test_device_events_and_per_call_grouping():
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10.0, "dur": 3.0},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 9.0, "dur": 5.0},
            {"ph": "X", "cat": "kernel", "name": "silu", "ts": 14.0, "dur": 1.0},
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 20.0, "dur": 5.0},
            {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 19.0, "dur": 0.5},
            {"ph": "X", "cat": "kernel", "name": "silu", "ts": 26.0, "dur": 1.0},
        ]
    }
    events = cupti.device_events_from_trace(trace)
    assert [e.name for e in events] == ["gemm", "silu", "Memset", "gemm", "silu"]
    kernels_only = [e for e in events if e.category == "kernel"]
    per_call, per_call_kernels = cupti.group_per_call(kernels_only, calls=2)
    assert per_call == [4.0, 6.0]
    assert per_call_kernels == 2
    # Uneven count: falls back to the total spread evenly.
    per_call, per_call_kernels = cupti.group_per_call(events, calls=2)
    assert per_call == [5.25, 5.25]
    assert per_call_kernels is None


# --- GPU-busy from a trace ---------------------------------------------------------------------


def test_gpu_busy_reads_busy_time_activities_and_top_kernels(monkeypatch):
    calls = []

    def profile_trace(fn, first, count, with_cpu):
        for i in range(count):
            fn(first + i)
        events = []
        for k in range(count):
            base = 100.0 * k
            events.append(event("gemm", base, 6.0 + k, None))
            events.append(event("norm", base + 7, 1.0, None))
            events.append(event("Memset", base + 9, 0.5, None, cat="gpu_memset"))
            events.append(event("annotation", base, 50.0, None, cat="gpu_user_annotation"))
        return {"traceEvents": events}

    monkeypatch.setattr(cupti, "profile_trace", profile_trace)
    monkeypatch.setattr(cupti.torch.cuda, "synchronize", lambda *a, **k: None)
    busy = cupti.gpu_busy(lambda: calls.append(1), calls=3, top=2)
    assert len(calls) == 4  # one unprofiled call, then the profiled ones
    assert busy.per_call_ms == pytest.approx((7.0 + 1.0 + 0.5) / 1e3)  # median call
    assert busy.activities_per_call == 3  # the annotation spans others and is not counted
    assert [k["name"] for k in busy.top] == ["gemm", "norm"]
    assert busy.top[0]["us"] == pytest.approx(7.0) and busy.top[0]["calls"] == 1
    assert busy.top[0]["share"] == pytest.approx(7.0 / 8.5)
    monkeypatch.setattr(cupti, "profile_trace", lambda *a: {"traceEvents": []})
    assert cupti.gpu_busy(lambda: None) is None


# --- timing on the library's timers -----------------------------------------------------------


class _Timer:
    name = "fake"

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def measure(self, fn, *, warmup, repeat):
        self.seen.append((warmup, repeat))
        fn(0)
        return Measurement.from_samples([2500.0], calls_per_sample=repeat, timer=self.name)


def test_time_per_call_uses_the_timer_it_is_given():
    timer = _Timer()
    calls = []
    ms = timing.time_per_call_ms(lambda: calls.append(1), torch.device("cpu"), 7, 3, timer=timer)
    assert ms == pytest.approx(2.5) and timer.seen == [(3, 7)] and calls == [1]
    assert timing.call_timer(torch.device("cpu"), 4).name == "wallclock"
    # The real wall-clock timer on a real CPU call.
    x = torch.randn(64, 64)
    assert timing.time_per_call_ms(lambda: x @ x, torch.device("cpu"), 3, 2) > 0


def test_copy_bandwidth_and_bytes_floor():
    assert timing.copy_bandwidth_gbps(torch.device("cpu")) is None
    # 2 * 1 MiB moved in 2.5 ms per copy.
    got = timing.copy_bandwidth_gbps(torch.device("cpu"), 1 << 20, timer=_Timer())
    assert got == pytest.approx(2 * (1 << 20) / 2.5e-3 / 1e9)
    assert timing.bytes_floor_ms(4_000_000_000, 4000.0) == pytest.approx(1.0)


def test_a_sliding_window_caps_the_kv_positions_the_floor_counts():
    from graphtune.engine.presets import get_preset

    mistral = get_preset("mistral-tiny").replace(sliding_window=4)
    assert timing.kv_positions_read(512, mistral) == 4  # only the window is visible
    assert timing.kv_positions_read(2, mistral) == 3  # a context shorter than the window
    assert timing.kv_positions_read(512, mistral.replace(sliding_window=None)) == 513


def test_host_speed_times_both_probes_per_call_on_the_clock_it_is_given():
    ticks = iter(range(1000))
    got = timing.host_speed(repeats=3, calls=4, clock=lambda: float(next(ticks)))
    # Each sample spans one tick of a clock that advances one second per reading.
    assert got == {
        "python_loop_us": pytest.approx(1e6 / 4),
        "torch_empty_us": pytest.approx(1e6 / 4),
    }
    real = timing.host_speed(repeats=2, calls=50)
    assert set(real) == {"python_loop_us", "torch_empty_us"} and all(v > 0 for v in real.values())


# --- provenance and the results writer ---------------------------------------------------------


def test_provenance_has_every_field_of_the_schema():
    record = schema.provenance("abc123", "cpu", command="graphtune bench decode")
    assert list(record) == list(schema.FIELDS)
    assert record["schema"] == schema.SCHEMA and schema.is_provenance(record)
    assert record["commit"] == "abc123" and record["command"] == "graphtune bench decode"
    assert (
        record["device"] == "cpu" and record["gpu"] is None and record["torch"] == torch.__version__
    )
    json.dumps(record)
    assert schema.gpu_slug("NVIDIA H200") == "h200"
    assert schema.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert schema.gpu_slug("") == "unknown"
    assert schema.git_commit("given") == "given"
    assert not schema.is_provenance({"schema": schema.SCHEMA})


def test_git_commit_ignores_a_repository_that_does_not_track_the_package(tmp_path, monkeypatch):
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("needs git")

    def git(*args: str) -> str:
        command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
        done = subprocess.run(command, cwd=tmp_path, check=True, capture_output=True, text=True)
        return done.stdout.strip()

    # graphtune installed in a virtual environment inside someone's project repository.
    git("init", "-q")
    (tmp_path / "README").write_text("x\n")
    git("add", "README")
    git("commit", "-q", "-m", "project")
    installed = tmp_path / "venv" / "graphtune" / "bench" / "schema.py"
    installed.parent.mkdir(parents=True)
    installed.write_text("")
    monkeypatch.setattr(schema, "__file__", str(installed))
    monkeypatch.setattr(schema.env, "source_commit", lambda: None)
    assert schema.git_commit() == "unknown"
    # A checkout that tracks the file is graphtune's own source: its commit is recorded.
    git("add", str(installed))
    git("commit", "-q", "-m", "source")
    assert schema.git_commit() == git("rev-parse", "HEAD")


def test_command_line_names_the_program(monkeypatch):
    monkeypatch.setattr(schema.sys, "argv", ["/x/graphtune/__main__.py", "bench", "decode"])
    assert schema.command_line().endswith("-m graphtune bench decode")
    monkeypatch.setattr(schema.sys, "argv", ["benchmarks/timers.py", "--quick"])
    assert schema.command_line().endswith("benchmarks/timers.py --quick")
    monkeypatch.setattr(schema.sys, "argv", ["/usr/bin/graphtune", "tune"])
    assert schema.command_line() == "graphtune tune"


def test_write_json_is_atomic_and_strict(tmp_path):
    path = tmp_path / "deep" / "r.json"
    assert results.write_json(path, {"a": math.inf, "b": [1.0, math.nan], "c": Path("x")}) == path
    assert json.loads(path.read_text()) == {"a": None, "b": [1.0, None], "c": "x"}
    assert results.write_json(path, {"a": 1}) == path  # replaces the old file whole
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary left behind


def test_a_non_finite_check_stays_visible_in_the_json():
    # null means "not measured"; a logits check that found NaN failed, it did not go unrun.
    row = {"tuned_max_abs_diff": math.nan, "hf_max_abs_diff": math.inf, "graph_ms": math.nan}
    assert results.json_safe({"results": [row]})["results"][0] == {
        "tuned_max_abs_diff": "nan",
        "hf_max_abs_diff": "inf",
        "graph_ms": None,
    }


def test_write_json_says_where_the_data_went_when_the_target_fails(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path / "tmp"))
    written = results.write_json(blocker / "r.json", {"x": 1})
    assert written.parent == tmp_path / "tmp" and written.name.endswith("r.json")
    assert json.loads(written.read_text()) == {"x": 1}
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(blocker))
    with pytest.raises(ResultsWriteError, match="could not write the result to .* nor to"):
        results.write_json(blocker / "r.json", {"x": 1})


def test_every_result_file_carries_the_provenance_schema():
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        record = json.loads(path.read_text()).get("provenance")
        assert schema.is_provenance(record), path.name
