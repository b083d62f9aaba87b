#!/usr/bin/env python3
"""Where the run-to-run variation of graph-timed tuning comes from (the 3-of-3 agreement target).

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/tuning_stability.py [--out DIR] [--sessions 8] [--runs 6]
        [--top 4] [--only TEXT] [--commit SHA]

For each case of ``benchmarks/tuning.py`` (default: the cases whose graph-mode picks disagreed
across runs in ``tuning-h200.json``, plus two stable ones), one tuning run names the ``--top``
fastest candidates. Then, interleaved over those candidates, the tuner's own graph timer
(``GraphTimer``, default settings, each measurement a fresh capture) takes one sample per
candidate per session in two settings:

* ``same_inputs``: every session times the same input tensors (same values, same addresses);
* ``fresh_inputs``: every session builds a fresh input set (new values, new allocations; the
  earlier sets stay alive so the addresses really differ).

If the candidates' gaps move more across fresh input sets than across sessions on the same
inputs, the tuner's within-run noise band (one input set per run) cannot see the variation that
flips picks between runs. Finally ``--runs`` fresh AutoTuner runs per case record their picks and
each finalist's median, for the tuner configurations named by ``--tuners``.

Writes ``tuning-stability-<gpu>.json`` into ``--out`` and prints a table. Exits 2 without CUDA
or for an ``--out`` that cannot be written, 1 when the result went to the temporary folder
instead, else 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tuning  # noqa: E402
from _sweep import name_list  # noqa: E402
from _tuning_scores import short_tactic  # noqa: E402

from graphtune import bench as _common  # noqa: E402
from graphtune.cli._args import (  # noqa: E402
    Parser,
    check_script_output,
    positive_int,
    report_written,
)

DEFAULT_CASES = (
    "down 8192->2048 M=2",
    "rope+kv 32/8x64 M=8",
    "silu*mul 8192 M=64",
    "qkv 2048->3072 M=1",
    "o_proj 2048->2048 M=16",
)
#: AutoTuner keyword sets compared in the repeated tuning runs.
TUNERS: dict[str, dict[str, Any]] = {"default": {}}


def case_name(case: tuning.Case) -> str:
    return f"{case.label} M={case.bucket}"


def relative_iqr(values: list[float]) -> float:
    if len(values) < 4:
        return (max(values) - min(values)) / statistics.median(values)
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / statistics.median(values)


def top_candidates(
    op: str, runners: Any, config: Any, inputs: list[Any], device: torch.device, top: int
) -> list[tuple[int, Any]]:
    """The ``top`` fastest (runner index, tactic) of one default tuning run."""
    from graphtune.autotuner import AutoTuner
    from graphtune.autotuner.timing import resolve_timer

    tuner = AutoTuner(timer=resolve_timer("graph", device), show_progress=False)
    tuner.tuning_mode = True
    tuner.choose_one(op, runners, config, inputs)
    ranked = sorted(
        (c for c in tuner.history[-1].candidates if c.failed is None), key=lambda c: c.median_us
    )
    return [(c.runner_index, c.tactic) for c in ranked[:top]]


def sample_sessions(
    runners: Any,
    candidates: list[tuple[int, Any]],
    input_sets: list[list[Any]],
) -> list[list[float]]:
    """One graph-timer sample per candidate per input set (sessions), interleaved."""
    from graphtune.autotuner.timing import GraphTimer

    timer = GraphTimer()
    samples: list[list[float]] = [[] for _ in candidates]
    for inputs in input_sets:
        for slot, (index, tactic) in enumerate(candidates):
            runner = runners[index]
            measured = timer.measure(
                lambda i, r=runner, t=tactic, x=inputs: r.forward(x, tactic=t), warmup=3, repeat=10
            )
            samples[slot].append(measured.median_us)
    return samples


def tuning_runs(
    op: str,
    runners: Any,
    config: Any,
    inputs: list[Any],
    device: torch.device,
    runs: int,
    kwargs: dict[str, Any],
) -> list[dict[str, Any]]:
    from graphtune.autotuner import AutoTuner, TuningPolicy
    from graphtune.autotuner.identity import runner_id, short_runner_name
    from graphtune.autotuner.timing import resolve_timer

    out = []
    for _ in range(runs):
        policy = TuningPolicy(**kwargs)
        tuner = AutoTuner(timer=resolve_timer("graph", device), show_progress=False, policy=policy)
        tuner.tuning_mode = True
        start = time.perf_counter()
        runner, tactic = tuner.choose_one(op, runners, config, inputs)
        elapsed = time.perf_counter() - start
        record = tuner.history[-1]
        finalists = sorted(
            (c for c in record.candidates if c.failed is None), key=lambda c: c.median_us
        )[:4]
        out.append(
            {
                "pick": short_tactic(short_runner_name(runner_id(runner)), tactic),
                "tie_band": record.tie_band,
                "tune_s": elapsed,
                "finalists": [
                    {
                        "tactic": short_tactic(c.runner, c.tactic),
                        "median_us": c.median_us,
                        "samples": c.samples,
                        "tied": c.tied,
                    }
                    for c in finalists
                ],
            }
        )
    return out


def run_case(case: tuning.Case, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    op, runners, config, inputs = case.build(device, case.bucket)
    for index, runner in enumerate(runners):  # compile ahead, as the tuner would
        if hasattr(runner, "precompile"):
            runner.precompile(
                inputs, [t for t in runner.get_valid_tactics(inputs, None) if (index, t) != (0, -1)]
            )
    candidates = top_candidates(op, runners, config, inputs, device, args.top)
    same = sample_sessions(runners, candidates, [inputs] * args.sessions)
    fresh_sets = [case.build(device, case.bucket)[3] for _ in range(args.sessions)]
    fresh = sample_sessions(runners, candidates, fresh_sets)
    del fresh_sets
    record: dict[str, Any] = {"case": case_name(case), "candidates": []}
    from graphtune.autotuner.identity import runner_id, short_runner_name

    for slot, (index, tactic) in enumerate(candidates):
        record["candidates"].append(
            {
                "tactic": short_tactic(short_runner_name(runner_id(runners[index])), tactic),
                "same_inputs_us": same[slot],
                "fresh_inputs_us": fresh[slot],
            }
        )
    # Gap of each candidate to the first one, per session: how stable is the ranking?
    for setting, data in (("same_inputs", same), ("fresh_inputs", fresh)):
        gaps = [[b / a - 1.0 for a, b in zip(data[0], other, strict=True)] for other in data[1:]]
        record[f"{setting}_gaps"] = gaps
    record["tuning_runs"] = {
        name: tuning_runs(op, runners, config, inputs, device, args.runs, kw)
        for name, kw in TUNERS.items()
        if name in args.tuners
    }
    return record


def table(records: list[dict[str, Any]]) -> str:
    lines = [f"{'case':28} {'candidate':34} {'same us':>8} {'iqr':>6} {'fresh us':>8} {'iqr':>6}"]
    for rec in records:
        for cand in rec["candidates"]:
            same, fresh = cand["same_inputs_us"], cand["fresh_inputs_us"]
            lines.append(
                f"{rec['case'][:28]:28} {cand['tactic'][:34]:34} "
                f"{statistics.median(same):8.3f} {relative_iqr(same):6.2%} "
                f"{statistics.median(fresh):8.3f} {relative_iqr(fresh):6.2%}"
            )
        for name, runs in rec["tuning_runs"].items():
            picks = [r["pick"] for r in runs]
            distinct = len(set(picks))
            lines.append(
                f"{'':28} tuner {name}: {distinct} distinct pick(s) in {len(picks)} runs"
                f" ({', '.join(sorted(set(picks)))[:90]})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON result"
    )
    parser.add_argument("--sessions", type=positive_int, default=8, help="sessions per setting")
    parser.add_argument("--runs", type=positive_int, default=6, help="tuning runs per case")
    parser.add_argument("--top", type=positive_int, default=4, help="candidates sampled per case")
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        help="case name (as in the table), repeatable (default: a fixed set)",
    )
    parser.add_argument(
        "--tuners",
        type=name_list(tuple(TUNERS), "tuner"),
        default=",".join(TUNERS),
        help="comma-separated tuner configurations",
    )
    parser.add_argument("--commit", default=None, help="commit to record (default: git)")
    args = parser.parse_args(argv)
    args.tuners = list(args.tuners)
    wanted = args.only or list(DEFAULT_CASES)
    known = [case_name(c) for c in tuning.cases(quick=False)]
    unknown = [name for name in wanted if name not in known]
    if unknown:  # else that case is skipped without a word
        parser.error(f"--only {unknown[0]!r} is no case; cases: {known}")
    chosen = [c for c in tuning.cases(quick=False) if case_name(c) in wanted]
    device = _common.require_cuda_or_exit("tuning_stability.py")
    name = f"tuning-stability-{_common.gpu_slug(torch.cuda.get_device_name(device))}.json"
    target = args.out / name
    check_script_output(target, "--out", parser)  # before the work: exit 2 on a bad --out
    records = []
    began = time.perf_counter()
    for case in chosen:
        print(f"--- {case_name(case)}", flush=True)
        records.append(run_case(case, device, args))
    payload = {
        "benchmark": "tuning_stability",
        "provenance": _common.provenance(args.commit, device),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cases": records,
        "wall_s": time.perf_counter() - began,
    }
    path = _common.write_json(target, payload)  # target, or the fallback file it went to instead
    print(json.dumps({"wrote": str(path), "wall_s": payload["wall_s"]}))
    print(table(records))
    # Exit 1 when the result went to the temporary folder: a script would find no file at target.
    return 0 if report_written("--out", target, path) else 1


if __name__ == "__main__":
    sys.exit(main())
