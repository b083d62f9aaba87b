#!/usr/bin/env python3
"""The fused GEMV's tactic space swept exhaustively at a model's decode projections.

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/gemv_sweep.py --out benchmarks/results
        [--model llama-1b-shape] [--batches 8,16] [--ops qkv,o,gate_up,down] [--replays 10]
        [--commit SHA] [--label TEXT]

For each projection of ``--model``'s decode layer (a preset of ``graphtune.engine.presets``),
bf16 with random weights, the fused GEMV kernel runs in the form the tuned step runs it after
the RMSNorm op: ``qkv`` the QKV projection + RoPE + K/V write (``TritonQkvRopeAfterNorm``),
``o`` and ``down`` the projection with the residual added in place (``TritonAddProjection``),
``gate_up`` the gate/up projection + SiLU-and-mul (``TritonGateUpSiluAfterNorm``). The RMSNorm
itself is left out, so every candidate times the one kernel. Every tactic of the space
(:func:`space_for`: ``bn``, ``bk``, stages and split on the tensor cores; on the CUDA cores, for
one row, the tuner's tiles with splits 1, 2 and 4) is compiled ahead in parallel and timed by the
in-graph CUPTI truth of ``graphtune.bench.cupti_sweep.cupti_graph_sweep`` (all candidates of an
op and batch in one profiler session, replays interleaved). The weight rotates over enough copies
to exceed the L2 cache, as in the step, where every weight streams from memory once; a graph
holds whole rounds of the copies (``calls_per_graph``, ``warm_calls_per_replay`` in the result).
Each result says whether the runner offers the tactic to the tuner.

Writes ``gemv-sweep-<model>-<gpu>[-label].json`` with provenance and prints the table last.
Exits 2 without CUDA or for an ``--out`` that cannot be written, 1 when the result went to
the temporary folder instead.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
from _sweep import (
    ROTATION_KEYS,
    add_common_arguments,
    add_projection_arguments,
    model_or_usage_error,
    projection_choices,
    ranked,
    result_target,
    rotating_copies,
    sweep_projections,
    sweep_runner,
    tactic_key,
    write_result,
)

from graphtune import bench
from graphtune.autotuner.config import next_power_of_two
from graphtune.cli._args import Parser
from graphtune.engine.config import ModelConfig
from graphtune.ops.fused import (
    TritonAddProjection,
    TritonGateUpSiluAfterNorm,
    TritonQkvRopeAfterNorm,
)
from graphtune.ops.fused_gemv import family
from graphtune.ops.fused_gemv.family import PLAIN, ROPE, SILU, GemvShape

OPS = ("qkv", "o", "gate_up", "down")
DOT_STAGES = (3, 4)
SPLITS = (1, 2, 4, 8, 16)
CORE_SPLITS = (1, 2, 4)
CALLS_PER_GRAPH = 20  # the fewest; sweep_runner rounds up to whole rounds of the weight copies
BF16 = torch.bfloat16


def space_for(shape: GemvShape, sms: int) -> list[dict[str, int]]:
    """Every tactic swept for one projection: on the tensor cores ``bn`` x ``bk`` x stages x
    split within the shared-memory budget (a split at most the tile's ``K`` chunks); for one row
    also the tuner's CUDA-core tiles with splits 1, 2 and 4."""
    out: list[dict[str, int]] = []
    if shape.m == 1:
        whole = family.fused_gemv_tactics(shape, sm_count=sms, max_tactics=10**6, split_k=False)
        for t in (t for t in whole if t["dot"] == 0):
            chunks = math.ceil(shape.k / t["bk"])
            out += [{**t, "split": s} for s in CORE_SPLITS if s <= chunks]
    n_cap, k_cap = next_power_of_two(shape.columns), next_power_of_two(shape.k)
    bns = sorted({min(b, n_cap) for b in family.DOT_BN})
    bks = sorted({min(b, k_cap) for b in family.DOT_BK})
    for bn, bk, stages in itertools.product(bns, bks, DOT_STAGES):
        if family.pipeline_bytes(bn, bk, stages, shape.paired, shape.itemsize) > (
            family.DOT_SMEM_BYTES
        ):
            continue
        chunks = math.ceil(shape.k / bk)
        for split in (s for s in SPLITS if s <= chunks):
            out.append({"bn": bn, "bk": bk, "warps": 4, "dot": 1, "stages": stages, "split": split})
    unique = {tactic_key(t): t for t in out if family.check_fused_tactic(t) is None}
    return list(unique.values())


class _KernelOnly:
    """Mixin for an after-norm runner: its input is taken as already normalised, so a call
    times the fused kernel alone."""

    def kernel_rows(self, x: torch.Tensor, norm_weight: Any, eps: float, warmup: bool) -> Any:
        return x, None


class _QkvKernelOnly(_KernelOnly, TritonQkvRopeAfterNorm):
    """The after-norm QKV runner without its RMSNorm op."""


class _GateUpKernelOnly(_KernelOnly, TritonGateUpSiluAfterNorm):
    """The after-norm gate/up runner without its RMSNorm op."""


def op_cases(model: ModelConfig, m: int, device: torch.device, l2_bytes: int) -> dict[str, Any]:
    """Per op: (runner, a list of inputs per weight copy, the shape, bytes a call streams)."""
    hidden, inter = model.hidden_size, model.intermediate_size
    heads, kv, dim = model.num_heads, model.num_kv_heads, model.dim_per_head
    gen = torch.Generator(device=device).manual_seed(m)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, device=device, generator=gen) * scale
        return t.to(BF16)

    def copies(rows: int, k: int) -> list[torch.Tensor]:
        return rotating_copies(lambda r, c: rand(r, c, scale=c**-0.5), rows, k, l2_bytes)

    seq = 4096
    norm_w = torch.ones(hidden, device=device, dtype=BF16)
    rows = (heads + 2 * kv) * dim
    angles = torch.rand(seq, dim // 2, device=device, generator=gen) * 6.3
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(BF16)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(BF16)
    positions = torch.randint(0, seq, (m,), device=device, generator=gen)
    write_rows = torch.randperm(seq * kv, device=device, generator=gen)[: m * kv]
    k_cache, v_cache = rand(seq * kv, dim), rand(seq * kv, dim)
    x, act = rand(m, hidden), rand(m, inter)
    residual, attn = rand(m, hidden), rand(m, heads * dim)
    qkv_tail = [positions, cos, sin, k_cache, v_cache, write_rows, 1e-5, None]
    return {
        "qkv": (
            _QkvKernelOnly(heads, kv, True),
            [[x, norm_w, w, None, *qkv_tail] for w in copies(rows, hidden)],
            GemvShape(ROPE, m, dim // 2, heads + 2 * kv, hidden, 2),
            rows * hidden * 2,
        ),
        "o": (
            TritonAddProjection(),
            [[residual, attn, w] for w in copies(hidden, heads * dim)],
            GemvShape(PLAIN, m, hidden, 1, heads * dim, 2),
            hidden * heads * dim * 2,
        ),
        "gate_up": (
            _GateUpKernelOnly(),
            [[x, norm_w, w, 1e-5] for w in copies(2 * inter, hidden)],
            GemvShape(SILU, m, inter, 1, hidden, 2),
            2 * inter * hidden * 2,
        ),
        "down": (
            TritonAddProjection(),
            [[residual, act, w] for w in copies(hidden, inter)],
            GemvShape(PLAIN, m, hidden, 1, inter, 2),
            hidden * inter * 2,
        ),
    }


def sweep_op(
    name: str, case: tuple[Any, ...], sms: int, replays: int, l2_bytes: int
) -> dict[str, Any]:
    """All candidates of one op at one batch: offered flags, in-graph time, bandwidth."""
    runner, inputs, shape, nbytes = case
    offered = {tactic_key(t) for t in runner.tactics_for(inputs[0])}
    swept = sweep_runner(
        runner,
        inputs,
        space_for(shape, sms),
        offered,
        nbytes,
        replays=replays,
        calls_per_graph=CALLS_PER_GRAPH,
        l2_bytes=l2_bytes,
    )
    return {
        "op": name,
        "batch": shape.m,
        "weight_bytes": nbytes,
        "weight_copies": len(inputs),
        **{key: swept[key] for key in ROTATION_KEYS},
        "offered": len(offered),
        "compile_s": swept["compile_s"],
        "sweep_s": swept["sweep_s"],
        **ranked(swept["rows"]),
    }


def _tactic_text(t: dict) -> str:
    return f"bn{t['bn']} bk{t['bk']} w{t['warps']} dot{t['dot']} st{t['stages']} split{t['split']}"


def table(found: dict[str, Any]) -> str:
    """The text printed last: per op and batch the best offered, the best of the space, the
    top 3."""
    lines = ["op      | batch | MB   | best of space us (TB/s) | best offered us | offered/best-1"]
    for r in found["sweeps"]:
        best, off = r["best"], r["best_offered"]
        off_us = f"{off['us']:7.2f}" if off else "      -"
        gap = f"{100 * r['offered_over_best']:+.1f}%" if off else "-"
        lines.append(
            f"{r['op']:7s} | {r['batch']:5d} | {r['weight_bytes'] / 1e6:4.1f} | "
            f"{best['us']:7.2f} ({best['tb_s'] or 0:.2f}) | {off_us} | {gap}"
        )
        for row in r["rows"][:3]:
            mark = "offered" if row["offered"] else ""
            lines.append(f"          {row['us']:7.2f} {_tactic_text(row['tactic'])} {mark}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, "layer")
    add_projection_arguments(parser, OPS, "8,16", "batch sizes (1..16)")
    args = parser.parse_args(argv)
    ops, batches = projection_choices(
        parser,
        args,
        lambda b: 1 <= b <= family.MAX_M,
        f"lie in 1..{family.MAX_M} (the fused GEMV's rows)",
    )
    model = model_or_usage_error(parser, args.model)
    device = bench.require_cuda_or_exit("gemv_sweep.py")
    target = result_target(parser, args, "gemv-sweep")  # exit 2 on a bad --out, before any work
    props = torch.cuda.get_device_properties(device)
    l2_bytes = int(getattr(props, "L2_cache_size", 60 * 2**20))
    sweeps = sweep_projections(
        batches,
        ops,
        lambda m: op_cases(model, m, device, l2_bytes),
        lambda op, case: sweep_op(op, case, props.multi_processor_count, args.replays, l2_bytes),
    )
    found = {"sweeps": sweeps}
    kept = write_result(args, target, found)
    print(table(found))
    return 0 if kept else 1  # 1: the result went to the temporary folder


if __name__ == "__main__":
    sys.exit(main())
