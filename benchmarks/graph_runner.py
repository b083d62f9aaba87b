#!/usr/bin/env python3
"""CUDAGraphRunner against eager, a hand-written CUDA graph, and the GPU-busy limit.

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/graph_runner.py --out benchmarks/results [--quick]

The step is the engine's own untuned decode step (``graphtune.bench.graph_steps.
engine_decode_step``: ``build_step`` over ``llama-1b-shape`` in bf16 with random weights, a KV
cache of 257 slots x 528 positions filled with random values), every request at position 512;
the runner is the engine's (``build_runner``: padded rows write the scratch slot).

Per batch size: eager ms, runner ms (padding, copy-in and slicing included), a hand-written
``torch.cuda.graph`` of the step at exactly that size (no padding, no copies), and the GPU-busy
time (sum of the step's CUDA kernel durations from CUPTI). Then the capture time and pool memory
of the default size list up to 256, and pool memory with one pool per graph.

Targets (H200): runner <= 1.05x hand-written at every captured size; full default-list capture
<= 5 s; shared pool <= 0.7x separate pools. Times are CUDA-event medians over repeats after
warm-up, on random inputs. Writes ``graph-runner-<gpu>.json`` into ``--out``, prints a one-line
JSON summary and the table last. Exits 2 without CUDA or for an --out that cannot be written, 1 if
a target failed or the result went to the temporary folder, else 0.
"""

from __future__ import annotations

import gc
import json
import math
import time
from pathlib import Path

import torch

from graphtune import bench
from graphtune.bench.graph_steps import engine_decode_step, hand_written_graph, step_inputs
from graphtune.cli._args import Parser, check_script_output, report_written
from graphtune.engine.build import build_runner
from graphtune.engine.step import step_pad_rule
from graphtune.graphs import CUDAGraphRunner, default_capture_sizes
from graphtune.reporting import render_table

MIB = 1024 * 1024
CONTEXT = 512
TARGET_RATIO, TARGET_CAPTURE_S, TARGET_POOL = 1.05, 5.0, 0.7


def time_ms(fn, *, reps: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean per-call time of ``reps`` back-to-back calls."""
    return bench.time_per_call_ms(
        fn, torch.device("cuda", torch.cuda.current_device()), reps, repeats
    )


def reserved_clean() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def capture_run(step, max_batch, example, *, share_pool):
    if share_pool:
        runner = build_runner(step, "graph")
    else:
        runner = CUDAGraphRunner(
            step,
            max_batch_size=max_batch,
            share_pool=False,
            pad=step_pad_rule(step.cache.scratch_slot),
        )
    before = reserved_clean()
    start = time.perf_counter()
    runner.capture(*example)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    info = {
        "sizes": len(runner.capture_sizes),
        "graphs": runner.stats.graphs,
        "failed": [r.error for r in runner.stats.failed_captures],
        "capture_wall_s": wall,
        "capture_s": runner.stats.capture_seconds,
        "warmup_s": runner.stats.warmup_seconds,
        "pool_mib": runner.stats.pool_bytes / MIB,
        "reserved_growth_mib": (torch.cuda.memory_reserved() - before) / MIB,
    }
    return runner, info, before


def measure_size(step, runner, b, *, captured, reps, repeats) -> dict:
    """Eager, runner, hand-written graph and GPU-busy time of one batch size."""
    inputs = step_inputs(step, b, CONTEXT, seed=b)
    eager_ms = time_ms(lambda: step(*inputs), reps=max(2, reps // 2), repeats=repeats)
    runner_ms = time_ms(lambda: runner(*inputs), reps=reps, repeats=repeats)
    got = runner(*inputs).clone()
    graph, hand_out = hand_written_graph(step, inputs)
    hand_ms = time_ms(graph.replay, reps=reps, repeats=repeats)
    graph.replay()
    # Same kernels on the same data: at a captured size the outputs must be identical.
    same = bool(torch.equal(got, hand_out)) if captured else None
    del graph, hand_out
    busy = bench.cupti_kernel_time(lambda i: step(*inputs), calls=3, warmup=1)
    return {
        "batch": b,
        "captured": captured,
        "eager_ms": eager_ms,
        "runner_ms": runner_ms,
        "hand_graph_ms": hand_ms,
        "gpu_busy_ms": busy.per_call_us / 1000,
        "kernels_per_step": busy.kernels_per_call,
        "runner_vs_hand": runner_ms / hand_ms,
        "runner_equals_hand_graph": same,
    }


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the JSON result (required)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--commit", default=None, help="commit to record (default: git)")
    args = parser.parse_args(argv)
    device = bench.require_cuda_or_exit("graph_runner.py")
    target = args.out / f"graph-runner-{bench.gpu_slug(torch.cuda.get_device_name(device))}.json"
    check_script_output(target, "--out", parser)  # before the work: exit 2 on a bad --out
    torch.backends.cuda.matmul.allow_tf32 = False

    max_batch = 256
    sizes = [1, 8, 64, 3] if args.quick else [1, 8, 32, 64, 128, 256, 3, 50]
    reps, repeats = (5, 3) if args.quick else (10, 5)
    step = engine_decode_step(max_batch, CONTEXT + 16)
    captured = set(default_capture_sizes(max_batch))
    print(f"graph_runner: the engine's llama-1b-shape step on {torch.cuda.get_device_name(device)}")

    # Capture the default list into one shared pool (timed), then keep this runner for timing.
    example = step.example_inputs(max_batch)
    runner, shared, before = capture_run(step, max_batch, example, share_pool=True)
    print(
        f"  captured {shared['graphs']} sizes in {shared['capture_wall_s']:.2f} s, "
        f"pool {shared['pool_mib']:.0f} MiB"
    )

    rows, results = [], []
    for b in sizes:
        entry = measure_size(step, runner, b, captured=b in captured, reps=reps, repeats=repeats)
        results.append(entry)
        same = entry["runner_equals_hand_graph"]
        rows.append(
            (
                b,
                "yes" if entry["captured"] else "padded",
                entry["eager_ms"],
                entry["runner_ms"],
                entry["hand_graph_ms"],
                entry["gpu_busy_ms"],
                entry["runner_vs_hand"],
                "-" if same is None else str(same),
            )
        )
        print(
            f"  batch {b}: eager {entry['eager_ms']:.2f} ms, runner {entry['runner_ms']:.3f} ms, "
            f"hand graph {entry['hand_graph_ms']:.3f} ms, busy {entry['gpu_busy_ms']:.3f} ms"
        )

    replays = runner.stats.replays
    runner.release()
    after_release = reserved_clean()
    separate_runner, separate, _ = capture_run(step, max_batch, example, share_pool=False)
    separate_runner.release()

    pool_ratio = shared["pool_mib"] / separate["pool_mib"] if separate["pool_mib"] else math.nan
    worst = max(r["runner_vs_hand"] for r in results if r["captured"])
    targets = {
        "runner_vs_hand_max": {
            "value": worst,
            "target": TARGET_RATIO,
            "pass": worst <= TARGET_RATIO,
        },
        "capture_s": {
            "value": shared["capture_wall_s"],
            "target": TARGET_CAPTURE_S,
            "pass": shared["capture_wall_s"] <= TARGET_CAPTURE_S,
        },
        "shared_vs_separate_pool": {
            "value": pool_ratio,
            "target": TARGET_POOL,
            "pass": pool_ratio <= TARGET_POOL,
        },
        "replay_equals_hand_graph": {
            "value": all(r["runner_equals_hand_graph"] is not False for r in results),
            "target": True,
        },
    }
    targets["replay_equals_hand_graph"]["pass"] = targets["replay_equals_hand_graph"]["value"]
    ok = all(t["pass"] for t in targets.values())
    payload = {
        "benchmark": "graph_runner",
        "quick": args.quick,
        "provenance": bench.provenance(args.commit, device),
        "step": {
            "model": step.model.config.name,
            "step": "engine (build_step, untuned)",
            "max_seq_len": step.cache.max_seq_len,
            "position": CONTEXT,
            "dtype": "bf16",
        },
        "timing": {"method": "CUDA events, median of repeats", "reps": reps, "repeats": repeats},
        "sizes": results,
        "capture_shared_pool": shared,
        "capture_separate_pools": separate,
        "memory": {
            "reserved_before_capture_mib": before / MIB,
            "reserved_after_release_mib": after_release / MIB,
        },
        "runner_replays": replays,
        "targets": targets,
        "pass": ok,
    }
    path = bench.write_json(target, payload)  # target, or the fallback file it went to instead
    summary = {
        k: (
            round(v["value"], 4) if isinstance(v["value"], float) else v["value"],
            "pass" if v["pass"] else "FAIL",
        )
        for k, v in targets.items()
    }
    print(json.dumps({"graph_runner": summary, "pass": ok, "json": str(path)}))
    table = render_table(
        "graph runner vs eager vs hand-written graph (ms per step)",
        [
            "batch",
            "captured",
            "eager",
            "runner",
            "hand graph",
            "GPU busy",
            "runner/hand",
            "== hand",
        ],
        rows,
    )
    memory = render_table(
        "capture of the default size list (up to 256)",
        ["pool", "graphs", "capture s", "pool MiB", "target"],
        [
            (
                "shared",
                shared["graphs"],
                shared["capture_wall_s"],
                shared["pool_mib"],
                f"capture <= {TARGET_CAPTURE_S} s: "
                f"{'pass' if targets['capture_s']['pass'] else 'FAIL'}",
            ),
            (
                "separate",
                separate["graphs"],
                separate["capture_wall_s"],
                separate["pool_mib"],
                f"shared/separate {pool_ratio:.2f} <= {TARGET_POOL}: "
                f"{'pass' if targets['shared_vs_separate_pool']['pass'] else 'FAIL'}",
            ),
        ],
    )
    print(memory)
    print(
        f"runner/hand-written worst at captured sizes: {worst:.3f} (target <= {TARGET_RATIO}: "
        f"{'pass' if targets['runner_vs_hand_max']['pass'] else 'FAIL'})"
    )
    print(table)
    # Exit 1 also when the result went to the temporary folder: no file at target for a script.
    return 0 if report_written("--out", target, path) and ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
