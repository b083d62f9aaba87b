"""benchmarks/truth_agreement.py on a synthetic tuning.py result, without a GPU.

The result has one case where CUPTI and events (same graph, input set 1) pick different bests,
one where every view agrees, one whose graph mode failed and one that errored; the numbers each
section computes are checked, not the printed text.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import truth_agreement as ta  # noqa: E402

GEMM_K1 = {"bm": 16, "bn": 64, "bk": 64, "warps": 4, "stages": 4, "split_k": 1}
GEMM_K4 = {**GEMM_K1, "split_k": 4}
GEMV_K2 = {"bn": 4, "bk": 1024, "warps": 4, "split_k": 2}


def cand(
    runner: str,
    index: int,
    tactic: Any,
    scored: float,
    set1: float | None,
    events: float | None,
    kernel_sum: float,
    tuner: float | None,
) -> dict[str, Any]:
    """A truth candidate as tuning.py stores it (``cupti_graph`` holds input set 1)."""
    graph = None if set1 is None else {"per_call_us": set1, "events_per_call_us": events}
    return {
        "runner": runner,
        "runner_index": index,
        "tactic": tactic,
        "cupti_us": kernel_sum,
        "cupti_graph_us": scored,
        "cupti_graph": graph,
        "tuner_us": {} if tuner is None else {"graph": tuner},
    }


def pick(c: dict[str, Any]) -> dict[str, Any]:
    return {k: c[k] for k in ("runner", "runner_index", "tactic")}


def result() -> dict[str, Any]:
    # Case 1: CUPTI set 1 says A (10.0) beats B (10.2); events say B (10.0) beats A (10.5).
    a = cand("TorchGemmRunner", 0, -1, 10.0, 10.0, 10.5, 9.0, 9.8)
    b = cand("TritonGemmRunner", 1, GEMM_K1, 10.3, 10.2, 10.0, 9.5, 10.3)
    c = cand('TritonGemmRunner[{"max":8}]', 1, GEMM_K4, 11.0, 11.0, 11.0, 8.0, 11.0)
    d = cand("TritonGemvRunner", 2, GEMV_K2, 12.0, 12.0, 12.0, 12.0, 12.0)
    # Case 2: every view agrees on E; G failed (no graph record, no tuner time).
    e = cand("TorchRMSNormRunner", 0, -1, 5.0, 5.0, 5.0, 5.0, 5.0)
    f = cand("TritonRMSNormRunner", 1, {"block": 1024, "warps": 4}, 6.0, 6.0, 6.0, 6.0, 6.0)
    g = cand(
        "TritonRMSNormRunner", 1, {"block": 512, "warps": 4}, math.inf, None, None, math.inf, None
    )
    h = cand("TorchGemmRunner", 0, -1, 7.0, 7.0, 7.0, 7.0, 7.0)
    return {
        "benchmark": "tuning",
        "provenance": {"commit": "abc1234"},
        "options": {"truth_sets": 2},
        "cases": [
            {
                "shape": "qkv",
                "bucket": 8,
                "error": None,
                "candidates": [a, b, c, d],
                "modes": {"graph": {"picks": [pick(a), pick(a), pick(b)]}},
            },
            {
                "shape": "norm",
                "bucket": 1,
                "error": None,
                "candidates": [e, f, g],
                "modes": {"graph": {"picks": [pick(e)] * 3}},
            },
            {
                "shape": "down",
                "bucket": 4,
                "error": None,
                "candidates": [h],
                "modes": {"graph": {"error": "RuntimeError: boom"}},
            },
            {"shape": "up", "bucket": 2, "error": "OOM", "candidates": [], "modes": {}},
        ],
    }


@pytest.fixture
def cases(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result()))
    return ta.ok_cases(ta.load(path))


def test_the_disagreeing_case_and_its_cross_regrets(cases):
    compared, big = ta.disagreements(cases)
    assert compared == 3 and len(big) == 1
    d = big[0]
    assert d["case"] == "qkv M=8"
    assert d["best_first"]["runner"] == "TorchGemmRunner"
    assert d["best_second"]["runner"] == "TritonGemmRunner"
    assert d["first_best_under_second"] == pytest.approx(0.05)  # A: 10.5 vs 10.0 by events
    assert d["second_best_under_first"] == pytest.approx(0.02)  # B: 10.2 vs 10.0 by CUPTI
    assert d["gap"] == pytest.approx(0.05)
    # The scored truth (median over sets) against events: A 10.0 vs B 10.3.
    scored = ta.disagreement(cases[0], ta.IN_GRAPH, ta.EVENTS_SET1)
    assert scored is not None and scored["second_best_under_first"] == pytest.approx(0.03)


@pytest.mark.parametrize(
    ("view", "case1"),
    [
        ("ig CUPTI (scored)", 0.03),  # B 10.3 vs A 10.0
        ("ig CUPTI set 1", 0.02),  # B 10.2 vs A 10.0
        ("ig events set 1", 0.05),  # A 10.5 vs B 10.0
        ("kernel sum", 9.5 / 8.0 - 1),  # B against C
    ],
)
def test_pick_regret_is_the_worst_run_against_each_view(cases, view, case1):
    field = ta.VIEWS[view]
    assert ta.pick_regret(cases[0], "graph", field) == pytest.approx(case1)
    assert ta.pick_regret(cases[1], "graph", field) == 0.0
    assert ta.pick_regret(cases[2], "graph", field) == math.inf  # the mode failed
    summary = ta.regret_summary(cases, "graph", field)
    assert summary["cases"] == 3
    assert summary["share_le_1pct"] == pytest.approx(1 / 3)
    assert summary["max"] == math.inf


def test_a_view_without_a_best_leaves_the_case_out(cases):
    no_events = {**cases[1], "candidates": ta.with_views([])}
    assert ta.pick_regret(no_events, "graph", ta.EVENTS_SET1) is None
    assert ta.regret_summary([cases[0]], "events", ta.IN_GRAPH)["max"] == math.inf
    assert ta.modes_of(cases) == ["graph"]


def test_kind_ratios_are_normalised_by_the_case_median(cases):
    # Case 1 only: case 2 has two candidates with tuner times, case 3 one.
    scored = ta.kind_ratios(cases, "graph", ta.IN_GRAPH)
    assert scored == {
        "torch/cuBLAS": (1, pytest.approx(0.98), pytest.approx(0.02)),
        "Triton GEMM split 1": (1, pytest.approx(1.0), pytest.approx(0.0)),
        "Triton GEMM split > 1": (1, pytest.approx(1.0), pytest.approx(0.0)),
        "GEMV split > 1": (1, pytest.approx(1.0), pytest.approx(0.0)),
    }
    # Events ratios: A 9.8/10.5, B 10.3/10.0, C and D 1.0; the median is 1.0.
    events = ta.kind_ratios(cases, "graph", ta.EVENTS_SET1)
    assert events["torch/cuBLAS"][1] == pytest.approx(9.8 / 10.5)
    assert events["Triton GEMM split 1"][1:] == (pytest.approx(1.03), pytest.approx(0.03))


@pytest.mark.parametrize(
    ("runner", "tactic", "kind"),
    [
        ("TorchGemmRunner", -1, "torch/cuBLAS"),
        ("TorchRopeRunner[32,8,true]", 0, "torch/cuBLAS"),
        ("TritonGemmRunner", GEMM_K1, "Triton GEMM split 1"),
        ('TritonGemmRunner[{"max":8}]', GEMM_K4, "Triton GEMM split > 1"),
        ("TritonGemvRunner", GEMV_K2, "GEMV split > 1"),
        ("TritonGemvRunner", {**GEMV_K2, "split_k": 1}, "GEMV split 1"),
        ("TritonSkinnyGemmRunner", {"bn": 64, "split": 2}, "skinny GEMM"),
        ("TritonRMSNormRunner", {"block": 512, "warps": 4}, "other"),
    ],
)
def test_kind_of(runner, tactic, kind):
    assert ta.kind_of(runner, tactic) == kind


def test_main_prints_every_section(tmp_path, capsys):
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result()))
    assert ta.main([str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("1 of 3 cases") == 2


@pytest.mark.parametrize(
    ("content", "missing"),
    [
        ("{not json", "not JSON"),
        (json.dumps({"benchmark": "tuning"}), "'cases'"),
        (json.dumps({"cases": []}), "'cases' is empty"),
        (json.dumps({"cases": [{"shape": "qkv", "bucket": 1, "modes": {}}]}), "'candidates'"),
        (
            json.dumps({"cases": [{"shape": "qkv", "candidates": [{"runner": "x"}], "modes": {}}]}),
            "runner_index",
        ),
        # Wrong types where the report looks inside (these were tracebacks before).
        (json.dumps({"cases": [{"shape": "a", "candidates": [5], "modes": {}}]}), "not an object"),
        (
            json.dumps(
                {
                    "cases": [
                        {
                            "shape": "a",
                            "candidates": [{"runner": "R", "runner_index": 0, "tactic": 0}],
                            "modes": {"graph": {"picks": [{"tactic": 0}]}},
                        }
                    ]
                }
            ),
            "pick 0 lacks an integer 'runner_index'",
        ),
        (
            json.dumps(
                {
                    "cases": [
                        {
                            "shape": "a",
                            "candidates": [
                                {"runner": "R", "runner_index": 0, "tactic": 0, "cupti_graph": 5}
                            ],
                            "modes": {},
                        }
                    ]
                }
            ),
            "'cupti_graph' is not an object",
        ),
        (
            json.dumps(
                {
                    "cases": [
                        {
                            "shape": "a",
                            "candidates": [{"runner": "R", "runner_index": 0, "tactic": 0}],
                            "modes": {"graph": "oops"},
                        }
                    ]
                }
            ),
            "mode 'graph' of case 0 (a M=?) is not an object",
        ),
    ],
)
def test_a_file_that_is_not_a_result_is_one_line_and_exit_1(tmp_path, capsys, content, missing):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(result()))
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert ta.main([str(good), str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad}: ") and missing in lines[0]
    assert "Traceback" not in captured.err


def test_a_missing_file(tmp_path, capsys):
    assert ta.main([str(tmp_path / "nope.json")]) == 1
    assert "nope.json: cannot read it" in capsys.readouterr().err


def with_events_truth(data: dict[str, Any]) -> dict[str, Any]:
    """The result as tuning.py writes it since the events reading is kept for every input set:
    its median in ``cupti_graph_events_us`` (set 1's reading here, but A at 10.2)."""
    for case in data["cases"]:
        for c in case["candidates"]:
            graph = c.get("cupti_graph") or {}
            c["cupti_graph_events_us"] = graph.get("events_per_call_us", math.inf) or math.inf
            if c["runner"] == "TorchGemmRunner" and c["cupti_graph_us"] == 10.0:
                c["cupti_graph_events_us"] = 10.2
    return data


def test_an_old_file_has_no_all_set_events_view(cases, tmp_path, capsys):
    assert not ta.has_events_truth(cases) and ta.views_of(cases) == ta.VIEWS
    path = tmp_path / "old.json"
    path.write_text(json.dumps(result()))
    assert ta.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert ta.EVENTS_ALL not in out and "over all sets" not in out


def test_the_all_set_events_view_where_the_file_has_it(tmp_path, capsys):
    path = tmp_path / "new.json"
    path.write_text(json.dumps(with_events_truth(result())))
    cases = ta.ok_cases(ta.load(path))
    views = ta.views_of(cases)
    assert list(views) == [
        "ig CUPTI (scored)",
        "ig CUPTI set 1",
        "ig events set 1",
        ta.EVENTS_ALL,
        "kernel sum",
    ]
    assert views[ta.EVENTS_ALL] == ta.IN_GRAPH_EVENTS
    # Picks A, A, B: A reads 10.2 against B's 10.0 over all sets.
    assert ta.pick_regret(cases[0], "graph", ta.IN_GRAPH_EVENTS) == pytest.approx(0.02)
    # The scored CUPTI truth's best A against the events best B: 2% and 3% (B 10.3 vs A 10.0).
    compared, big = ta.disagreements(cases, first=ta.IN_GRAPH, second=ta.IN_GRAPH_EVENTS)
    assert compared == 3 and [d["case"] for d in big] == ["qkv M=8"]
    assert big[0]["first_best_under_second"] == pytest.approx(0.02)
    assert big[0]["gap"] == pytest.approx(0.03)
    assert ta.main([str(path)]) == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())  # a long title wraps
    assert "between CUPTI and events over all sets (medians): 1 of 3 cases" in words
    assert out.count(ta.EVENTS_ALL) == 2  # the regret table and the kind table
