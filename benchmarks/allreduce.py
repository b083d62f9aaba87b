#!/usr/bin/env python3
"""Latency of the tensor-parallel decode all-reduce inside CUDA graphs: NCCL vs symmetric memory.

Usage (two GPUs, from the repository root):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=src \\
      torchrun --standalone --nproc-per-node 2 benchmarks/allreduce.py --out benchmarks/results

For each message of a decode step (``rows x 2048`` bf16, rows = batch size 1, 8, 32, 128) and each
backend of :mod:`graphtune.engine.collectives`, one CUDA graph holds 32 back-to-back all-reduces
(what one Llama-1B step issues: two per layer), each preceded by a small add that writes the
partial (so the all-reduce always waits on a kernel, as in the step). The graph is replayed after
warm-up; the per-all-reduce time is the median over replays (CUDA events) divided by 32, minus
nothing: the adds are included and identical for both backends. The result is checked against
the exact sum (integer-valued bf16 data, so the sum is exact on both paths). Rank 0 writes
``allreduce-<gpu>.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (benchmarks/ is not a package)

HIDDEN = 2048
ROWS = (1, 8, 32, 128)
PER_GRAPH = 32
REPLAYS = 50


def _time_backend(reducer, rows: int, device: torch.device, rank: int) -> dict:
    """Times PER_GRAPH (add + all-reduce) pairs in one graph; checks the sum."""
    # Same data on every rank (seeded), so the exact sum is known: world * base + sum(rank + 1).
    gen = torch.Generator(device=device).manual_seed(rows)
    base = torch.randint(-8, 8, (rows, HIDDEN), device=device, generator=gen).to(torch.bfloat16)
    bump = torch.full_like(base, float(rank + 1))
    out = torch.empty_like(base)

    def body() -> None:
        for _ in range(PER_GRAPH):
            staged = reducer.staging(rows)
            partial = torch.add(base, bump, out=staged) if staged is not None else base + bump
            reducer.reduce(partial, out=out)

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        body()  # warm-up outside the graph (NCCL and symm_mem set up lazily)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize(device)
    world = dist.get_world_size()
    want = base.float() * world + sum(r + 1 for r in range(world))
    ok = torch.equal(out.float(), want)
    times = []
    for _ in range(REPLAYS):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / PER_GRAPH)
    del graph
    return {"us_per_all_reduce": statistics.median(times), "min_us": min(times), "exact": ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--commit", default=None)
    args = parser.parse_args(argv)
    from graphtune import env
    from graphtune.engine.collectives import make_all_reduce
    from graphtune.engine.parallel import init_from_torchrun

    launched = env.torchrun_rank()
    if launched is None or not torch.cuda.is_available():
        print("benchmarks/allreduce.py: run under torchrun on CUDA GPUs (see --help)",
              file=sys.stderr)
        return 2
    parallel, device = init_from_torchrun(launched[1], torch.device("cuda"))
    results = []
    for rows in ROWS:
        row = {"rows": rows, "bytes": rows * HIDDEN * 2}
        for backend in ("nccl", "symm_mem"):
            ctx = type(parallel)(parallel.group, parallel.rank, parallel.world_size, backend)
            try:
                reducer = make_all_reduce(ctx, max_rows=rows, hidden=HIDDEN,
                                          dtype=torch.bfloat16, device=device)
                row[backend] = _time_backend(reducer, rows, device, parallel.rank)
            except Exception as exc:  # report a backend that cannot run; keep the other
                row[backend] = {"error": f"{type(exc).__name__}: {exc}"}
        nccl, symm = row["nccl"].get("us_per_all_reduce"), row["symm_mem"].get("us_per_all_reduce")
        row["nccl_over_symm_mem"] = nccl / symm if nccl and symm else None
        results.append(row)
    if parallel.rank == 0:
        prov = _common.provenance(args.commit, device)
        prov["world_size"] = parallel.world_size
        path = _common.write_json(args.out / f"allreduce-{prov['gpu_slug']}.json", {
            "benchmark": "allreduce", "provenance": prov, "hidden": HIDDEN,
            "per_graph": PER_GRAPH, "replays": REPLAYS, "results": results,
        })
        print(json.dumps({"bench": "allreduce", "file": str(path), "results": results}))
        print(f"{'rows':>5} {'bytes':>8} {'nccl us':>9} {'symm us':>9} {'ratio':>6}  exact")
        for r in results:
            def us(name: str, r=r) -> str:
                v = r[name].get("us_per_all_reduce")
                return f"{v:9.2f}" if v else f"{'error':>9}"
            ratio = r["nccl_over_symm_mem"]
            exact = [r[b].get("exact") for b in ("nccl", "symm_mem")]
            print(f"{r['rows']:>5} {r['bytes']:>8} {us('nccl')} {us('symm_mem')} "
                  f"{ratio if ratio is None else round(ratio, 2)!s:>6}  {exact}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
