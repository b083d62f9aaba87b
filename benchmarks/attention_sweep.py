#!/usr/bin/env python3
"""Decode attention's Triton tactic space swept exhaustively: is the offered subset enough?

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/attention_sweep.py --out benchmarks/results
        [--model llama-1b-shape] [--batches 1,8,32,128] [--context 512] [--seq 528]
        [--replays 10] [--commit SHA] [--label TEXT]

The attention of ``--model``'s decode step (a preset of ``graphtune.engine.presets``: its KV
heads, query heads per KV head and head_dim; llama-1b-shape has 8, 4 and 64), bf16, over a
528-key cache with keys ``0..context`` visible, as the engine's decode mask leaves them.
For each batch every tactic of the full space (``block_n`` 16-128, warps 1-8, stages 2-4, the
split counts up to about four programs per SM) runs in both Triton runners (the two-kernel split
of ``TritonDecodeAttention`` and the one-kernel merge of ``TritonDecodeAttentionOneKernel``),
compiled ahead in parallel (``precompile``), and is timed by the in-graph CUPTI truth of
``graphtune.bench.cupti_sweep.cupti_graph_sweep`` (all candidates of a batch in one profiler
session, replays interleaved). Each result says whether ``decode_attention_tactics`` offers the
tactic, so the table shows the best the tuner can pick beside the best of the space.

Writes ``attention-sweep-<model>-<gpu>[-label].json`` with provenance and prints the table
last. Exits 2 without CUDA or for an ``--out`` that cannot be written, 1 when the result went to
the temporary folder instead.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from _sweep import (
    add_common_arguments,
    model_or_usage_error,
    ranked,
    result_target,
    tactic_key,
    write_result,
)

from graphtune import bench
from graphtune.autotuner.config import next_power_of_two
from graphtune.bench.cupti_sweep import cupti_graph_sweep
from graphtune.cli._args import Parser, batch_sizes, non_negative_int, positive_int
from graphtune.engine.config import ModelConfig
from graphtune.ops import attention

SPACE = {"block_n": (16, 32, 64, 128), "warps": (1, 2, 4, 8), "stages": (2, 3, 4)}
CALLS_PER_GRAPH = 20


def space_for(batch: int, kv_heads: int, seq: int, head_dim: int, sms: int) -> list[dict]:
    """Every valid tactic; splits are powers of two up to ``4 * sms / programs`` and up to the
    tile count rounded up to a power of two."""
    most = max(1, 4 * sms // (batch * kv_heads))
    out = []
    for block_n, warps, stages in itertools.product(*SPACE.values()):
        if stages * 2 * block_n * head_dim * 2 > 227 * 1024:
            continue
        tiles = next_power_of_two(math.ceil(seq / block_n))  # a split per tile, rounded up
        splits = 1
        while splits <= min(most, tiles, attention.MAX_SPLITS):
            out.append({"block_n": block_n, "splits": splits, "warps": warps, "stages": stages})
            splits *= 2
    return out


def sweep_batch(
    args: argparse.Namespace, model: ModelConfig, batch: int, device: torch.device, sms: int
) -> dict[str, Any]:
    """All candidates of one batch: tuner-offered flags, CUPTI in-graph time, bandwidth."""
    gen = torch.Generator(device=device).manual_seed(batch)
    dtype = torch.bfloat16
    kv, dim, seq = model.num_kv_heads, model.dim_per_head, args.seq
    groups = model.num_heads // kv

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    mask = torch.zeros(batch, 1, 1, seq, device=device, dtype=dtype)
    mask[..., args.context + 1 :] = float("-inf")
    inputs = [rand(batch, kv, groups, dim), rand(batch, kv, seq, dim), rand(batch, kv, seq, dim)]
    inputs.append(mask)
    split_runner = attention.TritonDecodeAttention()
    one_kernel = attention.TritonDecodeAttentionOneKernel()
    offered = {tactic_key(t) for t in split_runner.tactics_for(inputs)}
    tactics = space_for(batch, kv, seq, dim, sms)
    cands = [(split_runner, t) for t in tactics]
    cands += [(one_kernel, t) for t in tactics if t["splits"] > 1]
    began = time.perf_counter()
    split_runner.precompile(inputs, tactics)
    one_kernel.precompile(inputs, [t for t in tactics if t["splits"] > 1])
    compile_s = time.perf_counter() - began

    def call_of(runner: Any, tactic: dict) -> Any:
        return lambda _i: runner.forward(inputs, tactic)

    began = time.perf_counter()
    truth = cupti_graph_sweep(
        [call_of(r, t) for r, t in cands], [CALLS_PER_GRAPH] * len(cands), replays=args.replays
    )
    sweep_s = time.perf_counter() - began
    nbytes = 2 * batch * kv * (args.context + 1) * dim * dtype.itemsize
    rows = [
        {
            "runner": type(r).__name__,
            "tactic": t,
            "offered": tactic_key(t) in offered,
            "us": res["per_call_us"],
            "tb_s": nbytes / (res["per_call_us"] * 1e6) if res["per_call_us"] > 0 else None,
            "error": res["error"],
        }
        for (r, t), res in zip(cands, truth, strict=True)
    ]
    return {
        "batch": batch,
        "kv_bytes": nbytes,
        "offered": len(offered),
        "compile_s": compile_s,
        "sweep_s": sweep_s,
        **ranked(rows),
    }


def table(found: dict[str, Any]) -> str:
    """The text printed last: per batch the best offered, the best of the space, the top 5."""
    lines = ["batch | KV MB | best of space us (TB/s) | best offered us | offered / best - 1"]
    for b in found["batches"]:
        best, off = b["best"], b["best_offered"]
        lines.append(
            f"{b['batch']:5d} | {b['kv_bytes'] / 1e6:5.1f} | {best['us']:7.2f} ({best['tb_s']:.2f})"
            f" | {off['us']:7.2f} | {100 * b['offered_over_best']:+.1f}%"
        )
        for row in b["rows"][:5]:
            mark = "offered" if row["offered"] else ""
            lines.append(f"      {row['us']:7.2f} {row['runner']:32s} {row['tactic']} {mark}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, "attention")
    parser.add_argument(
        "--batches", type=batch_sizes, default="1,8,32,128", help="batch sizes, comma-separated"
    )
    parser.add_argument(
        "--context", type=non_negative_int, default=512, help="last visible key position"
    )
    parser.add_argument("--seq", type=positive_int, default=528, help="KV cache length")
    args = parser.parse_args(argv)
    if not args.context < args.seq:
        parser.error(f"--context must be in [0, --seq={args.seq}), got {args.context}")
    model = model_or_usage_error(parser, args.model)
    device = bench.require_cuda_or_exit("attention_sweep.py")
    target = result_target(
        parser, args, "attention-sweep"
    )  # exit 2 on a bad --out, before any work
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    found = {
        "model": {
            "kv_heads": model.num_kv_heads,
            "heads": model.num_heads,
            "head_dim": model.dim_per_head,
        },
        "batches": [sweep_batch(args, model, b, device, sms) for b in args.batches],
    }
    kept = write_result(args, target, found)
    print(table(found))
    return 0 if kept else 1  # 1: the result went to the temporary folder


if __name__ == "__main__":
    sys.exit(main())
