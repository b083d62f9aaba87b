#!/usr/bin/env python3
"""The engine's memory plan on a GPU: a KV cache sized to ``gpu_memory_utilization``.

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/memory_plan.py --out benchmarks/results [--quick]

Builds ``Engine(llama-1b-shape, max_batch_size=256, max_seq_len=32768, gpu_memory_utilization=0.9)``
(bf16, random weights; decode and prefill graphs; a slot of 32768 positions is 1 GiB, so the
memory, not max_batch_size, decides the slots): the engine profiles its steps and graphs,
sizes the KV cache to what is left and captures. Prints the plan table (weights, other memory
in use, step constants, activations, graphs, KV cache, headroom) and checks that the device
memory in use after start-up stays within the budget, then serves a few requests. ``--quick``
uses ``max_batch_size=64``. Writes ``memory-plan-<gpu>.json`` into ``--out``; the table is printed
last. Exits 2 without CUDA or for an --out that cannot be written, 1 if the engine used more than
its budget or the result went to the temporary folder, else 0.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from graphtune import bench
from graphtune.cli._args import Parser, check_script_output, report_written
from graphtune.engine import Engine, load_model

FRACTION, MAX_SEQ_LEN = 0.9, 32768
TOLERANCE = 1.02  # the plan is profiled: allow 2% of the budget for what profiling cannot see


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the JSON result (required)"
    )
    parser.add_argument("--quick", action="store_true", help="max_batch_size 64")
    parser.add_argument("--commit", default=None, help="commit to record (default: git)")
    args = parser.parse_args(argv)
    device = bench.require_cuda_or_exit("memory_plan.py")
    target = args.out / f"memory-plan-{bench.gpu_slug(torch.cuda.get_device_name(device))}.json"
    check_script_output(target, "--out", parser)  # before the work: exit 2 on a bad --out
    batch = 64 if args.quick else 256
    model = load_model("llama-1b-shape", device=device, dtype=torch.bfloat16, seed=0)
    start = time.perf_counter()
    engine = Engine(
        model, max_batch_size=batch, max_seq_len=MAX_SEQ_LEN, gpu_memory_utilization=FRACTION
    )
    seconds = time.perf_counter() - start
    plan = engine.memory_plan
    within = plan.measured_in_use_bytes <= TOLERANCE * plan.budget_bytes
    with torch.inference_mode():
        out = engine.generate([[1, 2, 3, 4]] * 8, 8, stop_token_ids=[])
    served = [len(o) for o in out] == [8] * 8
    payload = {
        "benchmark": "memory_plan",
        "provenance": bench.provenance(args.commit, device),
        "engine": {
            "model": model.config.name,
            "max_batch_size_asked": batch,
            "max_seq_len": engine.max_seq_len,
            "gpu_memory_utilization": FRACTION,
            "start_seconds": seconds,
            "decode_graphs": engine.stats.graphs,
            "prefill_graphs": engine.prefill_stats.graphs,
        },
        "plan": plan.as_dict(),
        "within_budget": within,
        "served": served,
        "pass": within and served,
    }
    path = bench.write_json(target, payload)  # target, or the fallback file it went to instead
    summary = {"slots": plan.slots, "within_budget": within, "served": served, "json": str(path)}
    print(json.dumps({"memory_plan": summary, "pass": payload["pass"]}))
    print(f"engine start-up (profile, size, capture) {seconds:.1f} s")
    print(plan.table())
    engine.release()
    # Exit 1 also when the result went to the temporary folder: no file at target for a script.
    return 0 if report_written("--out", target, path) and payload["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
