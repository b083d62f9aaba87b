"""benchmarks/tuning.py's options and its GPU paths (``run_case``, ``main``) against fakes of CUPTI
and the timer, so their control flow, bookkeeping and output are checked before the script
reaches the H200 (the scoring helpers: test_bench_tuning_helpers.py).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import _tuning_cases as tuning_cases  # noqa: E402
import _tuning_options as tuning_options  # noqa: E402
import _tuning_scores as scores  # noqa: E402
import _tuning_table as tuning_table  # noqa: E402
import tuning as bench  # noqa: E402

from graphtune.autotuner import (  # noqa: E402
    AutoTuner,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
)
from graphtune.autotuner.timing.base import Measurement  # noqa: E402

SPLIT_K = {"bm": 16, "bn": 32, "bk": 128, "warps": 4, "stages": 4, "split_k": 4}


# --- options -----------------------------------------------------------------------------------


def test_parse_args_defaults_and_values():
    args = tuning_options.parse_args([])
    assert args.modes == scores.MODES and args.runs == 3
    assert args.tie_tolerance is None and args.cupti_graph_replays == 20
    assert tuning_options.tuner_kwargs(args) == {}
    args = tuning_options.parse_args(
        [
            "--modes",
            " events,graph ",
            "--runs",
            "5",
            "--tie-tolerance",
            "0.01",
            "--cupti-graph-replays",
            "7",
        ]
    )
    assert args.modes == ("events", "graph")
    assert tuning_options.tuner_kwargs(args) == {"tie_tolerance": 0.01}
    opts = tuning_options.options(args)
    assert opts["modes"] == ["events", "graph"] and opts["runs"] == 5
    assert opts["tie_tolerance"] == 0.01 and opts["cupti_graph_replays"] == 7
    json.dumps(opts)  # goes into the result file


def test_only_selects_cases_by_label_text_and_bucket():
    labels = {(c.label, c.bucket) for c in tuning_cases.cases(quick=False)}

    def chosen(only):
        return {
            (c.label, c.bucket)
            for c in tuning_cases.cases(quick=False)
            if tuning_cases.selected(c, only)
        }

    assert chosen(None) == labels
    assert chosen("8192->") == {(lab, m) for lab, m in labels if lab == "down 8192->2048"}
    assert chosen("down@1|add+rmsnorm@8") == {("down 8192->2048", 1), ("add+rmsnorm 2048", 8)}
    assert chosen("down@3") == set()


def test_variants_are_extra_graph_modes_with_their_own_tuner_keywords():
    args = tuning_options.parse_args(
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
    assert tuning_options.tuner_kwargs(args, "graph") == {"tie_tolerance": 0.01}
    assert tuning_options.tuner_kwargs(args, "sets3") == {
        "tie_tolerance": 0.01,
        "input_sets": 3,
        "tie_floor_us": 0.02,
    }
    assert (
        tuning_options.timer_name("sets3") == "graph"
        and tuning_options.timer_name("events") == "events"
    )
    assert tuning_options.options(args)["variants"]["sets3"] == {
        "input_sets": 3,
        "tie_floor_us": 0.02,
    }
    assert tuning_options.parse_variant("x:mode=fast") == ("x", {"mode": "fast"})  # not JSON: text
    assert tuning_options.parse_args([]).truth_sets == tuning_options.TRUTH_SETS


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variant", ":input_sets=3"], "give NAME:KEY=VALUE"),
        (["--variant", "a:input_sets"], "is not KEY=VALUE"),
        (["--variant", "graph:input_sets=3"], "not a mode name"),
        (["--variant", "a:", "--variant", "a:input_sets=2"], "must be unique"),
        (["--truth-sets", "0"], "must be >= 1, got 0"),
    ],
)
def test_variant_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        tuning_options.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modes", "graph,cupti"], "unknown timing mode 'cupti'"),
        (["--modes", ","], "expected comma-separated timing modes of graph,events,wallclock"),
        (["--modes", "graph,graph"], "timing mode 'graph' is given twice"),
        (["--runs", "0"], "must be >= 1, got 0"),
        (["--runs", "two"], "expected an integer, got 'two'"),
        (["--tie-tolerance", "1.5"], "expected a number in [0, 1)"),
        (["--tie-tolerance", "-0.1"], "expected a number in [0, 1)"),
        (["--cupti-graph-replays", "0"], "must be >= 1, got 0"),
    ],
)
def test_parse_args_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        tuning_options.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if "unknown" in message:
        assert "graph,events,wallclock" in err  # names the valid modes


# --- run_case and main against fakes -----------------------------------------------------------

KEY = scores.candidate_key


class State:
    def __init__(self) -> None:
        self.clock_us = 0.0
        self.last: str | None = None
        self.graph_calls: dict[str, int] = {}


#: (kernel sum, in-graph by CUPTI, what the fake tuner timer reads, in-graph by events) per
#: candidate key. Split-K is the CUPTI-slow one: 5.40 us by CUPTI, 4.90 us by events (the events
#: best), where the others read within 1% both ways.
COSTS = {
    KEY(0, -1): (4.78, 5.00, 5.02, 5.02),
    KEY(1, dict(SPLIT_K, split_k=1)): (6.00, 6.20, 6.25, 6.25),
    KEY(1, SPLIT_K): (4.61, 5.40, 5.45, 4.90),
}
#: The events reading on input sets 1, 2, 3 (as a factor): median 1, relative range 3%.
EVENT_SETS = (1.0, 1.02, 0.99)
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


def fake_case(state: State, *, broken_build: bool = False) -> tuning_cases.Case:
    def build(device: torch.device, m: int):
        if broken_build:
            raise RuntimeError("out of memory")
        runners = (
            CostRunner(0, [-1], state),
            CostRunner(1, [dict(SPLIT_K, split_k=1), dict(SPLIT_K), BROKEN], state),
        )
        config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (m,)),), warmup=1, repeat=2)
        return "fake_gemm", runners, config, [torch.randn(m, 8)]

    return tuning_cases.Case("gemm", "broken" if broken_build else "o_proj 2048->2048", 16, build)


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
        ig, events = COSTS[state.last][1], COSTS[state.last][3]
        n = state.graph_calls[state.last] = state.graph_calls.get(state.last, 0) + 1
        events *= EVENT_SETS[(n - 1) % len(EVENT_SETS)]
        kernels = 2 if estimate_us == 4.61 else 1
        return SimpleNamespace(
            per_call_us=ig,
            kernels_per_call=kernels,
            events_per_call_us=events,
            as_dict=lambda: {
                "per_call_us": ig,
                "kernels_per_call": kernels,
                "events_per_call_us": events,
            },
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
    args = tuning_options.parse_args(
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
    assert len(by_key[KEY(0, -1)]["cupti_graph_us_sets"]) == tuning_options.TRUTH_SETS
    assert broken["cupti_us_sets"] == [] and record["truth_noise_graph"] == 0.0
    assert record["best"]["tactic"] == SPLIT_K  # kernel sum: split-K
    assert record["best_graph"]["tactic"] == -1  # in-graph: cuBLAS
    # The events reading: every input set kept, the median scored, its own noise.
    split_k = by_key[KEY(1, SPLIT_K)]
    assert split_k["cupti_graph_events_us_sets"] == pytest.approx([4.90, 4.998, 4.851])
    assert split_k["cupti_graph_events_us"] == pytest.approx(4.90)
    assert split_k["cupti_graph"]["events_per_call_us"] == pytest.approx(4.90)  # set 1, as before
    assert (
        broken["cupti_graph_events_us"] == math.inf and broken["cupti_graph_events_us_sets"] == []
    )
    assert record["truth_noise_graph_events"] == pytest.approx(0.03)
    assert record["best_graph_events"]["tactic"] == SPLIT_K  # events: split-K, CUPTI: cuBLAS
    graph = record["modes"]["graph"]
    assert [p["runner_index"] for p in graph["picks"]] == [0, 0]
    assert graph["regrets"] == pytest.approx([4.78 / 4.61 - 1] * 2)
    assert graph["regret"] == pytest.approx(4.78 / 4.61 - 1)
    assert graph["regrets_graph"] == [0.0, 0.0] and graph["regret_graph"] == 0.0
    assert graph["regrets_graph_events"] == pytest.approx([5.02 / 4.90 - 1] * 2)
    assert graph["regret_graph_events"] == pytest.approx(5.02 / 4.90 - 1)
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
        # tuner ranks (1, 3, 2), events ranks (2, 3, 1): the same as the kernel sum's
        assert record["spearman"]["graph"]["events_truth"] == pytest.approx(0.5)
    else:  # an older tuner: nothing recorded, nothing broken
        assert graph["tie_bands"] == [None, None] and record["spearman"] == {}
    summary = scores.summarize([record], args.modes)
    assert summary["graph"]["share_regret_le_1pct_graph_truth"] == 1.0
    assert summary["wallclock"]["mode_errors"] == 1
    # Against the events truth the same picks miss by 2.4%: its targets fail where the CUPTI
    # ones pass.
    graph_stats = summary["graph"]
    assert graph_stats["share_regret_le_1pct_events_truth"] == 0.0
    assert graph_stats["max_regret_events_truth"] == pytest.approx(5.02 / 4.90 - 1)
    assert graph_stats["cases_events_truth"] == 1
    assert graph_stats["misses_within_truth_noise_events_truth"] == 1  # 2.4% <= 3% noise
    targets = summary["targets"]
    assert targets["graph_regret_never_gt_2pct_graph_truth"] is True
    assert targets["graph_regret_le_1pct_in_95pct_events_truth"] is False
    assert targets["graph_regret_never_gt_5pct_events_truth"] is True
    assert targets["graph_regret_never_gt_2pct_events_truth"] is False
    assert targets["graph_regret_le_1pct_in_95pct_graph_truth"] is True
    assert summary["all_pass_events_truth"] is False
    # Split-K alone reads > 5% apart (5.40 by CUPTI, 4.90 by events); the broken one has neither.
    assert summary["candidates_in_graph_cupti_vs_events_compared"] == 3
    assert summary["candidates_in_graph_cupti_vs_events_gt_5pct"] == 1
    assert summary["candidates_in_graph_cupti_vs_events_gt_5pct_split_k"] == 1
    text = scores.table([record], args.modes)
    assert "graph ev" in text and "2.4%" in text


def test_an_old_record_without_the_events_truth_still_scores(fake_gpu):
    """A record from before the events truth was kept scores as it did, without events."""
    args = tuning_options.parse_args(["--modes", "graph", "--runs", "2"])
    args.cupti_graph_replays = 4
    record = bench.run_case(fake_case(fake_gpu), torch.device("cpu"), args)
    new = scores.summarize([record], args.modes)
    old = json.loads(json.dumps(record))
    for key in ("best_graph_events", "truth_noise_graph_events"):
        del old[key]
    for cand in old["candidates"]:
        for key in ("cupti_graph_events_us", "cupti_graph_events_us_sets"):
            del cand[key]
    for key in ("regrets_graph_events", "regret_graph_events"):
        del old["modes"]["graph"][key]
    old["spearman"]["graph"].pop("events_truth", None)
    summary = scores.summarize([old], args.modes)
    assert summary["all_pass_events_truth"] is None
    assert not any(t.endswith("_events_truth") for t in summary["targets"])
    assert {k: v for k, v in new["targets"].items() if not k.endswith("_events_truth")} == (
        summary["targets"]
    )
    for key in ("all_pass", "all_pass_graph_truth", "share_reachable_under_both_truths"):
        assert summary[key] == new[key]
    for key in ("share_regret_le_1pct_graph_truth", "max_regret_graph_truth", "cases_graph_truth"):
        assert summary["graph"][key] == new["graph"][key]
    assert summary["graph"]["cases_events_truth"] == 0
    assert summary["candidates_in_graph_cupti_vs_events_compared"] == 0
    assert "graph ev" in scores.table([old], args.modes)  # its cells are "-"
    lines = tuning_table.summary_lines(summary, args.modes)
    assert not any("events" in line for line in lines)


def test_main_writes_options_and_keeps_every_case(fake_gpu, monkeypatch, tmp_path, capsys):
    _fake_main(monkeypatch, fake_gpu)
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
    # Two of the three modes: a partial run, under its own name.
    data = json.loads((tmp_path / "tuning-fake-partial-modes-graph-wallclock.json").read_text())
    assert data["options"]["modes"] == ["graph", "wallclock"]
    assert data["options"]["tie_tolerance"] == 0.01
    assert data["options"]["tuner_tie_tolerance"] == 0.01
    assert [c["error"] is None for c in data["cases"]] == [False, True]
    assert data["summary"]["all_pass"] is False
    assert data["summary"]["all_pass_graph_truth"] is False  # the failed case counts
    assert data["summary"]["targets"]["graph_regret_le_1pct_in_95pct_graph_truth"] is True
    assert data["summary"]["targets"]["graph_regret_le_1pct_in_95pct_events_truth"] is False
    assert data["summary"]["all_pass_events_truth"] is False
    assert data["targets"]["truths"]["events_truth"] == list(scores.EVENTS_TRUTH_TARGETS)
    assert data["cases"][1]["candidates"][0]["cupti_graph_events_us_sets"]
    assert data["cases"][1]["modes"]["wallclock"]["error"].startswith("RuntimeError")
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith('{"bench": "tuning"'))
    final = json.loads(line)
    assert final["all_pass"] is False and "graph" in final and "events" not in final
    assert final["all_pass_events_truth"] is False
    # The lines the run ends with carry the events truth's targets and shares.
    summary_lines = [
        ln
        for ln in out.splitlines()
        if re.search(r"^target|median .* per|within 1% of the best|reachable", ln)
    ]
    assert "target graph_regret_never_gt_2pct_events_truth: FAIL" in summary_lines
    assert any(
        ln.startswith(
            "graph: cases with every pick within 1% of the best: kernel sum 0.0% (max regret 3.7%)"
        )
        and "in-graph CUPTI 100.0% (max regret 0.0%)" in ln
        and "in-graph events 0.0% (max regret 2.4%)" in ln
        for ln in summary_lines
    )
    assert "differs by > 5%: 1 of 3 (1 split-K)" in out
    assert "graph ig" in out  # the table comes after the JSON line


def _fake_main(monkeypatch, fake_gpu):
    """``bench.main`` on the CPU with one fake case (label ``o_proj 2048->2048``)."""
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
    monkeypatch.setattr(bench, "cases", lambda quick: [fake_case(fake_gpu)])
    return ["--runs", "2", "--cupti-graph-replays", "4"]


def test_partial_runs_never_replace_the_full_runs_file(fake_gpu, monkeypatch, tmp_path, capsys):
    base = _fake_main(monkeypatch, fake_gpu) + ["--out", str(tmp_path)]
    bench.main(base)
    full = (tmp_path / "tuning-fake.json").read_bytes()
    bench.main([*base, "--modes", "wallclock,graph,events"])  # all three, reordered: full
    bench.main([*base, "--only", "o_proj@16"])
    bench.main([*base, "--modes", "graph"])
    bench.main([*base, "--variant", "sets1:input_sets=1"])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "tuning-fake-partial-modes-graph.json",
        "tuning-fake-partial-only-o-proj-16.json",
        "tuning-fake-partial-variant-sets1.json",
        "tuning-fake.json",
    ]
    assert json.loads((tmp_path / "tuning-fake.json").read_text())["options"]["only"] is None
    assert json.loads(full)["options"]["modes"] == list(scores.MODES)


def test_an_only_that_matches_no_case_is_refused(fake_gpu, monkeypatch, tmp_path, capsys):
    base = _fake_main(monkeypatch, fake_gpu) + ["--out", str(tmp_path)]
    assert bench.main([*base, "--only", "typo"]) == 2
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing run
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.strip().splitlines()
    assert "--only 'typo' matches no case" in line and "'o_proj 2048->2048'" in line


def test_one_run_cannot_pass_the_agreement_targets(fake_gpu, monkeypatch, tmp_path, capsys):
    """With --runs 1 every pick agrees with itself: the 3-of-3 target is n/a and all_pass is
    false, not a pass by construction."""
    base = _fake_main(monkeypatch, fake_gpu) + ["--out", str(tmp_path), "--modes", "graph"]
    assert bench.main([*base, "--runs", "1"]) == 1
    data = json.loads((tmp_path / "tuning-fake-partial-modes-graph.json").read_text())
    summary = data["summary"]
    assert summary["targets"]["graph_same_pick_3of3_in_95pct"] is None
    assert summary["targets"]["graph_at_most_1_case_without_the_same_pick"] is None
    assert summary["all_pass"] is False and summary["all_pass_graph_truth"] is False
    assert "target graph_same_pick_3of3_in_95pct: n/a (not evaluated)" in capsys.readouterr().out
