"""benchmarks/tuning.py's scoring (_tuning_scores.py), without a GPU.

The pure helpers (Spearman, regret under both truths, summary and targets, what the tuner
measured) run on synthetic data; the options and the GPU paths against fakes are in
test_bench_tuning_run.py. The toolkit they measure with (graphtune.bench) is tested in
test_bench_toolkit.py.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import _tuning_scores as scores  # noqa: E402
import _tuning_table as tuning_table  # noqa: E402

SPLIT_K = {"bm": 16, "bn": 32, "bk": 128, "warps": 4, "stages": 4, "split_k": 4}


# --- Spearman, regret, worst -------------------------------------------------------------------


def test_spearman_known_values():
    assert scores.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert scores.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ties share the mean rank: x ranks (1, 2.5, 2.5, 4), y ranks (1, 3, 2, 4).
    assert scores.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(22.5))
    # Monotone but not linear: ranks are what counts.
    assert scores.spearman([1, 2, 3], [1, 100, 101]) == pytest.approx(1.0)


def test_spearman_drops_missing_pairs_and_undefined_cases():
    assert scores.spearman([1, 2, math.inf, 3, None], [3, 2, 1, 1, 5]) == pytest.approx(-1.0)
    assert scores.spearman([1, 1, 1], [1, 2, 3]) is None  # constant side
    assert scores.spearman([1, math.nan], [1, 2]) is None  # fewer than two pairs
    assert scores.spearman([], []) is None
    with pytest.raises(ValueError):
        scores.spearman([1, 2], [1])


def test_truth_noise_is_the_median_relative_range_over_input_sets():
    truth = [
        {"cupti_graph_us_sets": [10.0, 10.2, 10.1]},  # 2% range
        {"cupti_graph_us_sets": [5.0, 5.05, 5.0]},  # 1%
        {"cupti_graph_us_sets": [1.0, 1.04, 1.0]},  # 4%
        {"cupti_graph_us_sets": [math.inf, 2.0]},
    ]  # one usable value: skipped
    assert scores.truth_noise(truth) == pytest.approx(0.2 / 10.1)  # the middle one, 2%
    assert scores.truth_noise([{"cupti_graph_us_sets": [3.0]}]) is None
    kernel_sum = [{"cupti_us_sets": [1.0, 1.1]}]
    assert scores.truth_noise(kernel_sum, "cupti_us") == pytest.approx(0.1 / 1.05)


def test_regret_and_worst():
    assert scores.regret(4.78, 4.61) == pytest.approx(4.78 / 4.61 - 1)
    assert scores.regret(4.61, 4.61) == 0.0
    assert scores.regret(math.inf, 4.61) == math.inf  # the pick failed under this truth
    assert scores.regret(None, 4.61) == math.inf
    assert math.isnan(scores.regret(4.61, math.inf))  # no truth for the case
    assert math.isnan(scores.regret(4.61, None))
    assert scores.worst([0.0, 0.02, 0.01]) == 0.02
    assert scores.worst([0.0, math.inf]) == math.inf
    # nan wins whatever its position (plain max() would not be order independent).
    assert math.isnan(scores.worst([math.nan, 0.0]))
    assert math.isnan(scores.worst([0.0, math.nan]))


# --- scoring picks against both truths ---------------------------------------------------------


def split_k_truth() -> list[dict[str, Any]]:
    """The o_proj M=16 situation: split-K wins by kernel sum, cuBLAS in the graph."""
    return [
        {
            "runner": "TorchGemmRunner",
            "runner_index": 0,
            "tactic": -1,
            "cupti_us": 4.78,
            "cupti_graph_us": 5.00,
        },
        {
            "runner": "TritonGemmRunner",
            "runner_index": 1,
            "tactic": dict(SPLIT_K),
            "cupti_us": 4.61,
            "cupti_graph_us": 5.40,
        },
        {
            "runner": "TritonGemmRunner",
            "runner_index": 1,
            "tactic": dict(SPLIT_K, split_k=1),
            "cupti_us": 6.0,
            "cupti_graph_us": 6.2,
        },
        {
            "runner": "TritonGemmRunner",
            "runner_index": 1,
            "tactic": [8, 2],
            "cupti_us": math.inf,
            "cupti_graph_us": math.inf,
        },
    ]


def test_score_picks_against_both_truths():
    truth = split_k_truth()
    assert scores.best_candidate(truth, "cupti_us")["runner_index"] == 1
    assert scores.best_candidate(truth, "cupti_graph_us")["runner_index"] == 0
    reordered = dict(reversed(list(SPLIT_K.items())))  # key order must not matter
    picks = [
        {"runner_index": 0, "tactic": -1},
        {"runner_index": 1, "tactic": reordered},
        {"runner_index": 1, "tactic": (8, 2)},  # a tuple tactic matches its JSON list
        {"runner_index": 1, "tactic": "unknown"},
    ]
    regrets, regrets_graph = scores.score_picks(picks, truth)
    assert regrets[:2] == pytest.approx([4.78 / 4.61 - 1, 0.0])
    assert regrets_graph[:2] == pytest.approx([0.0, 5.40 / 5.00 - 1])
    assert regrets[2:] == [math.inf, math.inf]
    assert regrets_graph[2:] == [math.inf, math.inf]


def test_score_picks_without_graph_truth_gives_nan():
    truth = [dict(t, cupti_graph_us=math.inf) for t in split_k_truth()]
    regrets, regrets_graph = scores.score_picks([{"runner_index": 0, "tactic": -1}], truth)
    assert regrets == pytest.approx([4.78 / 4.61 - 1])
    assert math.isnan(regrets_graph[0])


# --- summary and targets -----------------------------------------------------------------------


def mode_record(
    regret: float, regret_graph: float, agree: bool = True, ms: float = 10.0
) -> dict[str, Any]:
    return {
        "regret": regret,
        "regret_graph": regret_graph,
        "agree": agree,
        "ms_per_tactic": [ms, ms],
        "picks": [{}, {}, {}],
    }


def case_record(
    graph: dict[str, Any],
    *,
    best_graph: bool = True,
    rho: tuple[float | None, float | None] = (0.5, 0.9),
) -> dict[str, Any]:
    return {
        "op": "gemm",
        "shape": "o_proj 2048->2048",
        "bucket": 16,
        "error": None,
        "best_graph": {"runner": "TorchGemmRunner", "tactic": -1} if best_graph else None,
        "modes": {"graph": graph, "events": mode_record(0.0, 0.0, ms=50.0)},
        "spearman": {"graph": {"kernel_sum_truth": rho[0], "graph_truth": rho[1]}},
    }


def test_summary_reports_both_truths_and_separate_targets():
    # 19 cases perfect under the in-graph truth but 3.7% off by kernel sum (the split-K
    # pattern), one case perfect by kernel sum and 2% off in the graph.
    records = [case_record(mode_record(0.037, 0.0)) for _ in range(19)]
    records.append(case_record(mode_record(0.0, 0.02)))
    summary = scores.summarize(records, ("graph", "events"))
    graph = summary["graph"]
    assert graph["share_regret_le_1pct"] == pytest.approx(1 / 20)
    assert graph["max_regret"] == pytest.approx(0.037)
    assert graph["share_regret_le_1pct_graph_truth"] == pytest.approx(19 / 20)
    assert graph["max_regret_graph_truth"] == pytest.approx(0.02)
    assert graph["mean_regret_graph_truth"] == pytest.approx(0.02 / 20)
    assert graph["cases_graph_truth"] == 20
    assert graph["median_spearman_kernel_sum_truth"] == pytest.approx(0.5)
    assert graph["median_spearman_graph_truth"] == pytest.approx(0.9)
    targets = summary["targets"]
    assert targets["graph_regret_le_1pct_in_95pct"] is False
    assert targets["graph_regret_never_gt_5pct"] is True
    assert targets["graph_regret_le_1pct_in_95pct_graph_truth"] is True
    assert targets["graph_regret_never_gt_5pct_graph_truth"] is True
    assert summary["all_pass"] is False  # decided by the kernel-sum truth, as before
    assert summary["all_pass_graph_truth"] is True
    assert summary["events"]["median_ms_per_tactic"] == 50.0
    assert "wallclock" not in summary  # only the modes given
    # The default is all three; a mode a case has no record of counts as failed there.
    assert scores.summarize(records)["wallclock"]["mode_errors"] == 20


def test_within_both_truths_bounds_what_any_pick_can_reach():
    # a wins by kernel sum by 5%, b in the graph by 5%: no pick is within 1% of both.
    a = {"cupti_us": 1.00, "cupti_graph_us": 1.05}
    b = {"cupti_us": 1.05, "cupti_graph_us": 1.00}
    assert scores.within_both_truths([a, b]) is False
    assert scores.within_both_truths([a, b], tolerance=0.06) is True
    assert scores.within_both_truths([a, b, {"cupti_us": 1.005, "cupti_graph_us": 1.008}])
    assert scores.within_both_truths([{"cupti_us": 1.0, "cupti_graph_us": None}])
    disagree = case_record(mode_record(0.0, 0.0))
    disagree["candidates"] = [a, b]
    agree = case_record(mode_record(0.0, 0.0))
    agree["candidates"] = [a]
    summary = scores.summarize([disagree, agree, agree, agree], ("graph",))
    assert summary["share_reachable_under_both_truths"] == pytest.approx(3 / 4)


def test_summary_graph_truth_needs_every_case_and_counts_failures():
    records = [case_record(mode_record(0.0, 0.0)) for _ in range(20)]
    records.append(case_record(mode_record(0.0, math.nan), best_graph=False))
    summary = scores.summarize(records, ("graph",))
    graph = summary["graph"]
    assert graph["cases_graph_truth"] == 20  # the case without in-graph truth is left out
    assert graph["share_regret_le_1pct_graph_truth"] == 1.0
    assert summary["cases_without_graph_truth"] == 1
    assert summary["all_pass"] is True
    assert summary["all_pass_graph_truth"] is False  # but a missing truth is not a pass

    # A failed mode counts as infinite regret and disagreement; an errored case as an error.
    records = [case_record(mode_record(0.0, 0.0)) for _ in range(19)]
    records.append(case_record({"error": "CaptureError: boom"}))
    records.append({"op": "gemm", "shape": "x", "bucket": 1, "error": "OOM", "modes": {}})
    summary = scores.summarize(records, ("graph",))
    graph = summary["graph"]
    assert summary["errors"] == 1
    assert graph["mode_errors"] == 1
    assert graph["max_regret"] == math.inf
    assert graph["max_regret_graph_truth"] == math.inf
    assert graph["share_agree_3of3"] == pytest.approx(19 / 20)
    assert summary["targets"]["graph_regret_never_gt_5pct"] is False
    assert summary["all_pass"] is False and summary["all_pass_graph_truth"] is False


def test_summary_without_graph_mode_evaluates_no_target():
    records = [case_record(mode_record(0.0, 0.0))]
    summary = scores.summarize(records, ("events",))
    assert summary["targets"] == {}
    assert summary["all_pass"] is None and summary["all_pass_graph_truth"] is None
    assert summary["events"]["share_regret_le_1pct"] == 1.0


def test_table_shows_both_truths():
    records = [case_record(mode_record(0.037, 0.0))]
    records[0].update(
        n_candidates=4,
        best={"runner": "TritonGemmRunner", "tactic": SPLIT_K, "cupti_us": 4.61},
        best_graph={"runner": "TorchGemmRunner", "tactic": -1, "cupti_graph_us": 5.0},
    )
    records[0]["modes"]["graph"]["picks"] = [{"runner": "TorchGemmRunner", "tactic": -1}] * 3
    records.append(
        {"op": "gemm", "shape": "qkv", "bucket": 1, "error": "RuntimeError: x", "modes": {}}
    )
    text = scores.table(records, ("graph", "events"))
    assert "graph ks" in text and "graph ig" in text and "events ig" in text
    assert "3.7%" in text and "0.0%" in text
    assert "TritonGemm 16x32x128 w4 s4 k4" in text and "TorchGemm -1" in text
    assert "0.50/0.90" in text
    assert "RuntimeError: x" in text


# --- what the tuner measured -------------------------------------------------------------------


def fake_profile(op: str = "gemm") -> SimpleNamespace:
    cands = (
        SimpleNamespace(
            runner_index=0,
            tactic=-1,
            median_us=5.02,
            spread=0.01,
            samples=9,
            failed=None,
            tied=True,
        ),
        SimpleNamespace(
            runner_index=1,
            tactic=dict(reversed(list(SPLIT_K.items()))),
            median_us=5.45,
            spread=0.03,
            samples=6,
            failed=None,
            tied=False,
        ),
        SimpleNamespace(
            runner_index=1,
            tactic=[8, 2],
            median_us=math.inf,
            spread=0.0,
            samples=0,
            failed="RuntimeError",
            tied=False,
        ),
        SimpleNamespace(
            runner_index=2, tactic=-1, median_us=1.0, spread=0.0, samples=3, failed=None, tied=False
        ),  # not among the truth candidates
    )
    return SimpleNamespace(op=op, candidates=cands, winner_index=0, tie_band=0.012)


def test_last_profile_is_guarded():
    assert scores.last_profile(object(), "gemm") is None  # an old tuner without history
    assert scores.last_profile(SimpleNamespace(history=[]), "gemm") is None
    profile = fake_profile()
    assert scores.last_profile(SimpleNamespace(history=[profile]), "gemm") is profile
    assert scores.last_profile(SimpleNamespace(history=[profile]), "rms_norm") is None


def test_attach_tuner_times_and_rank_correlations():
    truth = split_k_truth()
    unmatched = scores.attach_tuner_times(truth, "graph", fake_profile())
    assert unmatched == 1
    assert truth[0]["tuner_us"] == {"graph": 5.02}
    assert truth[0]["tuner_spread"] == {"graph": 0.01}
    assert truth[0]["tuner_detail"]["graph"] == {"samples": 9, "failed": None, "tied": True}
    assert truth[1]["tuner_us"] == {"graph": 5.45}  # matched despite another key order
    assert truth[3]["tuner_detail"]["graph"]["failed"] == "RuntimeError"
    assert "tuner_us" not in truth[2]  # the tuner did not report it
    rho = scores.rank_correlations(truth, ("graph", "events"))
    assert set(rho) == {"graph"}  # no tuner times for events
    # Finite pairs: cuBLAS (5.02 vs 4.78 / 5.00) and split-K (5.45 vs 4.61 / 5.40).
    assert rho["graph"]["kernel_sum_truth"] == pytest.approx(-1.0)
    assert rho["graph"]["graph_truth"] == pytest.approx(1.0)


def test_real_profile_record_matches_when_the_tuner_has_history():
    selection = pytest.importorskip("graphtune.autotuner.selection")
    record = selection.ProfileRecord(
        op="gemm",
        profile="(16, 2048)",
        candidates=(
            selection.candidate_record("TorchGemmRunner", 0, -1, [5.0, 5.1, 4.9], None, True),
            selection.candidate_record(
                "TritonGemmRunner", 1, dict(SPLIT_K), [5.5, 5.4], None, False
            ),
        ),
        winner_index=0,
        tie_band=0.02,
    )
    truth = split_k_truth()
    assert scores.attach_tuner_times(truth, "events", record) == 0
    assert truth[0]["tuner_us"]["events"] == pytest.approx(5.0)
    assert truth[1]["tuner_detail"]["events"]["samples"] == 2


def test_short_tactic_labels_every_runner_family():
    gemm = {"bm": 16, "bn": 64, "bk": 256, "warps": 4, "stages": 3, "split_k": 4}
    assert scores.short_tactic("TritonGemmRunner", gemm) == "TritonGemm 16x64x256 w4 s3 k4"
    gemv = {"bn": 8, "bk": 512, "warps": 4, "split_k": 2}  # has split_k but no bm / stages
    assert scores.short_tactic("TritonGemvRunner", gemv) == "TritonGemv 8x512 w4 k2"
    assert scores.short_tactic("TorchGemmRunner", -1) == "TorchGemm -1"


# --- the events reading of the in-graph graph ---------------------------------------------------


def test_regrets_against_the_events_truth_and_the_views_that_differ():
    truth = split_k_truth()
    # Events read split-K 10% under its CUPTI time (the fastest by events), the rest alike.
    for t, events in zip(truth, (5.02, 4.90, 6.21, math.inf), strict=True):
        t["cupti_graph_events_us"] = events
    picks = [{"runner_index": 0, "tactic": -1}, {"runner_index": 1, "tactic": dict(SPLIT_K)}]
    assert scores.regrets_against(picks, truth, "cupti_graph_events_us") == pytest.approx(
        [5.02 / 4.90 - 1, 0.0]
    )
    assert scores.score_picks(picks, truth)[1] == pytest.approx([0.0, 5.40 / 5.00 - 1])
    # Three candidates have both readings; split-K's differ by 10%, the others' by < 1%.
    assert scores.views_differ(truth) == (3, 1, 1)
    assert scores.views_differ(truth, tolerance=0.2) == (3, 0, 0)
    truth[0]["cupti_graph_events_us"] = 4.0  # a one-kernel cuBLAS call that reads apart
    assert scores.views_differ(truth) == (3, 2, 1)
    assert scores.views_differ(split_k_truth()) == (0, 0, 0)  # an old result: nothing to compare


@pytest.mark.parametrize(
    ("tactic", "split"),
    [
        (dict(SPLIT_K), True),
        (dict(SPLIT_K, split_k=1), False),
        ({"bn": 64, "bk": 128, "warps": 4, "dot": 1, "stages": 4, "split": 2}, True),
        ({"bn": 64, "bk": 128, "warps": 4, "dot": 1, "stages": 4, "split": 1}, False),
        ({"block": 1024, "warps": 4}, False),
        (-1, False),
    ],
)
def test_is_split_k(tactic, split):
    assert scores.is_split_k(tactic) is split


def with_events(record: dict[str, Any], regret_events: float, best: bool = True) -> dict[str, Any]:
    """``record`` with an events truth (``best``) and graph mode's worst regret against it."""
    record["best_graph_events"] = (
        {"runner": "TritonGemmRunner", "tactic": SPLIT_K} if best else None
    )
    record["modes"]["graph"]["regret_graph_events"] = regret_events
    record["truth_noise_graph_events"] = 0.03
    return record


def test_summary_scores_the_events_truth_beside_the_cupti_one():
    # 18 cases right under every in-graph view; 2 where CUPTI reads the split-K best slow (the
    # pick is 2.5% off by events, exact by CUPTI), one of them inside the events truth's noise.
    records = [with_events(case_record(mode_record(0.0, 0.0)), 0.0) for _ in range(18)]
    records += [with_events(case_record(mode_record(0.0, 0.0)), r) for r in (0.025, 0.04)]
    summary = scores.summarize(records, ("graph",))
    graph = summary["graph"]
    assert graph["share_regret_le_1pct_events_truth"] == pytest.approx(18 / 20)
    assert graph["max_regret_events_truth"] == pytest.approx(0.04)
    assert graph["mean_regret_events_truth"] == pytest.approx(0.065 / 20)
    assert graph["cases_events_truth"] == 20
    assert graph["misses_within_truth_noise_events_truth"] == 1  # 2.5% <= 3%, 4% is not
    targets = summary["targets"]
    assert targets["graph_regret_le_1pct_in_95pct_events_truth"] is False
    assert targets["graph_regret_never_gt_5pct_events_truth"] is True
    assert targets["graph_regret_never_gt_2pct_events_truth"] is False
    assert summary["all_pass_graph_truth"] is True  # the CUPTI truth still decides it
    assert summary["all_pass_events_truth"] is False
    assert scores.EVENTS_TRUTH_TARGETS == (
        "graph_regret_le_1pct_in_95pct_events_truth",
        "graph_regret_never_gt_5pct_events_truth",
        "graph_regret_never_gt_2pct_events_truth",
        "graph_same_pick_3of3_in_95pct",
        "graph_at_most_1_case_without_the_same_pick",
        "graph_median_ms_per_tactic_le_10",
    )
    # Every case within 1% by events: it passes; a case without the events truth fails it.
    records = [with_events(case_record(mode_record(0.0, 0.0)), 0.0) for _ in range(20)]
    assert scores.summarize(records, ("graph",))["all_pass_events_truth"] is True
    records.append(with_events(case_record(mode_record(0.0, 0.0)), math.nan, best=False))
    summary = scores.summarize(records, ("graph",))
    assert summary["graph"]["cases_events_truth"] == 20
    assert summary["cases_without_events_truth"] == 1
    assert summary["all_pass_events_truth"] is False
    # A failed graph mode counts as infinite regret under the events truth too.
    records[0]["modes"]["graph"] = {"error": "CaptureError: boom"}
    assert scores.summarize(records, ("graph",))["graph"]["max_regret_events_truth"] == math.inf


def test_summary_without_the_events_truth_is_as_before():
    records = [case_record(mode_record(0.0, 0.0)) for _ in range(20)]
    summary = scores.summarize(records, ("graph",))
    assert summary["all_pass_graph_truth"] is True and summary["all_pass_events_truth"] is None
    assert not any(t.endswith("_events_truth") for t in summary["targets"])
    assert summary["graph"]["cases_events_truth"] == 0
    assert summary["graph"]["share_regret_le_1pct_events_truth"] is None
    assert summary["candidates_in_graph_cupti_vs_events_gt_5pct"] == 0
    assert scores.summarize(records, ("events",))["all_pass_events_truth"] is None


def test_summary_lines_carry_every_truth():
    records = [with_events(case_record(mode_record(0.037, 0.0)), 0.025)]
    records[0]["candidates"] = [
        {"tactic": dict(SPLIT_K), "cupti_graph_us": 5.4, "cupti_graph_events_us": 4.9},
        {"tactic": -1, "cupti_graph_us": 5.0, "cupti_graph_events_us": 5.02},
    ]
    summary = scores.summarize(records, ("graph", "events"))
    lines = tuning_table.summary_lines(summary, ("graph", "events"))
    assert "target graph_regret_never_gt_2pct_events_truth: FAIL" in lines
    assert "target graph_regret_never_gt_2pct_graph_truth: pass" in lines
    assert (
        "graph: cases with every pick within 1% of the best: kernel sum 0.0% (max regret 3.7%), "
        "in-graph CUPTI 100.0% (max regret 0.0%), in-graph events 0.0% (max regret 2.5%)"
    ) in lines
    assert any(ln.startswith("graph: median 10.00 ms per (tactic, bucket)") for ln in lines)
    assert "candidates whose in-graph time by CUPTI and by events differs by > 5%: 1 of 2 " in (
        "\n".join(lines)
    )
    # events mode has no events-truth regret in these records: it scores inf there.
    assert any(ln.startswith("events: cases with every pick") for ln in lines)
    no_graph = tuning_table.summary_lines(scores.summarize(records, ("events",)), ("events",))
    assert no_graph[0] == "targets: not evaluated (graph mode was not run)"
