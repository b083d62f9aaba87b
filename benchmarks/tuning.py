#!/usr/bin/env python3
"""Tuning quality of graphtune.ops: each timing mode's picks against CUPTI and CUDA-event truths.

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/tuning.py --out benchmarks/results [--quick] [--commit SHA]
        [--modes graph,events,wallclock] [--runs 3] [--tie-tolerance F]
        [--variant NAME:KEY=VALUE,...] [--truth-sets 3] [--cupti-graph-replays 20] [--only TEXT]
        [--lead-in]

For each op at Llama-1B decode shapes (bf16 GEMMs qkv 2048->3072, o_proj 2048->2048, gate_up
2048->16384, down 8192->2048, the LM head 2048->128256 on a few buckets, with the engine's
runners: cuBLAS, the tiled Triton GEMM and the Triton GEMV; fused RMSNorm with residual,
SiLU-and-mul, RoPE + KV-cache write) and each batch bucket:

1. every Triton tactic is compiled ahead of time (parallel threads; compile time reported apart);
2. two ground truths for EVERY (runner, tactic), each the median over ``--truth-sets`` input sets
   (the case's inputs and fresh ones: new values and allocations, because near-equal tactics
   swap places between allocations; ``truth_noise_*`` records how far the truths moved), hot L2
   as the timers see them:

   * ``cupti_us``, kernel sum: the CUPTI kernel durations (``torch.profiler``) of one eager call,
     summed (``_common.cupti_kernel_time``);
   * ``cupti_graph_us``, in-graph: the CUPTI device span per call of the call captured 20-200
     times back to back in one CUDA graph and replayed (``_common.cupti_graph_time``);
   * ``cupti_graph_events_us``, in-graph by events: the same graph's replays timed by CUDA
     events with no profiler attached (``events_per_call_us``; it also holds the replay's own
     start cost spread over the calls). A view beside the CUPTI in-graph truth, which stays the
     scored one for the targets: CUPTI reads split-K kernels (a partial GEMM and its reduction
     kernel, overlapping under programmatic dependent launch) slower than the same graph runs
     without the profiler, while the other candidates read alike both ways
     (benchmarks/results/README.md, "Session 55 on an H200"), and the tuner's graph timer runs
     without a profiler too. ``summary.candidates_in_graph_cupti_vs_events_gt_5pct`` counts the
     candidates whose two readings differ by more than 5% (``..._split_k``: how many are split-K).

   Why two: the kernel sum leaves out the gaps between kernels, but inside a CUDA graph (how
   the decode step runs) every kernel boundary still costs the GPU time (drain of one grid,
   start of the next; a few hundred ns on the H200 by the analysis of the last run). A split-K
   Triton GEMM (a partial GEMM plus a small reduction kernel) can win by kernel sum and lose in
   the graph to a one-kernel cuBLAS call: o_proj M=16 read 4.61 us (split-K) vs 4.78 us (cuBLAS)
   by kernel sum, and the graph timer picked cuBLAS. For 1-2 us fused kernels (SiLU-and-mul,
   RoPE) a different grid shifts the launch and drain cost by 30-160 ns, which the kernel sum
   cannot see either. The graph timer measures the in-graph cost, so its picks are judged
   against both truths;
3. tuning with each timing mode (``graph``, ``events``, ``wallclock`` = host clock around
   ``torch.cuda.synchronize``) and each ``--variant`` (the graph timer with other AutoTuner
   keywords, reported like a mode), ``--runs`` independent runs each (a fresh AutoTuner per run,
   default settings unless ``--tie-tolerance``), recording the pick, the tuning wall time and,
   when the tuner has ``AutoTuner.history``, what it measured: per candidate its median time and
   spread in the first run of each mode (``tuner_us``, ``tuner_spread``), per run the tie band,
   and per case the Spearman rank correlation of each mode's times with each truth.

Reported per (op, bucket): the pick of each mode and run; regret = truth(pick) / truth(best) - 1
against each truth (``regrets`` kernel sum, ``regrets_graph`` in-graph, ``regrets_graph_events``
in-graph by events; ``regret``, ``regret_graph`` and ``regret_graph_events`` are the worst run);
whether the picks of all runs agree; tuning wall time per (tactic, bucket) (compilation excluded:
it happened in step 1) and where it went (``phase_ms_per_tactic``: the tuner's
``stats.phase_seconds`` per tactic: input synthesis, ``get_valid_tactics``, prepare, measurement,
selection). Targets (graph mode): regret <= 1% in >= 95% of cases and never > 5%; the same pick
in every run in >= 95% of cases; median tuning time per (tactic, bucket) <= 10 ms. The regret
targets are evaluated against the kernel-sum truth (``all_pass``) and against the in-graph truth
(keys ending in ``_graph_truth``, ``all_pass_graph_truth``), where also the worst regret must be
<= 2% and at most one case may lack the same pick in every run; the in-graph ones again against
the events reading (``_events_truth``, ``all_pass_events_truth``: reported beside them, neither
the exit status nor ``all_pass_graph_truth`` uses it). A target without data (no scored case, or
fewer than 3 runs for the agreement ones) is ``null``, "n/a", and fails its ``all_pass*``.
``--lead-in`` (experimental, off by default) gives every graph-timer mode and variant
``GraphTimer(lead_in=graphtune.ops.lead_in.pdl_lead_in(device))``: each call is timed right after
a small PDL kernel, that kernel's own time taken off, because a chain of a candidate after itself
overlaps under PDL unlike the step (``graphtune.autotuner.timing.lead_in``); refused without PDL.
Writes ``tuning-<gpu>.json`` (``-quick`` suffix with ``--quick``, ``-lead-in`` with that option;
a partial run, one with ``--only``, ``--modes`` other than all three or ``--variant``, adds
``-partial-<what>`` so it never replaces a full run's file) with provenance and the options,
prints one JSON line and then the table
(scoring and summary: ``_tuning_scores.py``; table and printed lines: ``_tuning_table.py``).
Exits 2 without CUDA, for an ``--only`` that matches no case or an ``--out`` that cannot be
written, 1 when a kernel-sum target fails or could not be evaluated (0 when graph mode was not
run, so no target applies) or when the result went to the temporary folder instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tuning_cases import Case, cases, selected  # noqa: E402
from _tuning_options import (  # noqa: E402
    options,
    parse_args,
    result_name,
    timer_name,
    tuner_kwargs,
    unmatched_only,
)
from _tuning_scores import (  # noqa: E402
    EVENTS_TRUTH_TARGETS,
    GRAPH_TRUTH_TARGETS,
    IN_GRAPH,
    IN_GRAPH_EVENTS,
    KERNEL_SUM,
    KERNEL_SUM_TARGETS,
    MAX_REGRET,
    TARGET_MS,
    TARGET_REGRET,
    TARGET_SHARE,
    attach_tuner_times,
    best_candidate,
    finite,
    last_profile,
    pct,
    rank_correlations,
    regrets_against,
    score_picks,
    summarize,
    truth_noise,
    worst,
)
from _tuning_table import summary_lines, table  # noqa: E402

from graphtune import bench as _common  # noqa: E402
from graphtune.cli._args import check_script_output, report_written  # noqa: E402

logger = logging.getLogger("benchmarks.tuning")

# --- measurement (GPU) -------------------------------------------------------------------------


def measure_truth(
    label: str,
    runners: Sequence[Any],
    input_sets: Sequence[list[Any]],
    candidates: list[tuple[int, Any]],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Both CUPTI truths and the events reading of the in-graph graph for every candidate, each
    the median over ``input_sets`` (per-set values kept in ``*_sets``); a candidate that fails on
    any set gets ``inf`` and its error."""
    from graphtune.autotuner.identity import runner_id, short_runner_name

    truth = []
    for index, tactic in candidates:
        runner = runners[index]
        entry: dict[str, Any] = {
            "runner": short_runner_name(runner_id(runner)),
            "runner_index": index,
            "tactic": tactic,
            KERNEL_SUM: math.inf,
            "kernels_per_call": None,
            IN_GRAPH: math.inf,
            IN_GRAPH_EVENTS: math.inf,
            "cupti_graph": None,
            f"{KERNEL_SUM}_sets": [],
            f"{IN_GRAPH}_sets": [],
            f"{IN_GRAPH_EVENTS}_sets": [],
        }
        for inputs in input_sets:
            if not _truth_on_set(label, runner, tactic, inputs, entry, args):
                break
        for field in (KERNEL_SUM, IN_GRAPH, IN_GRAPH_EVENTS):
            values = entry[f"{field}_sets"]
            if len(values) == len(input_sets) and all(map(finite, values)):
                entry[field] = statistics.median(values)
        truth.append(entry)
    return truth


def _truth_on_set(
    label: str,
    runner: Any,
    tactic: Any,
    inputs: list[Any],
    entry: dict[str, Any],
    args: argparse.Namespace,
) -> bool:
    """Appends one input set's kernel sum and in-graph times (CUPTI, and CUDA events on the same
    graph without the profiler) to ``entry``; ``False`` (with the error recorded) when the
    candidate failed."""

    def call(i: int) -> object:
        return runner.forward(inputs, tactic=tactic)

    try:
        kt = _common.cupti_kernel_time(call, calls=args.cupti_calls, warmup=3)
        entry[f"{KERNEL_SUM}_sets"].append(kt.per_call_us)
        entry["kernels_per_call"] = kt.kernels_per_call
    except Exception as exc:  # a candidate that cannot run is reported, not fatal
        logger.warning("%s %s: CUPTI kernel sum failed: %s", label, tactic, exc)
        entry["cupti_error"] = f"{type(exc).__name__}: {exc}"
        entry["cupti_graph_error"] = "skipped: the kernel-sum measurement failed"
        return False
    if not finite(kt.per_call_us):
        # It could not run eagerly (or CUPTI saw nothing): capturing it would fail the same.
        entry["cupti_graph_error"] = "skipped: the kernel-sum measurement failed"
        return False
    try:
        gt = _common.cupti_graph_time(
            call, replays=args.cupti_graph_replays, warmup=3, estimate_us=kt.per_call_us
        )
    except Exception as exc:  # e.g. a tactic that cannot be captured: reported, not fatal
        logger.warning("%s %s: CUPTI in-graph time failed: %s", label, tactic, exc)
        entry["cupti_graph_error"] = f"{type(exc).__name__}: {exc}"
        _synchronize_quietly()
        return False
    entry[f"{IN_GRAPH}_sets"].append(gt.per_call_us)
    # None when the graph was not timed by events (event_check off): no events truth then.
    entry[f"{IN_GRAPH_EVENTS}_sets"].append(gt.events_per_call_us)
    if entry["cupti_graph"] is None:
        entry["cupti_graph"] = gt.as_dict()
    if kt.kernels_per_call != gt.kernels_per_call:
        # Eager and graph runs launched different activity counts: a trace problem or a
        # runner that launches differently when captured; worth a look.
        entry["graph_kernels_mismatch"] = True
    return True


def tune_mode(
    mode: str,
    op: str,
    runners: Sequence[Any],
    config: Any,
    inputs: list[Any],
    truth: list[dict[str, Any]],
    device: torch.device,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """``args.runs`` fresh tuning runs with one timing mode, scored against both truths."""
    from graphtune.autotuner import AutoTuner, TuningPolicy
    from graphtune.autotuner.identity import runner_id, short_runner_name
    from graphtune.autotuner.timing import GraphTimer, resolve_timer

    picks: list[dict[str, Any]] = []
    tune_s: list[float] = []
    phase_ms: list[dict[str, float]] = []
    tie_bands: list[float | None] = []
    unmatched = 0
    knobs = tuner_kwargs(args, mode)
    timer_knobs = {k[len("timer.") :]: v for k, v in knobs.items() if k.startswith("timer.")}
    policy = TuningPolicy(**{k: v for k, v in knobs.items() if not k.startswith("timer.")})
    for run in range(args.runs):
        if getattr(args, "lead_in", False) and timer_name(mode) == "graph":
            from graphtune.ops.lead_in import pdl_lead_in

            timer_knobs["lead_in"] = pdl_lead_in(device)  # checked by main; one per run
        timer = (
            GraphTimer(device=device, **timer_knobs)
            if timer_knobs
            else resolve_timer(timer_name(mode), device)
        )
        tuner = AutoTuner(timer=timer, show_progress=False, policy=policy)
        tuner.tuning_mode = True
        start = time.perf_counter()
        runner, tactic = tuner.choose_one(op, runners, config, inputs)
        torch.cuda.synchronize(device)
        tune_s.append(time.perf_counter() - start)
        phase_ms.append({k: 1000.0 * v / len(truth) for k, v in tuner.stats.phase_seconds.items()})
        index = next((i for i, r in enumerate(runners) if r is runner), -1)
        picks.append(
            {
                "runner": short_runner_name(runner_id(runner)),
                "runner_index": index,
                "tactic": tactic,
            }
        )
        profile = last_profile(tuner, op)
        tie_bands.append(getattr(profile, "tie_band", None) if profile is not None else None)
        if profile is not None and run == 0:
            unmatched = attach_tuner_times(truth, mode, profile)
    regrets, regrets_graph = score_picks(picks, truth)
    regrets_events = regrets_against(picks, truth, IN_GRAPH_EVENTS)
    keys = {json.dumps(p, sort_keys=True, default=str) for p in picks}
    return {
        "picks": picks,
        "regrets": regrets,
        "regret": worst(regrets),
        "regrets_graph": regrets_graph,
        "regret_graph": worst(regrets_graph),
        "regrets_graph_events": regrets_events,
        "regret_graph_events": worst(regrets_events),
        "agree": len(keys) == 1,
        "tune_s": tune_s,
        "ms_per_tactic": [1000.0 * s / len(truth) for s in tune_s],
        "phase_ms_per_tactic": phase_ms,
        "measurements": tuner.stats.measurements,
        "tie_bands": tie_bands,
        "tuner_candidates_unmatched": unmatched,
    }


def _synchronize_quietly() -> None:
    """Waits for the GPU after a failure; a second failure is logged, not raised."""
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:
        logger.error("torch.cuda.synchronize() after a failure: %s", exc)


def run_case(case: Case, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """Both truths of every candidate of one case, then every mode's tuning runs."""
    from graphtune.ops._triton_runner import TritonRunner

    op, runners, config, inputs = case.build(device, case.bucket)
    record: dict[str, Any] = {
        "op": case.op,
        "shape": case.label,
        "bucket": case.bucket,
        "error": None,
        "modes": {},
    }
    began = time.perf_counter()
    candidates: list[tuple[int, Any]] = [(0, -1)]
    compile_s = 0.0
    for index, runner in enumerate(runners):
        tactics = [t for t in runner.get_valid_tactics(inputs, None) if (index, t) != (0, -1)]
        if isinstance(runner, TritonRunner) and tactics:
            start = time.perf_counter()
            report = runner.precompile(inputs, tactics)
            compile_s += time.perf_counter() - start
            failed = {k: v for k, v in report.items() if v}
            if failed:
                logger.warning(
                    "%s: %d tactics failed to compile: %s",
                    case.label,
                    len(failed),
                    list(failed.values())[:2],
                )
        candidates += [(index, t) for t in tactics]
    record["compile_s"] = compile_s
    # The truth is the median over fresh input sets (new values, new allocations): on an H200
    # near-equal GEMM tactics swap places by 1-2% between allocations
    # (benchmarks/tuning_stability.py), so one set's ranking is itself a noisy sample.
    input_sets = [inputs] + [
        case.build(device, case.bucket)[3] for _ in range(getattr(args, "truth_sets", 1) - 1)
    ]
    truth = measure_truth(case.label, runners, input_sets, candidates, args)
    del input_sets
    best = best_candidate(truth, KERNEL_SUM)
    if best is None:
        raise RuntimeError("no candidate could be timed by CUPTI (kernel sum)")
    best_graph = best_candidate(truth, IN_GRAPH)
    record.update(
        candidates=truth,
        best=best,
        best_graph=best_graph,
        best_graph_events=best_candidate(truth, IN_GRAPH_EVENTS),
        n_candidates=len(truth),
        truth_noise_graph=truth_noise(truth, IN_GRAPH),
        truth_noise_graph_events=truth_noise(truth, IN_GRAPH_EVENTS),
        truth_noise_kernel_sum=truth_noise(truth, KERNEL_SUM),
    )
    for mode in args.modes:
        try:
            record["modes"][mode] = tune_mode(
                mode, op, runners, config, inputs, truth, device, args
            )
        except Exception as exc:  # one failing mode must not lose the truths or other modes
            logger.exception("%s M=%d: tuning with %s failed", case.label, case.bucket, mode)
            record["modes"][mode] = {"error": f"{type(exc).__name__}: {exc}"}
            _synchronize_quietly()
    record["spearman"] = rank_correlations(truth, args.modes)
    record["wall_s"] = time.perf_counter() - began
    return record


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status (2 without CUDA, 1 if a target failed)."""
    args = parse_args(argv, __doc__.split("\n\n")[0])
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # Checked before the GPU: a typo in --only is a usage error (exit 2, like argparse's), and
    # running nothing would write a result with no cases.
    todo = [c for c in cases(args.quick) if selected(c, args.only)]
    if not todo:
        print(
            unmatched_only(args.only, [c.label for c in cases(args.quick)], args.quick),
            file=sys.stderr,
        )
        return 2
    device = _common.require_cuda_or_exit("benchmarks/tuning.py")
    from graphtune.autotuner import TuningPolicy
    from graphtune.ops import triton_available

    prov = _common.provenance(args.commit, device)
    target = args.out / result_name(args, prov["gpu_slug"])
    check_script_output(target)  # before the work: exit 2 on a bad --out
    if not triton_available():
        print("error: benchmarks/tuning.py needs Triton; pip install triton", file=sys.stderr)
        return 2
    if args.lead_in:
        from graphtune.ops.lead_in import pdl_lead_in

        if pdl_lead_in(device) is None:
            print(
                "error: --lead-in needs programmatic dependent launch (a GPU of "
                "compute capability >= 9.0, Triton >= 3.3, GRAPHTUNE_PDL not 0); drop it",
                file=sys.stderr,
            )
            return 2
    started = time.perf_counter()
    opts = options(args)
    # What the tuner actually used (its default when --tie-tolerance is not given).
    opts["tuner_tie_tolerance"] = TuningPolicy(**tuner_kwargs(args)).tie_tolerance
    print(
        f"{prov['gpu']} (sm {prov['compute_capability']}), torch {prov['torch']}, "
        f"CUDA {prov['cuda']}, triton {prov['triton']}, commit {prov['commit']}",
        flush=True,
    )
    records = []
    for case in todo:
        try:
            rec = run_case(case, device, args)
        except Exception as exc:  # one failing case must not lose the others
            logger.exception("%s M=%d failed", case.label, case.bucket)
            rec = {
                "op": case.op,
                "shape": case.label,
                "bucket": case.bucket,
                "error": f"{type(exc).__name__}: {exc}",
                "modes": {},
            }
            _synchronize_quietly()
        records.append(rec)
        if rec["error"]:
            print(f"  {case.label:<24} M={case.bucket:<4} ERROR {rec['error']}", flush=True)
            continue
        best_graph = rec["best_graph"]
        line = (
            f"  {case.label:<24} M={case.bucket:<4} {rec['n_candidates']:>3} cands  "
            f"best {rec['best'][KERNEL_SUM]:8.2f} us (ks) "
        )
        line += f"{best_graph[IN_GRAPH]:8.2f} us (ig)" if best_graph else "       - us (ig)"
        g = rec["modes"].get("graph")
        if g and not g.get("error"):
            line += (
                f"  graph regret ks {pct(g['regret']):>6} ig {pct(g['regret_graph']):>6}"
                f" ev {pct(g['regret_graph_events']):>6}"
                f"  agree {g['agree']}"
            )
        elif g:
            line += f"  graph ERROR {g['error'][:60]}"
        print(line + f"  {rec['wall_s']:.1f} s", flush=True)
    summary = summarize(records, args.modes)
    summary["wall_s"] = time.perf_counter() - started
    path = _common.write_json(  # target, or the fallback file it went to instead
        target,
        {
            "benchmark": "tuning",
            "provenance": prov,
            "options": opts,
            "summary": summary,
            "cases": records,
            "targets": {
                "graph_regret_le": TARGET_REGRET,
                "share": TARGET_SHARE,
                "graph_regret_never_gt": MAX_REGRET,
                "ms_per_tactic_median_le": TARGET_MS,
                "truths": {
                    "kernel_sum": KERNEL_SUM_TARGETS,
                    "graph_truth": GRAPH_TRUTH_TARGETS,
                    "events_truth": EVENTS_TRUTH_TARGETS,
                },
            },
        },
    )
    print("\n".join(summary_lines(summary, args.modes)))
    print(
        json.dumps(
            _common.json_safe(
                {
                    "bench": "tuning",
                    "file": str(path),
                    "all_pass": summary["all_pass"],
                    "all_pass_graph_truth": summary["all_pass_graph_truth"],
                    "all_pass_events_truth": summary["all_pass_events_truth"],
                    **{m: summary[m] for m in args.modes},
                }
            )
        )
    )
    print(table(records, args.modes))
    # Exit 1 also when the result went to the temporary folder: a script finds no file at target.
    written = report_written("--out", target, path)
    return 0 if written and summary["all_pass"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
