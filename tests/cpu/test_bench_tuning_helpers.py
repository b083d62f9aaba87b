"""benchmarks/tuning.py (and its scoring, _tuning_scores.py), without a GPU.

The pure helpers (Spearman, regret under both truths, summary and targets, option errors) run on
synthetic data. The GPU paths (``run_case``, ``main``) run against fakes of CUPTI and the timer,
so their control flow, bookkeeping and output are checked here before the script reaches the
H200. The toolkit they measure with (graphtune.bench) is tested in test_bench_toolkit.py.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import _tuning_scores as scores  # noqa: E402
import tuning as bench  # noqa: E402

from graphtune.autotuner import (  # noqa: E402
    AutoTuner,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
)
from graphtune.autotuner.timing.base import Measurement  # noqa: E402

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


# --- options -----------------------------------------------------------------------------------


def test_parse_args_defaults_and_values():
    args = bench.parse_args([])
    assert args.modes == scores.MODES and args.runs == 3
    assert args.tie_tolerance is None and args.cupti_graph_replays == 20
    assert bench.tuner_kwargs(args) == {}
    args = bench.parse_args(
        [
            "--modes",
            " events,graph,events ",
            "--runs",
            "5",
            "--tie-tolerance",
            "0.01",
            "--cupti-graph-replays",
            "7",
        ]
    )
    assert args.modes == ("events", "graph")
    assert bench.tuner_kwargs(args) == {"tie_tolerance": 0.01}
    opts = bench.options(args)
    assert opts["modes"] == ["events", "graph"] and opts["runs"] == 5
    assert opts["tie_tolerance"] == 0.01 and opts["cupti_graph_replays"] == 7
    json.dumps(opts)  # goes into the result file


def test_variants_are_extra_graph_modes_with_their_own_tuner_keywords():
    args = bench.parse_args(
        [
            "--modes",
            "graph",
            "--tie-tolerance",
            "0.01",
            "--variant",
            "sets3:input_sets=3,tie_floor_us=0.02",
            "--variant",
            "plain:",
            "--truth-sets",
            "2",
        ]
    )
    assert args.modes == ("graph", "sets3", "plain") and args.truth_sets == 2
    assert bench.tuner_kwargs(args, "graph") == {"tie_tolerance": 0.01}
    assert bench.tuner_kwargs(args, "sets3") == {
        "tie_tolerance": 0.01,
        "input_sets": 3,
        "tie_floor_us": 0.02,
    }
    assert bench.timer_name("sets3") == "graph" and bench.timer_name("events") == "events"
    assert bench.options(args)["variants"]["sets3"] == {"input_sets": 3, "tie_floor_us": 0.02}
    assert bench.parse_variant("x:mode=fast") == ("x", {"mode": "fast"})  # not JSON: text
    assert bench.parse_args([]).truth_sets == bench.TRUTH_SETS


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variant", ":input_sets=3"], "give NAME:KEY=VALUE"),
        (["--variant", "a:input_sets"], "is not KEY=VALUE"),
        (["--variant", "graph:input_sets=3"], "not a mode name"),
        (["--variant", "a:", "--variant", "a:input_sets=2"], "must be unique"),
        (["--truth-sets", "0"], "expected an integer >= 1"),
    ],
)
def test_variant_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modes", "graph,cupti"], "unknown timing mode(s) 'cupti'"),
        (["--modes", ","], "no timing mode given"),
        (["--runs", "0"], "expected an integer >= 1"),
        (["--runs", "two"], "expected an integer >= 1"),
        (["--tie-tolerance", "1.5"], "expected a number in [0, 1)"),
        (["--tie-tolerance", "-0.1"], "expected a number in [0, 1)"),
        (["--cupti-graph-replays", "0"], "expected an integer >= 1"),
    ],
)
def test_parse_args_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if "unknown" in message:
        assert "graph, events, wallclock" in err  # names the valid modes


# --- run_case and main against fakes -----------------------------------------------------------

KEY = scores.candidate_key


class State:
    def __init__(self) -> None:
        self.clock_us = 0.0
        self.last: str | None = None


#: (kernel sum, in-graph, what the fake tuner timer reads) per candidate key.
COSTS = {
    KEY(0, -1): (4.78, 5.00, 5.02),
    KEY(1, dict(SPLIT_K, split_k=1)): (6.00, 6.20, 6.25),
    KEY(1, SPLIT_K): (4.61, 5.40, 5.45),
}
BROKEN = dict(SPLIT_K, bm=32)


class CostRunner(TunableRunner):
    def __init__(self, index: int, tactics: list[Any], state: State) -> None:
        self.index, self.tactics, self.state = index, tactics, state

    def get_valid_tactics(self, inputs: list[Any], profile: Any) -> list[Any]:
        return list(self.tactics)

    def forward(self, inputs: list[Any], tactic: Any = -1) -> Any:
        key = KEY(self.index, tactic)
        if key not in COSTS:
            raise RuntimeError(f"tactic {tactic} does not support this shape")
        self.state.last = key
        self.state.clock_us += COSTS[key][2]
        return inputs[0]

    def cache_key_extras(self) -> tuple[Any, ...]:
        return (self.index,)


class CostTimer:
    name = "fake"

    def __init__(self, state: State) -> None:
        self.state = state

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        for i in range(max(1, warmup)):
            fn(i)
        start = self.state.clock_us
        for i in range(repeat):
            fn(i)
        per_call = (self.state.clock_us - start) / repeat
        return Measurement.from_samples([per_call] * 3, calls_per_sample=repeat, timer=self.name)


def fake_case(state: State, *, broken_build: bool = False) -> bench.Case:
    def build(device: torch.device, m: int):
        if broken_build:
            raise RuntimeError("out of memory")
        runners = (
            CostRunner(0, [-1], state),
            CostRunner(1, [dict(SPLIT_K, split_k=1), dict(SPLIT_K), BROKEN], state),
        )
        config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (m,)),), warmup=1, repeat=2)
        return "fake_gemm", runners, config, [torch.randn(m, 8)]

    return bench.Case("gemm", "broken" if broken_build else "o_proj 2048->2048", 16, build)


@pytest.fixture
def fake_gpu(monkeypatch):
    """CUPTI, the timers and torch.cuda.synchronize replaced by fakes driven by COSTS."""
    import graphtune.autotuner.timing as timing

    state = State()

    def kernel_time(call, *, calls, warmup):
        call(0)
        ks = COSTS[state.last][0]
        return SimpleNamespace(per_call_us=ks, kernels_per_call=2 if ks == 4.61 else 1)

    def graph_time(call, *, replays, warmup, estimate_us):
        assert replays == 4 and estimate_us is not None
        call(0)
        ig = COSTS[state.last][1]
        kernels = 2 if estimate_us == 4.61 else 1
        return SimpleNamespace(
            per_call_us=ig,
            kernels_per_call=kernels,
            as_dict=lambda: {"per_call_us": ig, "kernels_per_call": kernels},
        )

    def resolve_timer(mode: str, device: Any):
        if mode == "wallclock":
            raise RuntimeError("wallclock timer broke")
        return CostTimer(state)

    monkeypatch.setattr(bench._common, "cupti_kernel_time", kernel_time)
    monkeypatch.setattr(bench._common, "cupti_graph_time", graph_time)
    monkeypatch.setattr(timing, "resolve_timer", resolve_timer)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    return state


def test_run_case_records_both_truths_tuner_times_and_survives_failures(fake_gpu):
    args = bench.parse_args(
        ["--modes", "graph,events,wallclock", "--runs", "2", "--cupti-graph-replays", "4"]
    )
    record = bench.run_case(fake_case(fake_gpu), torch.device("cpu"), args)
    assert record["error"] is None and record["n_candidates"] == 4
    by_key = {KEY(c["runner_index"], c["tactic"]): c for c in record["candidates"]}
    broken = by_key[KEY(1, BROKEN)]
    assert broken["cupti_us"] == math.inf and "does not support" in broken["cupti_error"]
    assert broken["cupti_graph_us"] == math.inf and "skipped" in broken["cupti_graph_error"]
    assert by_key[KEY(1, SPLIT_K)]["cupti_graph"]["kernels_per_call"] == 2
    # Each truth is the median over --truth-sets (default 3) fresh input sets.
    assert len(by_key[KEY(0, -1)]["cupti_graph_us_sets"]) == bench.TRUTH_SETS
    assert broken["cupti_us_sets"] == [] and record["truth_noise_graph"] == 0.0
    assert record["best"]["tactic"] == SPLIT_K  # kernel sum: split-K
    assert record["best_graph"]["tactic"] == -1  # in-graph: cuBLAS
    graph = record["modes"]["graph"]
    assert [p["runner_index"] for p in graph["picks"]] == [0, 0]
    assert graph["regrets"] == pytest.approx([4.78 / 4.61 - 1] * 2)
    assert graph["regret"] == pytest.approx(4.78 / 4.61 - 1)
    assert graph["regrets_graph"] == [0.0, 0.0] and graph["regret_graph"] == 0.0
    assert graph["agree"] is True and len(graph["ms_per_tactic"]) == 2
    assert "error" in record["modes"]["wallclock"]  # one failing mode keeps the others
    assert record["modes"]["events"]["regret_graph"] == 0.0
    if hasattr(AutoTuner(), "history"):
        assert len(graph["tie_bands"]) == 2 and all(b is not None for b in graph["tie_bands"])
        assert by_key[KEY(0, -1)]["tuner_us"]["graph"] == pytest.approx(5.02)
        assert by_key[KEY(1, SPLIT_K)]["tuner_spread"]["events"] == 0.0
        assert record["spearman"]["graph"]["graph_truth"] == pytest.approx(1.0)
        # tuner ranks (1, 3, 2), kernel-sum ranks (2, 3, 1): 1 - 6 * 2 / (3 * 8)
        assert record["spearman"]["graph"]["kernel_sum_truth"] == pytest.approx(0.5)
    else:  # an older tuner: nothing recorded, nothing broken
        assert graph["tie_bands"] == [None, None] and record["spearman"] == {}
    summary = scores.summarize([record], args.modes)
    assert summary["graph"]["share_regret_le_1pct_graph_truth"] == 1.0
    assert summary["wallclock"]["mode_errors"] == 1
    scores.table([record], args.modes)


def test_main_writes_options_and_keeps_every_case(fake_gpu, monkeypatch, tmp_path, capsys):
    import graphtune.ops

    monkeypatch.setattr(bench._common, "require_cuda_or_exit", lambda script: torch.device("cpu"))
    monkeypatch.setattr(
        bench._common,
        "provenance",
        lambda commit, device: {
            "gpu": "Fake",
            "gpu_slug": "fake",
            "compute_capability": "0.0",
            "torch": "x",
            "cuda": None,
            "triton": None,
            "commit": "abc",
        },
    )
    monkeypatch.setattr(graphtune.ops, "triton_available", lambda: True)
    monkeypatch.setattr(
        bench, "cases", lambda quick: [fake_case(fake_gpu, broken_build=True), fake_case(fake_gpu)]
    )
    status = bench.main(
        [
            "--out",
            str(tmp_path),
            "--modes",
            "graph,wallclock",
            "--runs",
            "2",
            "--cupti-graph-replays",
            "4",
            "--tie-tolerance",
            "0.01",
        ]
    )
    assert status == 1  # 3.7% kernel-sum regret and one failed case
    data = json.loads((tmp_path / "tuning-fake.json").read_text())
    assert data["options"]["modes"] == ["graph", "wallclock"]
    assert data["options"]["tie_tolerance"] == 0.01
    assert data["options"]["tuner_tie_tolerance"] == 0.01
    assert [c["error"] is None for c in data["cases"]] == [False, True]
    assert data["summary"]["all_pass"] is False
    assert data["summary"]["all_pass_graph_truth"] is False  # the failed case counts
    assert data["summary"]["targets"]["graph_regret_le_1pct_in_95pct_graph_truth"] is True
    assert data["cases"][1]["modes"]["wallclock"]["error"].startswith("RuntimeError")
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith('{"bench": "tuning"'))
    final = json.loads(line)
    assert final["all_pass"] is False and "graph" in final and "events" not in final
    assert "graph ig" in out  # the table comes after the JSON line


def test_short_tactic_labels_every_runner_family():
    gemm = {"bm": 16, "bn": 64, "bk": 256, "warps": 4, "stages": 3, "split_k": 4}
    assert scores.short_tactic("TritonGemmRunner", gemm) == "TritonGemm 16x64x256 w4 s3 k4"
    gemv = {"bn": 8, "bk": 512, "warps": 4, "split_k": 2}  # has split_k but no bm / stages
    assert scores.short_tactic("TritonGemvRunner", gemv) == "TritonGemv 8x512 w4 k2"
    assert scores.short_tactic("TorchGemmRunner", -1) == "TorchGemm -1"
