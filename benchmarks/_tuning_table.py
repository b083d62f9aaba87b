"""The table and the printed summary lines of ``benchmarks/tuning.py`` (the scoring:
``_tuning_scores.py``); pure functions over its records and summary, unit-tested in
``tests/cpu/test_bench_tuning_helpers.py``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from _tuning_scores import IN_GRAPH, KERNEL_SUM, MODES, VIEWS_DIFFER, pct, short_tactic


def summary_lines(summary: dict[str, Any], modes: Sequence[str]) -> list[str]:
    """What ``benchmarks/tuning.py`` prints after the run: each target's verdict, the share any
    pick can reach, how often the two in-graph readings differ, and per mode the share of cases
    within 1% of the best and the largest regret under each truth, and the tuning time."""
    targets = summary.get("targets") or {}
    verdicts = {True: "pass", False: "FAIL", None: "n/a (not evaluated)"}
    lines = [f"target {t}: {verdicts[ok]}" for t, ok in targets.items()]
    if not targets:
        lines.insert(0, "targets: not evaluated (graph mode was not run)")
    lines.append(
        "cases where one candidate is within 1% of the best under both truths: "
        f"{summary['share_reachable_under_both_truths']:.1%} (the most any pick can reach)"
    )
    compared = summary.get("candidates_in_graph_cupti_vs_events_compared")
    if compared:
        lines.append(
            f"candidates whose in-graph time by CUPTI and by events differs by > "
            f"{VIEWS_DIFFER:.0%}: {summary['candidates_in_graph_cupti_vs_events_gt_5pct']} of "
            f"{compared} ({summary['candidates_in_graph_cupti_vs_events_gt_5pct_split_k']} "
            "split-K)"
        )
    for mode in modes:
        stats = summary[mode]
        views = [("kernel sum", ""), ("in-graph CUPTI", "_graph_truth")]
        if stats.get("cases_events_truth"):
            views.append(("in-graph events", "_events_truth"))
        shares = ", ".join(
            f"{name} {pct(stats.get(f'share_regret_le_1pct{s}'))} "
            f"(max regret {pct(stats.get(f'max_regret{s}'))})"
            for name, s in views
        )
        lines.append(f"{mode}: cases with every pick within 1% of the best: {shares}")
        if stats.get("median_ms_per_tactic") is not None:
            parts = ", ".join(
                f"{k} {v:.2f}" for k, v in stats.get("median_phase_ms_per_tactic", {}).items()
            )
            lines.append(
                f"{mode}: median {stats['median_ms_per_tactic']:.2f} ms per (tactic, bucket)"
                f" ({parts})"
            )
    return lines


def table(records: list[dict[str, Any]], modes: Sequence[str] = MODES) -> str:
    """The per-case table: both truths' best, each mode's worst regret under each truth (kernel
    sum, in-graph by CUPTI, in-graph by events)."""
    from graphtune.reporting import render_table

    columns = [
        "op",
        "M",
        "cands",
        "best (kernel sum)",
        "ks us",
        "best (in graph)",
        "ig us",
        "graph pick",
    ]
    for mode in modes:
        columns += [f"{mode} ks", f"{mode} ig", f"{mode} ev"]
    columns += ["agree " + "/".join(m[0] for m in modes), "rho g ks/ig", "ig noise", "ms/tactic g"]
    rows = []
    for r in records:
        if r.get("error"):
            row = [r["shape"], r["bucket"], "error", r["error"][:50]]
            rows.append(row + [None] * (len(columns) - len(row)))
            continue
        modes_rec = r["modes"]
        best, best_graph = r["best"], r.get("best_graph")
        graph_rec = modes_rec.get("graph") or {}
        picks = graph_rec.get("picks") or []
        row = [
            r["shape"],
            r["bucket"],
            r["n_candidates"],
            short_tactic(best["runner"], best["tactic"]),
            best[KERNEL_SUM],
            short_tactic(best_graph["runner"], best_graph["tactic"]) if best_graph else None,
            best_graph[IN_GRAPH] if best_graph else None,
            short_tactic(picks[0]["runner"], picks[0]["tactic"]) if picks else None,
        ]
        for mode in modes:
            m = modes_rec.get(mode) or {}
            if m.get("error") or not m:
                row += ["error"] * 3
            else:
                row += [pct(m.get(k)) for k in ("regret", "regret_graph", "regret_graph_events")]
        row.append(
            "/".join(
                "err"
                if (modes_rec.get(m) or {}).get("error") or not modes_rec.get(m)
                else ("all" if modes_rec[m]["agree"] else "no")
                for m in modes
            )
        )
        rho = r.get("spearman", {}).get("graph", {})
        row.append(
            "/".join(
                "-" if rho.get(k) is None else f"{rho[k]:.2f}"
                for k in ("kernel_sum_truth", "graph_truth")
            )
        )
        row.append(pct(r.get("truth_noise_graph")))
        ms = graph_rec.get("ms_per_tactic") or []
        row.append(statistics.median(ms) if ms else None)
        rows.append(row)
    runs = max(
        (len((r.get("modes", {}).get(m) or {}).get("picks") or []) for r in records for m in modes),
        default=0,
    )
    title = (
        f"Tuning picks vs CUPTI ground truth (worst of {runs} runs; ks = kernel sum, "
        "ig = in-graph span by CUPTI, ev = the same graph by CUDA events)"
    )
    return render_table(title, columns, rows, width=260)
