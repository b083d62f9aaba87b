"""Does the in-graph ground truth of ``benchmarks/tuning.py`` agree with itself, and how do the
tuner's picks score against each of its views?

Every candidate's truth graph is timed twice on each input set: by CUPTI under the profiler and
by CUDA events without the profiler. The first input set's two times are in its ``cupti_graph``
record (``per_call_us``, ``events_per_call_us``). The scored in-graph truth (``cupti_graph_us``)
is the CUPTI time's median over all input sets (``options.truth_sets``), so it equals the first
one only with a single set; results written since the events time was kept for every set also
hold its median (``cupti_graph_events_us``, the view "ig events (all sets)"), older ones only set
1's. Per result file this prints:

1. the cases where CUPTI and events, on the same graph, disagree on the best candidate by more
   than 1%: both bests, and how much each reads under the other view (on input set 1, and, where
   the file has them, between the medians over all sets);
2. per timing mode, the share of cases whose worst pick (over the runs) has regret <= 1%, and the
   largest regret, against each view: the scored CUPTI in-graph truth, CUPTI and events on the
   first input set, events over all sets (where the file has it), and the kernel sum;
3. per timing mode, the tuner's time over each in-graph view by candidate kind (:data:`KINDS`),
   each ratio divided by its case's median ratio over all candidates (which removes per-case
   offsets): the median (below 1, the tuner reads that kind fast relative to the rest) and the
   spread, the median distance of those ratios from 1 (how much the tuner and the truth disagree
   about one candidate against another of the same case).

    python3 benchmarks/truth_agreement.py benchmarks/results/tuning-full-fc3b150-h200.json [...]

A file that is not a tuning.py result gets a one-line error and exit status 1.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tuning_scores import (  # noqa: E402
    IN_GRAPH,
    IN_GRAPH_EVENTS,
    KERNEL_SUM,
    MODES,
    TARGET_REGRET,
    best_candidate,
    candidate_key,
    finite,
    pct,
    regret,
    short_tactic,
    worst,
)

from graphtune.cli._args import Parser  # noqa: E402
from graphtune.reporting import render_table  # noqa: E402

#: Fields added to each candidate (flattened from its ``cupti_graph`` record, first input set).
CUPTI_SET1, EVENTS_SET1 = "cupti_graph_set1_us", "events_graph_set1_us"
#: Every view of the truth: label -> candidate field.
VIEWS = {
    "ig CUPTI (scored)": IN_GRAPH,
    "ig CUPTI set 1": CUPTI_SET1,
    "ig events set 1": EVENTS_SET1,
    "kernel sum": KERNEL_SUM,
}
IN_GRAPH_VIEWS = ("ig CUPTI (scored)", "ig CUPTI set 1", "ig events set 1")
#: The events reading's median over all input sets: a view only where the file has it.
EVENTS_ALL = "ig events (all sets)"
KINDS = (
    "torch/cuBLAS",
    "Triton GEMM split 1",
    "Triton GEMM split > 1",
    "skinny GEMM",
    "GEMV split 1",
    "GEMV split > 1",
    "other",
)
#: Cases need this many candidates with both a tuner time and a truth for a kind ratio.
MIN_RATIO_CANDIDATES = 3


class NotAResult(ValueError):
    """The file is not a ``benchmarks/tuning.py`` result; the message says what is missing."""


def load(path: Path) -> dict[str, Any]:
    """The parsed result, checked for what this script reads; :class:`NotAResult` otherwise."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise NotAResult(f"cannot read it ({exc.strerror or exc})") from exc
    except ValueError as exc:
        raise NotAResult(f"not JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list):
        raise NotAResult("no 'cases' list (not a benchmarks/tuning.py result)")
    if not data["cases"]:
        raise NotAResult("'cases' is empty")
    for i, case in enumerate(data["cases"]):
        if not isinstance(case, dict):
            raise NotAResult(f"case {i} is not an object")
        if case.get("error"):
            continue
        for key, kind in (("candidates", list), ("modes", dict)):
            if not isinstance(case.get(key), kind):
                raise NotAResult(f"case {i} ({label(case)}) has no '{key}' {kind.__name__}")
        for j, cand in enumerate(case["candidates"]):
            _check_candidate(cand, f"candidate {j} of case {i} ({label(case)})")
        for mode, record in case["modes"].items():
            _check_mode(record, f"mode {mode!r} of case {i} ({label(case)})")
    return data


def _check_candidate(cand: Any, where: str) -> None:
    """What the report reads of one candidate: a runner name, an integer runner index, a tactic,
    and objects (or null) where it looks inside (``cupti_graph``, ``tuner_us``)."""
    if not isinstance(cand, dict):
        raise NotAResult(f"{where} is not an object")
    lacking = [k for k in ("runner", "runner_index", "tactic") if k not in cand]
    if lacking:
        raise NotAResult(f"{where} has no {lacking}")
    if not isinstance(cand["runner"], str):
        raise NotAResult(f"{where}: 'runner' is not a string")
    if not _is_index(cand["runner_index"]):
        raise NotAResult(f"{where}: 'runner_index' is not an integer")
    for key in ("cupti_graph", "tuner_us"):
        if cand.get(key) is not None and not isinstance(cand[key], dict):
            raise NotAResult(f"{where}: '{key}' is not an object or null")


def _check_mode(record: Any, where: str) -> None:
    """A mode's record: an object; unless it failed (``error``), its picks a list of objects
    with an integer ``runner_index`` and a ``tactic``."""
    if not isinstance(record, dict):
        raise NotAResult(f"{where} is not an object")
    if record.get("error"):
        return
    picks = record.get("picks")
    if picks is None:
        return  # scored as a failed mode (no picks), as the report does for an error
    if not isinstance(picks, list):
        raise NotAResult(f"{where}: 'picks' is not a list")
    for k, p in enumerate(picks):
        if not isinstance(p, dict) or "tactic" not in p or not _is_index(p.get("runner_index")):
            raise NotAResult(f"{where}: pick {k} lacks an integer 'runner_index' and a 'tactic'")


def _is_index(value: Any) -> bool:
    # candidate_key() calls int() on it; a bool or a float would pass int() but is no index.
    return isinstance(value, int) and not isinstance(value, bool)


def label(case: dict[str, Any]) -> str:
    return f"{case.get('shape', case.get('op', '?'))} M={case.get('bucket', '?')}"


def with_views(candidates: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the candidates with the first input set's CUPTI and events times as fields."""
    out = []
    for cand in candidates:
        graph = cand.get("cupti_graph") or {}
        out.append(
            {
                **cand,
                CUPTI_SET1: graph.get("per_call_us"),
                EVENTS_SET1: graph.get("events_per_call_us"),
            }
        )
    return out


def ok_cases(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The cases without an error, their candidates carrying every view's field."""
    return [
        {**case, "candidates": with_views(case["candidates"])}
        for case in data["cases"]
        if not case.get("error")
    ]


def has_events_truth(cases: Sequence[dict[str, Any]]) -> bool:
    """Whether any candidate has the all-set events reading (files written since it is kept)."""
    return any(finite(c.get(IN_GRAPH_EVENTS)) for case in cases for c in case["candidates"])


def views_of(cases: Sequence[dict[str, Any]]) -> dict[str, str]:
    """:data:`VIEWS`, with :data:`EVENTS_ALL` after the set-1 events view where the file has it."""
    if not has_events_truth(cases):
        return dict(VIEWS)
    views = {}
    for name, field in VIEWS.items():
        views[name] = field
        if name == "ig events set 1":
            views[EVENTS_ALL] = IN_GRAPH_EVENTS
    return views


def modes_of(cases: Sequence[dict[str, Any]]) -> list[str]:
    """The timing modes recorded in any case, in the benchmark's order."""
    seen = {mode for case in cases for mode in case["modes"]}
    return [m for m in MODES if m in seen] + sorted(seen - set(MODES))


def disagreement(
    case: dict[str, Any], first: str = CUPTI_SET1, second: str = EVENTS_SET1
) -> dict[str, Any] | None:
    """Both views' best candidates and how each reads under the other view, or ``None`` when a
    view has no timed candidate. ``gap`` is the larger of the two cross regrets."""
    cands = case["candidates"]
    best_a, best_b = best_candidate(cands, first), best_candidate(cands, second)
    if best_a is None or best_b is None:
        return None
    a_under_b = regret(best_a.get(second), best_b[second])
    b_under_a = regret(best_b.get(first), best_a[first])
    return {
        "case": label(case),
        "best_first": best_a,
        "best_second": best_b,
        "first_best_under_second": a_under_b,
        "second_best_under_first": b_under_a,
        "gap": max(a_under_b, b_under_a),
    }


def disagreements(
    cases: Sequence[dict[str, Any]],
    threshold: float = TARGET_REGRET,
    first: str = CUPTI_SET1,
    second: str = EVENTS_SET1,
) -> tuple[int, list[dict[str, Any]]]:
    """``(cases with both views, those whose bests differ by more than threshold)``, the
    largest gap first."""
    found = [d for d in (disagreement(c, first, second) for c in cases) if d is not None]
    big = [d for d in found if d["gap"] > threshold]
    return len(found), sorted(big, key=lambda d: d["gap"], reverse=True)


def pick_regret(case: dict[str, Any], mode: str, field: str) -> float | None:
    """The worst regret of the mode's picks against ``field``; ``None`` when the view has no
    best in this case, ``inf`` when the mode failed or a pick has no time under the view."""
    best = best_candidate(case["candidates"], field)
    if best is None or best[field] <= 0:
        return None
    record = case["modes"].get(mode)
    if not record or record.get("error") or not record.get("picks"):
        return float("inf")
    by_key = {candidate_key(c["runner_index"], c["tactic"]): c for c in case["candidates"]}
    return worst(
        [
            regret(
                by_key.get(candidate_key(p["runner_index"], p["tactic"]), {}).get(field),
                best[field],
            )
            for p in record["picks"]
        ]
    )


def regret_summary(cases: Sequence[dict[str, Any]], mode: str, field: str) -> dict[str, Any]:
    """Cases scored, the share with regret <= 1%, and the largest regret, against ``field``."""
    regrets = [r for r in (pick_regret(c, mode, field) for c in cases) if r is not None]
    return {
        "cases": len(regrets),
        "share_le_1pct": sum(r <= TARGET_REGRET for r in regrets) / len(regrets)
        if regrets
        else None,
        "max": max(regrets, default=None),
    }


def kind_of(runner: str, tactic: Any) -> str:
    """The candidate kind from the stored runner name and tactic (see :data:`KINDS`)."""
    name = runner.split("[")[0]
    if name.startswith("Torch"):
        return "torch/cuBLAS"
    split = tactic.get("split_k", 1) if isinstance(tactic, dict) else 1
    if name == "TritonGemmRunner":
        return "Triton GEMM split 1" if split == 1 else "Triton GEMM split > 1"
    if name == "TritonSkinnyGemmRunner":
        return "skinny GEMM"
    if name == "TritonGemvRunner":
        return "GEMV split 1" if split == 1 else "GEMV split > 1"
    return "other"


def kind_ratios(
    cases: Sequence[dict[str, Any]], mode: str, field: str
) -> dict[str, tuple[int, float, float]]:
    """Per kind: ``(candidates, median, spread)`` of the case-normalised ``tuner_us[mode] /
    field``: the median says whether the tuner reads the kind fast or slow against the rest; the
    spread, the median of ``|ratio - 1|``, how far it reads one candidate against another where
    the truth does not (what can reorder near-ties, whatever the median).

    In each case with at least :data:`MIN_RATIO_CANDIDATES` candidates that have both times,
    every ratio is divided by the case's median ratio.
    """
    by_kind: dict[str, list[float]] = {}
    for case in cases:
        rows = []
        for cand in case["candidates"]:
            tuner, truth = (cand.get("tuner_us") or {}).get(mode), cand.get(field)
            if finite(tuner) and finite(truth) and truth > 0:
                rows.append((kind_of(cand["runner"], cand["tactic"]), tuner / truth))
        if len(rows) < MIN_RATIO_CANDIDATES:
            continue
        middle = statistics.median(ratio for _, ratio in rows)
        for kind, ratio in rows:
            by_kind.setdefault(kind, []).append(ratio / middle)
    return {
        k: (
            len(v),
            statistics.median(v),
            statistics.median(abs(ratio - 1.0) for ratio in v),
        )
        for k in KINDS
        if (v := by_kind.get(k))
    }


def report(path: Path, data: dict[str, Any]) -> str:
    """The three tables for one result file."""
    cases = ok_cases(data)
    prov = data.get("provenance") or {}
    sets = (data.get("options") or {}).get("truth_sets", "?")
    head = (
        f"== {path}: {len(cases)} cases without error (of {len(data['cases'])}), "
        f"commit {prov.get('commit', '?')}, truth sets {sets}"
    )
    parts = [head]

    views = views_of(cases)
    pairs = [("on input set 1", CUPTI_SET1, EVENTS_SET1)]
    if EVENTS_ALL in views:
        pairs.append(("over all sets (medians)", IN_GRAPH, IN_GRAPH_EVENTS))
    for where, first, second in pairs:
        compared, big = disagreements(cases, TARGET_REGRET, first, second)
        rows = [
            [
                d["case"],
                short_tactic(d["best_first"]["runner"], d["best_first"]["tactic"]),
                pct(d["first_best_under_second"]),
                short_tactic(d["best_second"]["runner"], d["best_second"]["tactic"]),
                pct(d["second_best_under_first"]),
            ]
            for d in big
        ]
        parts.append(
            render_table(
                f"In-graph bests that differ by > 1% between CUPTI and events {where}: "
                f"{len(big)} of {compared} cases",
                ["case", "CUPTI best", "its events regret", "events best", "its CUPTI regret"],
                rows,
                width=160,
            )
        )

    rows = []
    for mode in modes_of(cases):
        for name, field in views.items():
            s = regret_summary(cases, mode, field)
            rows.append([mode, name, s["cases"], pct(s["share_le_1pct"]), pct(s["max"])])
    parts.append(
        render_table(
            "Pick regret (worst run per case) against each view",
            ["mode", "view", "cases", "regret <= 1%", "max regret"],
            rows,
        )
    )

    in_graph_views = [n for n in views if n.startswith("ig ")]
    rows = []
    for mode in modes_of(cases):
        ratios = [kind_ratios(cases, mode, views[name]) for name in in_graph_views]
        for kind in KINDS:
            counts = {r[kind][0] for r in ratios if kind in r}
            rows.append(
                [mode, kind, "/".join(map(str, sorted(counts))) or "0"]
                + [
                    f"{r[kind][1]:.4f} ±{100 * r[kind][2]:.2f}%" if kind in r else None
                    for r in ratios
                ]
            )
    parts.append(
        render_table(
            "Tuner time / in-graph truth by candidate kind, case-normalised (< 1: read fast); "
            "± the median distance from 1",
            ["mode", "kind", "n", *in_graph_views],
            rows,
        )
    )
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="benchmarks/tuning.py result JSONs")
    args = parser.parse_args(argv)
    loaded = []
    for path in args.results:
        try:
            loaded.append((path, load(path)))
        except NotAResult as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            return 1
    print("\n\n".join(report(path, data) for path, data in loaded))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
