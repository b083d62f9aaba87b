#!/usr/bin/env python3
"""Latency of the tensor-parallel decode all-reduce inside CUDA graphs: NCCL vs symmetric memory.

Usage (two GPUs, from the repository root):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=src \\
      torchrun --standalone --nproc-per-node 2 benchmarks/allreduce.py --out benchmarks/results

For each message of a decode step (``rows x 2048`` bf16, rows = batch size 1, 8, 32, 128), one
CUDA graph holds 32 back-to-back repetitions (what one Llama-1B step issues: two per layer) of:

* ``nccl`` / ``symm_mem``: a small add that writes the partial (so the all-reduce waits on a
  kernel, as in the step), then the all-reduce of :mod:`graphtune.engine.collectives`;
* ``symm_mem+norm``: the same with PyTorch's one-shot all-reduce, then the residual add + RMSNorm
  (graphtune's Triton kernel): what the tuned tensor-parallel step runs without fusion;
* ``fused``: the add, then graphtune's fused all-reduce + residual add + RMSNorm kernel.

Each graph is replayed after warm-up; the time per repetition is the median over replays (CUDA
events) / 32. Sums are checked exactly (integer-valued bf16 data, the same on every rank), and the
fused output against the unfused one. Rank 0 writes ``allreduce-<gpu>.json`` into ``--out`` and
prints a table last. Exits 2 outside torchrun or without CUDA, or for an ``--out`` that cannot be
written (every rank checks it first), 1 when the result went to the temporary folder instead.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from graphtune.bench import capture_calls, gpu_slug, provenance, release, write_json
from graphtune.cli._args import Parser, check_script_output, report_written
from graphtune.errors import ConfigError

HIDDEN = 2048
ROWS = (1, 8, 32, 128)
PER_GRAPH = 32
REPLAYS = 50


def _time_graph(body, device: torch.device) -> dict:
    """Captures ``body`` (PER_GRAPH repetitions) once and times its replays, one at a time with
    every rank starting together (a barrier before each)."""
    # The warm-up runs outside the graph (NCCL and symm_mem set up lazily).
    graph = capture_calls(lambda i: body(), 1)
    try:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(REPLAYS):
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / PER_GRAPH)
    finally:
        release(graph)
    return {"us": statistics.median(times), "min_us": min(times)}


def _measure(variant: str, reducer, rows: int, device: torch.device, rank: int) -> dict:
    """Times one variant (see the module docstring) and checks its result."""
    from graphtune.ops.rmsnorm import TritonRMSNormRunner

    # Same data on every rank (seeded), so the exact sum is known: world * base + sum(rank + 1).
    gen = torch.Generator(device=device).manual_seed(rows)
    base = torch.randint(-8, 8, (rows, HIDDEN), device=device, generator=gen).to(torch.bfloat16)
    bump = torch.full_like(base, float(rank + 1))
    weight = torch.rand(HIDDEN, device=device, generator=gen).to(torch.bfloat16) + 0.5
    residual0 = torch.randint(-8, 8, (rows, HIDDEN), device=device, generator=gen).to(base.dtype)
    residual = residual0.clone()
    out = torch.empty_like(base)
    norm = TritonRMSNormRunner()
    tactic = {"block": 1 << (HIDDEN - 1).bit_length(), "warps": 8}
    normed: list[torch.Tensor] = []

    def body() -> None:
        normed.clear()
        for i in range(PER_GRAPH):
            if variant == "fused":
                partial = torch.add(base, bump, out=reducer.fused_staging(rows, i % 2))
                normed.append(reducer.reduce_add_rms_norm(partial, residual, weight, 1e-5)[0])
                continue
            staged = reducer.staging(rows)
            partial = torch.add(base, bump, out=staged) if staged is not None else base + bump
            reducer.reduce(partial, out=out)
            if variant == "symm_mem+norm":
                normed.append(norm.forward([out, weight, residual, 1e-5], tactic)[0])

    timing = _time_graph(body, device)
    world = dist.get_world_size()
    summed = base.float() * world + sum(r + 1 for r in range(world))
    result = {"us_per_all_reduce": timing["us"], "min_us": timing["min_us"]}
    if variant in ("nccl", "symm_mem"):
        result["exact"] = torch.equal(out.float(), summed)
    else:
        # The residual is reset and the body run once more eagerly: compare against the unfused
        # torch math on the same inputs.
        residual.copy_(residual0)
        body()
        s = (residual0.float() + summed).to(base.dtype).float()
        want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()
        result["max_abs_err"] = (normed[0].float() - want).abs().max().item()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON result"
    )
    parser.add_argument("--commit", default=None, help="commit to record (default: git)")
    args = parser.parse_args(argv)
    from graphtune import env
    from graphtune.engine.collectives import make_all_reduce
    from graphtune.engine.parallel import init_from_torchrun

    try:
        launched, local_rank = env.torchrun_rank(), env.torchrun_local_rank() or 0
    except ConfigError as exc:  # RANK, WORLD_SIZE or LOCAL_RANK malformed
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if launched is None or not torch.cuda.is_available():
        print(
            "error: benchmarks/allreduce.py runs under torchrun on CUDA GPUs (see --help)",
            file=sys.stderr,
        )
        return 2
    # Every rank checks, before the group forms: a rank that exited alone would leave the others
    # waiting for it in the group's set-up.
    gpu = gpu_slug(torch.cuda.get_device_name(local_rank))
    target = args.out / f"allreduce-{gpu}.json"
    check_script_output(target, "--out", parser)  # before the work: exit 2 on a bad --out
    parallel, device = init_from_torchrun(launched[1], torch.device("cuda"))
    results = []
    variants = ("nccl", "symm_mem", "symm_mem+norm", "fused")
    for rows in ROWS:
        row: dict = {"rows": rows, "bytes": rows * HIDDEN * 2}
        for variant in variants:
            backend = "nccl" if variant == "nccl" else "symm_mem"
            ctx = type(parallel)(parallel.group, parallel.rank, parallel.world_size, backend)
            try:
                reducer = make_all_reduce(
                    ctx,
                    max_rows=rows,
                    hidden=HIDDEN,
                    dtype=torch.bfloat16,
                    device=device,
                    fuse_norm=variant == "fused",
                )
                row[variant] = _measure(variant, reducer, rows, device, parallel.rank)
            except Exception as exc:  # report a variant that cannot run; keep the others
                row[variant] = {"error": f"{type(exc).__name__}: {exc}"}
        results.append(row)
    kept = True
    if parallel.rank == 0:
        path = write_json(  # target, or the fallback file it went to instead
            target,
            {
                "benchmark": "allreduce",
                "provenance": provenance(args.commit, device),
                "world_size": parallel.world_size,
                "hidden": HIDDEN,
                "per_graph": PER_GRAPH,
                "replays": REPLAYS,
                "results": results,
            },
        )
        print(json.dumps({"bench": "allreduce", "file": str(path), "results": results}))
        print(
            f"{'rows':>5} {'bytes':>8} "
            + " ".join(f"{v:>14}" for v in variants)
            + "  (us per repetition)"
        )
        for r in results:
            cells = [
                f"{r[v]['us_per_all_reduce']:14.2f}"
                if "us_per_all_reduce" in r[v]
                else f"{'error':>14}"
                for v in variants
            ]
            print(f"{r['rows']:>5} {r['bytes']:>8} " + " ".join(cells))
        kept = report_written("--out", target, path)
    dist.destroy_process_group()
    # Exit 1 when the result went to the temporary folder: a script would find no file at target.
    return 0 if kept else 1


if __name__ == "__main__":
    sys.exit(main())
