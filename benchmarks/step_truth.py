#!/usr/bin/env python3
"""Which per-op time predicts the decode step: every candidate of every profile, pinned in the step.

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/step_truth.py --out benchmarks/results
        [--model llama-1b-shape] [--batches 1,8,16,32] [--context 512] [--ops gemm,...]
        [--rounds 11] [--steps-per-graph 2] [--refine [--skip-profiles]] [--commit SHA]
        [--label TEXT]

``benchmarks/tuning.py`` judges the tuner's picks against two truths measured on the op alone
(the kernel sum of one eager call, and the span per call of 20-200 back-to-back calls in one CUDA
graph). Neither is the time that counts, which is the decode step's: there an op sits between
other kernels, each launched with PDL where it can be. This script measures that directly.

The engine's step of ``--model`` (random weights, bf16, batches up to the largest of
``--batches``) is tuned by ``graphtune.engine.tuning.tune_step`` with the default tuner. Then, at
each batch (rows in KV-cache slots ``0..B-1`` at position ``--context``, the cache filled with
random values), the step's op calls are recorded, and for every cached profile that the step
looks up and whose tuning measured at least two candidates (``AutoTuner.history``), each candidate
is pinned (``AutoTuner.pin``) and the whole step captured in a CUDA graph of
``--steps-per-graph`` back-to-back steps. The graphs of one profile are replayed round-robin
(``--rounds`` rounds, CUDA events around each replay, the median per step), with the tuner's own
pick captured twice (first and last) so the table shows the noise. Beside it, each candidate's
in-graph CUPTI truth on the op alone (``graphtune.bench.cupti_sweep.cupti_graph_sweep`` on copies
of the step's inputs), and the tuner's own median.

Reported per (batch, profile): the step time of each candidate; the step cost of the tuner's pick,
of the in-graph truth's best and of the tuner's fastest, over the best candidate's (``*_delta_us``,
per step, for all the profile's calls in a step); the Spearman rank correlation of the tuner's
times and of the in-graph truth with the step times.

With ``--refine``, ``graphtune.engine.step_refine.refine_in_step`` then runs at ``--batches``
(rows in slots ``0..B-1`` at the cache's last position): the step as tuned and the step after
refinement are captured in this process and replayed side by side (``4 x --rounds`` rounds),
with the refinement's own seconds and what it switched (``refine``). Writes
``step-truth-<gpu>[-label].json`` with provenance and prints the table last. Exits 2 without CUDA
or for an ``--out`` that cannot be written, 1 when the result went to the temporary folder
instead, else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tuning_scores import spearman  # noqa: E402

from graphtune import bench  # noqa: E402
from graphtune.autotuner import AutoTuner  # noqa: E402
from graphtune.bench.cupti_graph import graph_calls_for  # noqa: E402
from graphtune.bench.cupti_sweep import cupti_graph_sweep  # noqa: E402
from graphtune.bench.graphs import capture_calls, capture_stream, release  # noqa: E402
from graphtune.cli._args import (  # noqa: E402
    Parser,
    batch_sizes,
    check_script_output,
    non_negative_int,
    positive_int,
    report_written,
)
from graphtune.engine.step_refine import (  # noqa: E402
    profile_record,
    refine_in_step,
    whole_step_inputs,
)

logger = logging.getLogger("benchmarks.step_truth")


def time_graphs(
    graphs: Sequence[torch.cuda.CUDAGraph | None], *, rounds: int, steps_per_graph: int
) -> list[float]:
    """Median µs per step of each graph, replayed round-robin (``inf`` for ``None``).

    Each round starts with an unmeasured replay, so the first measured replay does not start on
    an idle GPU (its events would then hold the host's launch latency); a drift of clocks hits
    every graph alike.
    """
    stream = capture_stream()
    live = [g for g in graphs if g is not None]
    samples: list[list[float]] = [[] for _ in graphs]
    with torch.cuda.stream(stream):
        for graph in live:
            graph.replay()  # upload; never measured
        for _ in range(rounds):
            if live:
                live[-1].replay()
            events = []
            for graph in graphs:
                if graph is None:
                    events.append(None)
                    continue
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                events.append((start, end))
            stream.synchronize()
            for row, pair in zip(samples, events, strict=True):
                if pair is not None:
                    row.append(pair[0].elapsed_time(pair[1]) * 1000.0 / steps_per_graph)
    return [statistics.median(row) if row else math.inf for row in samples]


def capture_step(run_step: Callable[[], object], steps: int) -> torch.cuda.CUDAGraph | None:
    """A graph of ``steps`` back-to-back steps as the tuner's cache stands now (``None`` when it
    cannot be captured)."""
    try:
        return capture_calls(lambda _: run_step(), steps, stream=capture_stream())
    except RuntimeError as exc:
        logger.warning("step capture failed: %s", exc)
        return None


def step_times(
    run_step: Callable[[], object],
    pins: Sequence[Callable[[], None]],
    *,
    rounds: int,
    steps_per_graph: int,
) -> list[float]:
    """Median µs per step of the step as each ``pins[i]()`` leaves the tuner's cache.

    Each pin is applied just before its graph is captured (the step reads the cache on the host,
    so the graph holds that candidate), then :func:`time_graphs` races the graphs.
    """
    graphs = []
    for pin in pins:
        pin()
        graphs.append(capture_step(run_step, steps_per_graph))
    try:
        return time_graphs(graphs, rounds=rounds, steps_per_graph=steps_per_graph)
    finally:
        for graph in graphs:
            if graph is not None:
                release(graph)


def refine_ab(step: Any, tuner: AutoTuner, batches: list[int], args: argparse.Namespace) -> dict:
    """The step as tuned against the step after ``refine_in_step`` at ``batches``, each graph
    captured in this process and replayed side by side; the refinement's own time and rows."""
    from graphtune.autotuner.timing import resolve_timer

    def runner(batch: int) -> Callable[[], None]:
        inputs = whole_step_inputs(step, batch)
        return lambda: step.decode(step.ops, *inputs)

    with torch.no_grad():
        before = [capture_step(runner(b), args.steps_per_graph) for b in batches]
        began = time.perf_counter()
        refined = refine_in_step(step, resolve_timer("graph", step.model.device), buckets=batches)
        seconds = time.perf_counter() - began
        after = [capture_step(runner(b), args.steps_per_graph) for b in batches]
    times = time_graphs(
        before + after, rounds=4 * args.rounds, steps_per_graph=args.steps_per_graph
    )
    for graph in before + after:
        if graph is not None:
            release(graph)
    n = len(batches)
    return {
        "refine_s": seconds,
        "by_batch": [
            {"batch": b, "tuned_us": t, "refined_us": r, "ratio": r / t}
            for b, t, r in zip(batches, times[:n], times[n:], strict=True)
        ],
        "refinements": [dataclasses.asdict(r) for r in refined],
    }


def _copied(inputs: Sequence[Any]) -> list[Any]:
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]


def profile_rows(
    step: Any, tuner: AutoTuner, batch: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Every measured profile the step looks up at ``batch``: its candidates' three times."""
    rows_idx = torch.arange(batch, dtype=torch.long, device=step.model.device)
    positions = torch.full_like(rows_idx, args.context)
    inputs = (torch.zeros_like(rows_idx), positions, rows_idx)

    def run_step() -> None:
        step.decode(step.ops, *inputs)

    with torch.no_grad(), tuner.record_calls(dry_run=True) as calls:
        run_step()
    keys: dict[Any, list[Any]] = {}
    for call in calls:
        found = tuner.cached(call)
        if found is not None:
            keys.setdefault(found[0], [call, found[1], 0])[2] += 1
    wanted = [s for s in args.ops.split(",") if s]
    rows = []
    for key, (call, entry, count) in keys.items():
        record = profile_record(tuner, call)
        if wanted and not any(w in call.op for w in wanted) or record is None:
            continue
        cands = [c for c in record.candidates if c.failed is None and math.isfinite(c.median_us)]
        if len(cands) >= 2:
            began = time.perf_counter()
            row = measure_profile(tuner, call, key, entry, cands, run_step, args)
            rows.append(
                summarize_profile(batch, call.op, record.profile, count, *row)
                | {"seconds": time.perf_counter() - began}
            )
            logger.info("batch %d %s %s: %d candidates", batch, call.op, record.profile, len(cands))
    return rows


def measure_profile(
    tuner: AutoTuner,
    call: Any,
    key: Any,
    entry: Any,
    cands: list[Any],
    run_step: Callable[[], None],
    args: argparse.Namespace,
) -> tuple[list[float], list[dict[str, Any]]]:
    """Step times (the pick first and last, then each candidate pinned) and each candidate's
    row; the cached pick is put back afterwards."""

    def pin_to(index: int, tactic: Any) -> Callable[[], None]:
        return lambda: tuner.pin(call, index, tactic)

    def restore() -> None:
        tuner.cache.put(key, entry)

    pins = [restore, *(pin_to(c.runner_index, c.tactic) for c in cands), restore]
    with torch.no_grad():
        steps = step_times(run_step, pins, rounds=args.rounds, steps_per_graph=args.steps_per_graph)
    restore()
    op_inputs = _copied(call.inputs)

    def op_fn(index: int, tactic: Any) -> Callable[[int], object]:
        runner = call.runners[index]
        return lambda _: runner.forward(op_inputs, tactic=tactic, **call.kwargs)

    with torch.no_grad():
        truths = cupti_graph_sweep(
            [op_fn(c.runner_index, c.tactic) for c in cands],
            [graph_calls_for(c.median_us) for c in cands],
            replays=args.rounds,
        )
    rows = [
        {
            "runner": c.runner,
            "runner_index": c.runner_index,
            "tactic": c.tactic,
            "tuner_us": c.median_us,
            "graph_truth_us": t["per_call_us"],
            "step_us": s,
            "picked": c.runner_index == entry.runner_index and c.tactic == entry.tactic,
        }
        for c, t, s in zip(cands, truths, steps[1:-1], strict=True)
    ]
    return steps, rows


def summarize_profile(
    batch: int,
    op: str,
    profile: str,
    calls_per_step: int,
    steps: Sequence[float],
    cands: list[dict[str, Any]],
) -> dict[str, Any]:
    """Step cost over the best candidate of each way to pick, and rank agreement."""
    step_us = [c["step_us"] for c in cands]
    best = min(step_us)

    def delta_of(metric: str) -> float:
        index = min(range(len(cands)), key=lambda i: cands[i][metric])
        return step_us[index] - best

    pick_step = statistics.mean([steps[0], steps[-1]])
    return {
        "batch": batch,
        "op": op,
        "profile": profile,
        "calls_per_step": calls_per_step,
        "candidates": cands,
        "pick_step_us": [steps[0], steps[-1]],
        "best_step_us": best,
        "best": cands[step_us.index(best)]["runner"] + f" {cands[step_us.index(best)]['tactic']}",
        "pick_delta_us": pick_step - best,
        "pick_noise_us": abs(steps[0] - steps[-1]),
        "tuner_best_delta_us": delta_of("tuner_us"),
        "graph_truth_best_delta_us": delta_of("graph_truth_us"),
        "rho_tuner": spearman([c["tuner_us"] for c in cands], step_us),
        "rho_graph_truth": spearman([c["graph_truth_us"] for c in cands], step_us),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """One line per profile, then the sums per batch."""

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        f"{'B':>3} {'op':<22} {'profile':<26} {'n':>3} {'calls':>5} {'step':>8} "
        f"{'pick+':>6} {'noise':>6} {'tuner+':>6} {'truth+':>6} {'rho t':>5} {'rho g':>5}  best"
    ]
    for r in rows:
        lines.append(
            f"{r['batch']:>3} {r['op'][:22]:<22} {r['profile'][:26]:<26} "
            f"{len(r['candidates']):>3} {r['calls_per_step']:>5} {r['best_step_us']:>8.1f} "
            f"{r['pick_delta_us']:>6.2f} {r['pick_noise_us']:>6.2f} "
            f"{r['tuner_best_delta_us']:>6.2f} {r['graph_truth_best_delta_us']:>6.2f} "
            f"{fmt(r['rho_tuner']):>5} {fmt(r['rho_graph_truth']):>5}  {r['best'][:40]}"
        )
    for batch in sorted({r["batch"] for r in rows}):
        mine = [r for r in rows if r["batch"] == batch]
        lines.append(
            f"batch {batch}: step cost over each profile's best, summed: pick "
            f"{sum(r['pick_delta_us'] for r in mine):.1f} us, in-graph truth's best "
            f"{sum(r['graph_truth_best_delta_us'] for r in mine):.1f} us, tuner's fastest "
            f"{sum(r['tuner_best_delta_us'] for r in mine):.1f} us"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the JSON result (required)"
    )
    parser.add_argument("--model", default="llama-1b-shape", help="preset or HF folder")
    parser.add_argument(
        "--batches", type=batch_sizes, default="1,8,16,32", help="batch sizes, comma-separated"
    )
    parser.add_argument(
        "--context", type=non_negative_int, default=512, help="position of every row"
    )
    parser.add_argument(
        "--ops", default="", help="only ops whose name contains one of these (default: all ops)"
    )
    parser.add_argument("--rounds", type=positive_int, default=11, help="replay rounds per profile")
    parser.add_argument("--steps-per-graph", type=positive_int, default=2, help="steps per graph")
    parser.add_argument(
        "--refine",
        action="store_true",
        help="also run refine_in_step at --batches and time the step before and after it",
    )
    parser.add_argument(
        "--skip-profiles", action="store_true", help="skip the per-profile pinning (with --refine)"
    )
    parser.add_argument("--commit", help="commit to record (default: git)")
    parser.add_argument("--label", help="suffix of the result file name (default: none)")
    args = parser.parse_args(argv)
    if args.skip_profiles and not args.refine:
        parser.error("--skip-profiles without --refine would measure nothing; add --refine")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = bench.require_cuda_or_exit("step_truth.py")
    name = f"step-truth-{bench.gpu_slug(torch.cuda.get_device_name(device))}"
    target = args.out / (f"{name}-{args.label}.json" if args.label else f"{name}.json")
    check_script_output(target, "--out", parser)  # before the work: exit 2 on a bad --out
    from graphtune.cli._step_calls import decode_step
    from graphtune.engine.tuning import tune_step

    batches = list(args.batches)
    tuner = AutoTuner(show_progress=False)
    step = decode_step(
        args.model, max(batches), tuner, device=device, dtype=torch.bfloat16,
        max_seq_len=args.context + 16,
    )  # fmt: skip
    step.cache.fill_random(0)
    began = time.perf_counter()
    tune_step(step)
    tune_s = time.perf_counter() - began
    rows: list[dict[str, Any]] = []
    for batch in batches if not args.skip_profiles else []:
        rows.extend(profile_rows(step, tuner, batch, args))
    refined = refine_ab(step, tuner, batches, args) if args.refine else None
    path = bench.write_json(  # target, or the fallback file it went to instead
        target,
        {
            "provenance": bench.provenance(args.commit),
            "options": {k: v if not isinstance(v, Path) else str(v) for k, v in vars(args).items()},
            "tune_s": tune_s,
            "profiles": rows,
            "history": [dataclasses.asdict(r) for r in tuner.history],
            "refine": refined,
        },
    )
    print(table(rows))
    if refined is not None:
        switched = sum(r["switched"] for r in refined["refinements"])
        print(
            f"in-step refinement: {switched} of {len(refined['refinements'])} profiles switched "
            f"in {refined['refine_s']:.1f} s"
        )
        for row in refined["by_batch"]:
            print(
                f"batch {row['batch']:>3}: tuned {row['tuned_us']:8.1f} us, refined "
                f"{row['refined_us']:8.1f} us ({row['ratio']:.3f}x)"
            )
    # Exit 1 when the result went to the temporary folder: a script would find no file at target.
    return 0 if report_written("--out", target, path) else 1


if __name__ == "__main__":
    sys.exit(main())
