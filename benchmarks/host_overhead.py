#!/usr/bin/env python3
"""graphtune's own host time per step: look-ups, per-launch Python, an eager forward.

Usage (from the repository root, without ``TRITON_INTERPRET``; CPU only, so it runs on any
machine, the GPU host included):

    PYTHONPATH=src python3 benchmarks/host_overhead.py --out benchmarks/results [--quick]

A CUDA graph replay hides host time, but every capture, every eager step and every one of the
tuner's timing captures pays it, so it decides capture time (issue 15) and much of tuning time
(issue 14). Measured here, on CPU tensors, as the median of ``--repeats`` samples:

1. ``lookup_us``: a memoised ``AutoTuner.choose_one`` hit of the GEMM op;
2. ``launch_us``: graphtune's host code per ``runner.launch`` of every Triton runner
   (``graphtune.bench.runner_cases``, the cases at one row) with ``run_kernel`` replaced by a
   stand-in that still runs ``pdl_meta`` and launches nothing: the part before Triton's launch;
3. ``forward_ms``: one eager forward of the tiny preset cut to 16 layers at batch 8, tuned (on
   the CPU every op has only its torch runner), a step of the same structure as the 1B
   model's at almost no compute.

Each run records its process's ``host_speed`` (``graphtune.bench.host_speed``), so runs from
different machines or processes can be compared. Writes ``host-overhead-<device>.json`` into
``--out`` and prints a table last.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from graphtune import bench
from graphtune.cli._args import Parser, check_script_output, positive_int, report_written
from graphtune.reporting import render_table


def per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` samples of ``calls`` back-to-back calls, µs per call (the
    toolkit's wall-clock timing on the CPU)."""
    return 1e3 * bench.time_per_call_ms(fn, torch.device("cpu"), calls, repeats, warmup=1)


def lookup_us(calls: int, repeats: int) -> float:
    from graphtune.autotuner import AutoTuner, autotune
    from graphtune.ops.gemm import gemm_config
    from graphtune.ops.gemm.op import OP_NAME, gemm_runners

    tuner = AutoTuner(show_progress=False)
    inputs = [torch.randn(4, 64), torch.randn(96, 64), None, None, False]
    runners, config = gemm_runners(), gemm_config(8)
    # tune=True: this must tune; GRAPHTUNE_CACHE_ONLY (meant for serving) would make it look-ups.
    with autotune(tuner=tuner, tune=True):
        tuner.choose_one(OP_NAME, runners, config, inputs)
    return per_call_us(lambda: tuner.choose_one(OP_NAME, runners, config, inputs), calls, repeats)


def launch_us(calls: int, repeats: int) -> dict[str, float | str]:
    from graphtune.bench.runner_cases import launches_replaced, runner_cases
    from graphtune.ops._pdl import pdl_meta

    def stand_in(kernel: Any, grid: Any, args: tuple[Any, ...], meta: dict, warmup: bool) -> None:
        pdl_meta(kernel, args, meta)  # what run_kernel does before Triton's launch

    # The smallest row count of each runner (1; 2 for the GEMMs that offer nothing for one row).
    cases = [c for c in runner_cases() if "m=8" not in c[0] and "float32" not in c[0]]
    out: dict[str, float | str] = {}
    with launches_replaced(stand_in):
        for label, runner, inputs in cases:
            tactic = runner.tactics_for(inputs)[0]
            try:
                call = functools.partial(runner.launch, inputs, tactic)
                out[label] = per_call_us(call, calls, repeats)
            except Exception as exc:  # a case that cannot run here is reported, not fatal
                out[label] = f"{type(exc).__name__}: {exc}"
    return out


def forward_ms(calls: int, repeats: int) -> float:
    from graphtune.autotuner import AutoTuner
    from graphtune.engine.build import build_step
    from graphtune.engine.kv_cache import KVCache
    from graphtune.engine.model import random_model
    from graphtune.engine.presets import get_preset
    from graphtune.engine.tuning import tune_step

    config = get_preset("tiny").replace(num_layers=16)
    cache = KVCache(config, 8, 64, torch.device("cpu"), torch.float32)
    step = build_step(random_model(config), cache, tuner=AutoTuner(show_progress=False))
    tune_step(step)
    args = step.example_inputs(8)
    with torch.no_grad():
        return per_call_us(lambda: step(*args), calls, repeats) / 1e3


def main(argv: list[str] | None = None) -> int:
    from graphtune.ops._triton import kernels_interpreted, triton_available

    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the JSON result (required)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer calls (tests)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed repeats of each")
    parser.add_argument("--commit", default=None, help="commit to record (default: git)")
    args = parser.parse_args(argv)
    target = args.out / "host-overhead-cpu.json"
    check_script_output(target, "--out", parser)  # before the work: exit 2 on a bad --out
    if triton_available() and kernels_interpreted():
        print(
            "error: TRITON_INTERPRET is set, so the tuned forward would time every Triton "
            "tactic in the interpreter; run without it",
            file=sys.stderr,
        )
        return 2
    scale = 20 if args.quick else 1
    result = {
        "benchmark": "host_overhead",
        "provenance": bench.provenance(args.commit, "cpu"),
        "host_speed": bench.host_speed(),
        "lookup_us": lookup_us(20000 // scale, args.repeats),
        "launch_us": launch_us(3000 // scale, args.repeats),
        "forward_ms": forward_ms(200 // scale, args.repeats),
    }
    path = bench.write_json(target, result)
    rows = [("memoised look-up, us", f"{result['lookup_us']:.2f}")]
    rows += [
        (f"launch: {label}, us", f"{v:.2f}" if isinstance(v, float) else v)
        for label, v in result["launch_us"].items()
    ]
    rows.append(("eager forward, tiny x 16 layers, batch 8, ms", f"{result['forward_ms']:.3f}"))
    print(render_table("graphtune host time (CPU)", ["measurement", "value"], rows))
    # Exit 1 when the result went to the temporary folder: a script would find no file at target.
    return 0 if report_written("--out", target, path) else 1


if __name__ == "__main__":
    raise SystemExit(main())
