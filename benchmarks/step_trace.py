#!/usr/bin/env python3
"""Where a decode step's time goes, kernel by kernel: one CUDA-graph replay under CUPTI.

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/step_trace.py --out benchmarks/results
        [--model llama-1b-shape] [--batches 1,8] [--context 512] [--untuned] [--commit SHA]
        [--label TEXT]

The engine's step of ``--model`` (random weights, bf16, batches up to the largest of
``--batches``, the KV cache filled with random values) is tuned by
``graphtune.engine.tuning.tune_step`` (not with ``--untuned``). At each batch it is captured
alone in the graph runner (rows in slots ``0..B-1`` at position ``--context``), replayed 20
times, timed with CUDA events (``graphtune.bench.time_per_call_ms``: median of 7 repeats of 20
replays), and profiled over 3 replays (``torch.profiler``: CUPTI). The last replay is laid out
by ``graphtune.bench.timeline``: each kernel's CUPTI duration and its end after the previous end
(what it adds to the step, with PDL's overlap taken into account).

Reported per batch: the replay's span and kernels; one middle layer's kernels (the step's
repeating per-layer sequence, found with ``repeating_block``), with the head before the first
layer and the tail after the last; the sums per kernel name. Writes
``step-trace-<model>-<gpu>[-label].json`` (every row of every batch) with provenance and prints
the tables last. Exits 2 without CUDA or for an ``--out`` that cannot be written, 1 when the
result went to the temporary folder instead, else 0.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from graphtune import bench
from graphtune.autotuner import AutoTuner
from graphtune.bench.graph_steps import step_inputs
from graphtune.bench.timeline import TimelineRow, by_name, last_replay, repeating_block, timeline
from graphtune.cli._args import (
    Parser,
    batch_sizes,
    check_script_output,
    non_negative_int,
    report_written,
)

REPLAYS = 3


def trace_batch(step: Any, batch: int, context: int) -> dict[str, Any]:
    """One batch size: event time per replay, and the last profiled replay kernel by kernel."""
    from graphtune.engine.build import build_runner

    device = step.model.device
    runner = build_runner(step, "graph", capture_sizes=[batch])
    args = step_inputs(step, batch, context)
    try:
        with torch.inference_mode():
            runner.capture(*step.example_inputs(batch))
            for _ in range(20):
                runner(*args)
            replay_ms = bench.time_per_call_ms(lambda: runner(*args), device, 20, 7)
            trace = bench.cupti.profile_trace(lambda i: runner(*args), 0, REPLAYS, False)
            if not bench.device_events_from_trace(trace):  # some builds need CPU activity too
                trace = bench.cupti.profile_trace(lambda i: runner(*args), 0, REPLAYS, True)
    finally:
        runner.release()
    rows = timeline(last_replay(bench.device_events_from_trace(trace), REPLAYS))
    layers = step.model.config.num_layers
    block = repeating_block([r.name for r in rows], max(2, layers - 1)) if layers > 2 else None
    layer: dict[str, Any] | None = None
    if block is not None:
        start, period = block
        blocks = (len(rows) - start) // period
        middle = start + (blocks // 2) * period
        tail = start + blocks * period
        layer = {
            "start": start,
            "period": period,
            "blocks": blocks,
            "middle_rows": [r.index for r in rows[middle : middle + period]],
            "head_rows": [r.index for r in rows[:start]],
            "tail_rows": [r.index for r in rows[tail:]],
        }
    return {
        "batch": batch,
        "replay_ms": replay_ms,
        "span_us": sum(r.adds_us for r in rows),
        "kernels": len(rows),
        "rows": [dataclasses.asdict(r) for r in rows],
        "layer": layer,
        "by_name": by_name(rows),
    }


def tables(found: dict[str, Any]) -> str:
    """The text printed last: per batch, one layer with the head and tail, then per name."""
    lines = []
    for entry in found["batches"]:
        rows = [TimelineRow(**r) for r in entry["rows"]]
        lines.append(
            f"batch {entry['batch']}: {entry['replay_ms'] * 1000:.1f} us a replay (CUDA events), "
            f"{entry['span_us']:.1f} us traced, {entry['kernels']} kernels"
        )
        layer = entry["layer"]
        shown = (
            [("head", layer["head_rows"]), ("one middle layer", layer["middle_rows"])]
            + [("tail", layer["tail_rows"])]
            if layer
            else [("all", [r.index for r in rows])]
        )
        for title, indices in shown:
            part = [rows[i] for i in indices]
            total = sum(r.adds_us for r in part)
            lines.append(f"  {title}: {len(part)} kernels, adds {total:.2f} us")
            for r in part:
                lines.append(f"    {r.adds_us:8.2f} {r.duration_us:8.2f}  {r.name[:70]}")
        lines.append("  per kernel name: calls, adds us, duration us, share")
        for row in entry["by_name"][:14]:
            lines.append(
                f"    {row['calls']:5d} {row['adds_us']:9.1f} {row['duration_us']:9.1f} "
                f"{100 * row['share']:5.1f}%  {row['name'][:60]}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the JSON result (required)"
    )
    parser.add_argument("--model", default="llama-1b-shape", help="preset or HF folder")
    parser.add_argument(
        "--batches", type=batch_sizes, default="1,8", help="batch sizes, comma-separated"
    )
    parser.add_argument(
        "--context", type=non_negative_int, default=512, help="position of every row"
    )
    parser.add_argument("--untuned", action="store_true", help="trace the untuned step")
    parser.add_argument("--commit", help="commit to record (default: git)")
    parser.add_argument("--label", help="suffix of the result file name (default: none)")
    args = parser.parse_args(argv)
    device = bench.require_cuda_or_exit("step_trace.py")
    slug = bench.gpu_slug(torch.cuda.get_device_name(device))
    name = f"step-trace-{args.model.replace('/', '_')}-{slug}"
    target = args.out / (f"{name}-{args.label}.json" if args.label else f"{name}.json")
    check_script_output(target, "--out", parser)  # before the work: exit 2 on a bad --out
    from graphtune.cli._step_calls import decode_step
    from graphtune.engine.tuning import tune_step

    batches = args.batches
    tuner = None if args.untuned else AutoTuner(show_progress=False)
    step = decode_step(
        args.model, max(batches), tuner, device=device, dtype=torch.bfloat16,
        max_seq_len=args.context + 16,
    )  # fmt: skip
    step.cache.fill_random(0)
    began = time.perf_counter()
    if tuner is not None:
        tune_step(step)
    found = {
        "provenance": bench.provenance(args.commit),
        "options": {k: v if not isinstance(v, Path) else str(v) for k, v in vars(args).items()},
        "tune_s": time.perf_counter() - began,
        "batches": [trace_batch(step, batch, args.context) for batch in batches],
    }
    path = bench.write_json(target, found)  # target, or the fallback file it went to instead
    print(tables(found))
    # Exit 1 when the result went to the temporary folder: a script would find no file at target.
    return 0 if report_written("--out", target, path) else 1


if __name__ == "__main__":
    sys.exit(main())
