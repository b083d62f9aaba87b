"""benchmarks/tuning.py's targets when the data to judge them is missing (_tuning_scores.py):
never a pass. The records are built by test_bench_tuning_helpers.py's helpers."""

from __future__ import annotations

import pytest
from test_bench_tuning_helpers import case_record, mode_record, scores, tuning_table


def test_a_target_without_data_is_not_evaluated_and_fails_all_pass():
    # Graph mode failed in every case: no time, no agreement to judge. The regret targets fail
    # (a failed mode is infinite regret); the rest are None ("n/a"), never a pass.
    records = [case_record({"error": "RuntimeError: boom"}) for _ in range(3)]
    summary = scores.summarize(records, ("graph",))
    targets = summary["targets"]
    assert summary["graph"]["median_ms_per_tactic"] is None
    assert targets["graph_median_ms_per_tactic_le_10"] is None  # was True: None read as 0 ms
    assert targets["graph_same_pick_3of3_in_95pct"] is None
    assert targets["graph_regret_never_gt_5pct"] is False
    assert summary["all_pass"] is False and summary["all_pass_graph_truth"] is False
    assert "graph_median_ms_per_tactic_le_10" in summary["targets_not_evaluated"]
    lines = tuning_table.summary_lines(summary, ("graph",))
    assert "target graph_median_ms_per_tactic_le_10: n/a (not evaluated)" in lines

    # Only errored cases: no regret at all (max_regret None was read as 0 and passed).
    summary = scores.summarize([{"error": "OOM", "modes": {}, "shape": "x", "bucket": 1}])
    assert summary["graph"]["max_regret"] is None
    assert summary["targets"]["graph_regret_never_gt_5pct"] is None
    assert summary["targets"]["graph_regret_never_gt_5pct_graph_truth"] is None
    assert summary["all_pass"] is False


@pytest.mark.parametrize(("runs", "evaluated"), [(1, False), (2, False), (3, True), (5, True)])
def test_the_agreement_targets_need_three_runs(runs, evaluated):
    record = mode_record(0.0, 0.0)
    record["picks"] = [{}] * runs  # one run "agrees" with itself by construction
    summary = scores.summarize([case_record(record) for _ in range(20)], ("graph",))
    targets = summary["targets"]
    for key in ("graph_same_pick_3of3_in_95pct", "graph_at_most_1_case_without_the_same_pick"):
        assert targets[key] is (True if evaluated else None)
    assert summary["all_pass"] is evaluated and summary["all_pass_graph_truth"] is evaluated
