"""benchmarks/moe.py and its batched in-graph truth (graphtune.bench.cupti_sweep) without a GPU.

The sweep runs against a fake of ``torch.cuda`` and of the profiler trace (each replay's kernels
carry the correlation id of its graph launch, as CUPTI reports them), so its capture, interleaved
replay, trace split and fallbacks are checked before the script reaches the H200; the script's
pure helpers (bytes moved, the table, options) run on synthetic data (the scores of the GEMV
path's two stages: test_bench_moe_scores.py), and its ``main`` runs end to end on a tiny expert
shape with the kernels under the Triton interpreter, the tuner's CPU timer and a sweep that calls
each configuration instead of profiling it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

# The interpreter must be chosen before Triton decorates the kernels (see test_ops_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import moe as bench  # noqa: E402

import graphtune.bench as toolkit  # noqa: E402
from graphtune.bench import cupti_sweep as sweep  # noqa: E402
from graphtune.bench import graphs as toolkit_graphs  # noqa: E402


class FakeStream:
    def wait_stream(self, other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


class FakeGraph:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.captured: list[int] = []
        self.pool: Any = None
        self.resets = 0

    def replay(self) -> None:
        self.cuda.launches.append(self)

    def reset(self) -> None:
        self.resets += 1


class FakeCuda:
    """The torch.cuda calls the sweep makes; graph replays are logged in launch order."""

    def __init__(self) -> None:
        self.graphs: list[FakeGraph] = []
        self.capturing: FakeGraph | None = None
        self.launches: list[FakeGraph] = []
        self.pools = 0

    def current_stream(self) -> FakeStream:
        return FakeStream()

    def current_device(self) -> int:
        return 0

    def Stream(self, device: Any = None) -> FakeStream:  # noqa: N802 (torch's name)
        return FakeStream()

    def synchronize(self) -> None:
        return None

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
        assert pool is not None and stream is not None
        graph.pool = pool
        self.capturing = graph
        try:
            yield
        finally:
            self.capturing = None


def candidate(cuda: FakeCuda, eager: list[int], fail: bool = False):
    def call(i: int) -> None:
        if cuda.capturing is None:
            eager.append(i)
            return
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        cuda.capturing.captured.append(i)

    return call


def kernel(name: str, ts: float, dur: float, corr: int | None, cat: str = "kernel") -> dict:
    args = {} if corr is None else {"correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def trace_of(
    launches: list[FakeGraph],
    per_call_us: dict[int, float],
    *,
    with_launch_events: bool = True,
    prologue: bool = False,
    lose: int | None = None,
) -> dict[str, Any]:
    """Each call of graph g: one kernel of ``per_call_us[g]`` us then a 0.5 us gap."""
    events, t = [], 0.0
    for n, graph in enumerate(launches):
        corr = 1000 + n
        index = graph.cuda.graphs.index(graph)
        if prologue:
            events.append(kernel("fill", t, 0.2, 5000 + n))
        if with_launch_events:
            events.append(kernel("cudaGraphLaunch", t + 0.5, 2.0, corr, cat="cuda_runtime"))
        t += 3.0
        for call in range(len(graph.captured)):
            if lose == n and call == 0:
                continue
            events.append(kernel(f"moe_{index}", t, per_call_us[index], corr))
            t += per_call_us[index] + 0.5
        t += 50.0
    return {"traceEvents": events}


@pytest.fixture
def fake(monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setattr(toolkit_graphs, "torch", SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(sweep, "torch", SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(toolkit_graphs, "_CAPTURE_STREAMS", {})
    cuda.trace_options = {}
    cuda.per_call_us = {0: 2.0, 1: 3.0, 2: 1.5}

    def profile_trace(fn, first, calls, with_cpu):
        cuda.launches.clear()
        for i in range(calls):
            fn(first + i)
        return trace_of(list(cuda.launches), cuda.per_call_us, **cuda.trace_options)

    monkeypatch.setattr(sweep, "profile_trace", profile_trace)
    return cuda


def expected_span(calls: int, us: float) -> float:
    return (calls * us + (calls - 1) * 0.5) / calls


@pytest.mark.parametrize("options", [{}, {"with_launch_events": False}, {"prologue": True}])
def test_sweep_captures_each_candidate_and_splits_interleaved_replays(fake, options):
    fake.trace_options = options
    eager: list[int] = []
    fns = [candidate(fake, eager) for _ in range(3)]
    results = sweep.cupti_graph_sweep(fns, [4, 2, 1], replays=3, warmup=1)
    assert [len(g.captured) for g in fake.graphs] == [4, 2, 1]
    assert len({g.pool for g in fake.graphs}) == 3  # a private pool each
    assert eager == [0, 0, 0]  # one warm-up call each, outside the capture
    assert [fake.graphs.index(g) for g in fake.launches] == [0, 1, 2] * 3  # round-robin
    assert all(g.resets == 1 for g in fake.graphs)
    for i, (calls, result) in enumerate(zip([4, 2, 1], results, strict=True)):
        assert result["error"] is None and result["grouping"] == "sweep"
        assert result["kernels_per_call"] == 1 and len(result["samples_us"]) == 3
        want = expected_span(calls, fake.per_call_us[i])
        assert result["per_call_us"] == pytest.approx(want)


def test_a_candidate_that_cannot_be_captured_is_reported_and_the_rest_measured(fake):
    eager: list[int] = []
    fns = [candidate(fake, eager), candidate(fake, eager, fail=True), candidate(fake, eager)]
    fake.per_call_us = {0: 2.0, 1: 9.0, 2: 1.5}
    results = sweep.cupti_graph_sweep(fns, [2, 2, 2], replays=2)
    assert "capture: RuntimeError" in results[1]["error"]
    assert results[1]["per_call_us"] == float("inf")
    assert results[0]["per_call_us"] == pytest.approx(expected_span(2, 2.0))
    # The failed capture is graph 1; candidate 2 captured into graph 2.
    assert results[2]["per_call_us"] == pytest.approx(expected_span(2, 1.5))


def test_a_replay_that_lost_an_activity_is_measured_alone(fake, monkeypatch):
    fake.trace_options = {"lose": 4}  # the second round's replay of candidate 1
    seen = []

    def single(fn, *, calls_per_graph, replays, warmup):
        seen.append(calls_per_graph)
        return SimpleNamespace(per_call_us=7.0, samples_us=[7.0] * replays, kernels_per_call=1)

    monkeypatch.setattr(sweep, "cupti_graph_time", single)
    eager: list[int] = []
    results = sweep.cupti_graph_sweep(
        [candidate(fake, eager) for _ in range(3)], [3, 3, 3], replays=2
    )
    assert seen == [3]
    assert results[1]["grouping"] == "single" and results[1]["per_call_us"] == 7.0
    assert results[0]["grouping"] == "sweep" and results[2]["grouping"] == "sweep"


def test_without_launch_events_extra_groups_send_every_candidate_to_the_single_path(
    fake, monkeypatch
):
    fake.trace_options = {"with_launch_events": False, "prologue": True}
    monkeypatch.setattr(
        sweep,
        "cupti_graph_time",
        lambda fn, **kw: SimpleNamespace(per_call_us=4.0, samples_us=[4.0], kernels_per_call=1),
    )
    eager: list[int] = []
    results = sweep.cupti_graph_sweep([candidate(fake, eager) for _ in range(2)], [1, 1])
    assert [r["grouping"] for r in results] == ["single", "single"]
    assert [r["per_call_us"] for r in results] == [4.0, 4.0]


def test_split_by_launch_refuses_a_trace_without_correlation():
    trace = {"traceEvents": [kernel("k", 0.0, 1.0, None), kernel("k", 2.0, 1.0, None)]}
    assert sweep.split_by_launch(trace, [1, 1]) is None
    assert sweep.split_by_launch({"traceEvents": [kernel("k", 0.0, 1.0, 7)]}, [1, 1]) is None


# --- benchmarks/moe.py helpers ------------------------------------------------------------------


def test_selected_bytes_counts_only_the_routed_experts():
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    gate_up = torch.zeros(5, 12, 8, dtype=torch.bfloat16)
    down = torch.zeros(5, 8, 6, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 2], [2, 4], [0, 4]])
    moved, selected = bench.selected_bytes([x, gate_up, down, torch.ones(3, 2), ids])
    assert selected == 3
    assert moved == 3 * (12 * 8 + 8 * 6) * 2 + 2 * 3 * 8 * 2


def test_table_shows_buckets_errors_and_tuning_time():
    tactic = dict(block_m=16, block_n=32, block_k=64, group_m=1, warps=4, stages=4)
    bucket = dict(
        tokens=8,
        n_candidates=8,
        n_measured=8,
        candidates=[
            {"runner": "TorchFusedMoeRunner", "tactic": -1},
            {"runner": "TritonFusedMoeRunner", "tactic": tactic},
        ],
        pick=1,
        best=0,
        regret=0.0199,
        regret_pass=True,
        regret_op=0.0199,
        regret_down=None,
        step=dict(
            kind="op",
            pick=[1, None],
            pick_us=20.5,
            best=[0, None],
            best_us=20.1,
            pick_gbps=3000.0,
            best_gbps=3100.0,
        ),
        down=None,
        fallback_us=300.0,
    )
    gemv = {"runner": "TritonMoeGemvRunner", "tactic": {"bn": 4, "bk": 256, "warps": 2}}
    pair = dict(
        bucket,
        tokens=1,
        n_measured=40,
        candidates=[bucket["candidates"][0], gemv],
        regret=0.0251,
        regret_pass=False,
        regret_op=0.001,
        regret_down=0.0125,
        step=dict(bucket["step"], kind="pair", pick=[1, 1], best=[1, 0]),
        down={
            "candidates": [
                {"tactic": {"features": 1, "bk": 128, "warps": 2}},
                {"tactic": {"features": 2, "bk": 256, "warps": 4}},
            ],
            "pick_tactic": {"features": 2, "bk": 256, "warps": 4},
        },
    )
    good = dict(shape="qwen3-30b-a3b", buckets=[pair, bucket, {"tokens": 64, "error": "boom"}])
    good.update(tuned_buckets=list(range(13)), tune_s=41.0, compile_s=20.0, tune_pass=True)
    good.update(sweep_s=12.0, error=None)
    bad = dict(shape="mixtral-8x7b", buckets=[], error="tuning: RuntimeError: x")
    text = bench.table([good, bad])
    row = (
        "| qwen3-30b-a3b | 8 | 8 | grouped 16/32/64/1/4/4 | 20.5 | torch | 20.1 | 1.99% | yes "
        "| 1.99% | - | - | 3000 | 3100 | 300.0 |"
    )
    assert row in text
    row = (
        "| qwen3-30b-a3b | 1 | 40 | gemv 4/256/2 + 2/256/4 | 20.5 | gemv 4/256/2 + 1/128/2 "
        "| 20.1 | 2.51% | NO | 0.10% | 2/256/4 | 1.25% |"
    )
    assert row in text
    assert "| qwen3-30b-a3b | 64 | error: boom |" in text
    assert "| qwen3-30b-a3b | 13 | 41.0 | 20.0 | yes | 12.0 |" in text
    assert "| mixtral-8x7b | error: tuning: RuntimeError: x |" in text
    header, rule = text.splitlines()[:2]
    assert header.count("|") == rule.count("|")


def test_options_quick_and_errors(capsys):
    args = bench.parse_args(["--quick", "--shapes", "qwen3-30b-a3b"])
    assert args.tokens == [1, 64] and args.max_tokens == 64 and args.shapes == ["qwen3-30b-a3b"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", "llama"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--tokens", "1,8192"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--tokens", "0"])
    capsys.readouterr()


def test_main_end_to_end_on_a_tiny_shape(monkeypatch, tmp_path, capsys):
    from graphtune.ops import _triton

    if not _triton.device_supported(torch.device("cpu")):
        pytest.skip("the kernels run on the CPU only under TRITON_INTERPRET=1")
    monkeypatch.setattr(bench, "SHAPES", {"tiny": bench.ExpertShape(4, 2, 32, 32)})
    monkeypatch.setattr(toolkit, "require_cuda_or_exit", lambda script: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(bench, "DTYPE", torch.float32)  # the interpreter's bf16 dot is broken
    import graphtune.autotuner as autotuner
    from graphtune.autotuner.timing.wallclock import WallClockTimer

    policy = autotuner.TuningPolicy(rounds=1, remeasure_top=0, max_extra_rounds=0)
    # The tuner's CPU timer (wall clock) with one window: one measurement per candidate, a
    # warm-up and one timed call (its default of 5 windows runs each candidate 6 times).
    timer = WallClockTimer(samples=1)
    quick = functools.partial(autotuner.AutoTuner, timer, policy=policy)
    monkeypatch.setattr(autotuner, "AutoTuner", quick)
    swept = []

    def fake_sweep(fns, calls, *, replays):
        swept.append(len(fns))
        out = []
        for i, fn in enumerate(fns):
            fn(0)  # every candidate runs on the sweep's inputs
            out.append({"per_call_us": 10.0 + i, "samples_us": [10.0 + i], "error": None})
        return out

    monkeypatch.setattr(bench, "cupti_graph_sweep", fake_sweep)
    argv = ["--out", str(tmp_path), "--shapes", "tiny", "--tokens", "2", "--max-tokens", "2"]
    status = bench.main(argv)
    out = capsys.readouterr().out
    (path,) = tmp_path.glob("moe-*.json")
    payload = json.loads(path.read_text())
    (shape,) = payload["shapes"]
    assert shape["error"] is None and shape["tuned_buckets"] == [1, 2]
    assert [b["tokens"] for b in shape["buckets"]] == [2]  # one: the interpreter is slow
    assert shape["down_buckets"] == [1, 2]  # the down stage tuned by the same call
    for bucket in shape["buckets"]:
        assert bucket["n_candidates"] == len(bucket["candidates"]) >= 2
        assert bucket["best"] == 0 and bucket["best_us"] == 10.0  # the fake's fastest: first
        assert bucket["regret_op"] == bucket["pick_us"] / 10.0 - 1
        gemv = [c for c in bucket["candidates"] if c["runner"] == "TritonMoeGemvRunner"]
        down = bucket["down"]  # T * k <= MAX_PAIRS: a GEMV bucket
        assert gemv and down["n_candidates"] == len(down["candidates"]) >= 1
        assert len(bucket["pairs"]) == len(gemv) * down["n_candidates"]
        assert bucket["n_measured"] == bucket["n_candidates"] + len(bucket["pairs"]) + len(
            down["candidates"]
        )
        step = bucket["step"]
        assert step["best"] == [0, None] and step["best_us"] == 10.0
        assert bucket["regret"] == step["pick_us"] / 10.0 - 1
        if bucket["candidates"][bucket["pick"]]["runner"] == "TritonMoeGemvRunner":
            assert step["kind"] == "pair" and step["pick"] == [bucket["pick"], down["pick"]]
        assert bucket["experts_selected"] >= 2 and bucket["bytes"] > 0
    assert swept == [b["n_measured"] for b in shape["buckets"]]
    assert payload["provenance"]["command"] and "| tiny | 2 |" in out
    assert status in (0, 1) and payload["summary"]["all_pass"] == (status == 0)
