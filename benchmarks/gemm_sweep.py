#!/usr/bin/env python3
"""The tiled Triton GEMM's tactic space swept at a model's decode projections, beside cuBLAS.

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/gemm_sweep.py --out benchmarks/results
        [--model llama-1b-shape] [--batches 128] [--ops qkv,o,gate_up,down] [--replays 10]
        [--commit SHA] [--label TEXT]

For each projection of ``--model``'s decode layer, bf16 with random weights, the tiled GEMM
(``gemm_kernel``) runs in the form the tuned step would run it: ``qkv`` the plain GEMM, ``o``
and ``down`` the GEMM adding into the residual in place (``TritonGemmRunner``), ``gate_up`` the
gate/up GEMM with SiLU-and-mul in its epilogue (``TritonGateUpSiluTiled`` without its RMSNorm).
Every tactic of :func:`space_for` (``bm`` x ``bn`` x ``bk`` x warps x stages x split-K within
the shared memory) is compiled ahead and timed by the in-graph CUPTI truth of
``graphtune.bench.cupti_sweep.cupti_graph_sweep`` together with the runner's tactic ``-1``
(``torch``: cuBLAS, and for ``gate_up`` cuBLAS plus the SiLU-and-mul kernel), all candidates of
an op and batch in one profiler session. The weight rotates over enough copies to exceed the L2
cache, as in the step, and a graph holds whole rounds of the copies (``calls_per_graph``,
``warm_calls_per_replay`` in the result). Each result says whether the runner offers the tactic
to the tuner.

Writes ``gemm-sweep-<model>-<gpu>[-label].json`` with provenance and prints the table last.
Exits 2 without CUDA or for an ``--out`` that cannot be written, 1 when the result went to
the temporary folder instead.
"""

from __future__ import annotations

import itertools
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
from graphtune.autotuner import FALLBACK_TACTIC
from graphtune.autotuner.config import next_power_of_two
from graphtune.cli._args import Parser
from graphtune.engine.config import ModelConfig
from graphtune.ops._triton import device_limits
from graphtune.ops.activation import torch_silu_and_mul
from graphtune.ops.fused.mlp import TritonGateUpSiluTiled
from graphtune.ops.gemm.tiled import TritonGemmRunner, check_gemm_tactic

OPS = ("qkv", "o", "gate_up", "down")
BMS = (32, 64, 128)
BNS = (32, 64, 128, 256)
BKS = (64, 128, 256)
WARPS = (4, 8)
STAGES = (3, 4)
SPLITS = (1, 2, 4, 8, 16)
CALLS_PER_GRAPH = 20  # the fewest; sweep_runner rounds up to whole rounds of the weight copies
TORCH = FALLBACK_TACTIC
BF16 = torch.bfloat16


def space_for(m: int, n: int, k: int, *, paired: bool, smem: int) -> list[dict[str, int]]:
    """Every tactic swept for one ``(M, N, K)``: ``bm`` up to ``M``'s power of two, ``bn``,
    ``bk``, warps, stages and split-K (one split with SiLU pairs) whose pipelined tiles fit
    ``smem`` and whose splits are whole ``bk`` blocks."""
    bm_cap, bn_cap = max(16, next_power_of_two(m)), max(16, next_power_of_two(n))
    out = []
    for bm, bn, bk, warps, stages, split in itertools.product(BMS, BNS, BKS, WARPS, STAGES, SPLITS):
        if bm > bm_cap or bn > bn_cap or (paired and split > 1):
            continue
        if stages * (bm + (2 if paired else 1) * bn) * bk * 2 > smem:
            continue
        tactic = {"bm": bm, "bn": bn, "bk": bk, "warps": warps, "stages": stages, "split_k": split}
        if check_gemm_tactic(tactic, k) is None:
            out.append(tactic)
    return out


class _GateUpKernelOnly(TritonGateUpSiluTiled):
    """The tiled gate/up runner without its RMSNorm op: a call times the one GEMM kernel (tactic
    ``-1``: cuBLAS and the SiLU-and-mul kernel)."""

    def kernel_rows(self, x: torch.Tensor, norm_weight: Any, eps: float, warmup: bool) -> Any:
        return x, None

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """cuBLAS and torch's SiLU-and-mul, without the RMSNorm."""
        return torch_silu_and_mul(torch.nn.functional.linear(inputs[0], inputs[2]))


def op_cases(model: ModelConfig, m: int, device: torch.device, l2_bytes: int) -> dict[str, Any]:
    """Per op: (runner, a list of inputs per weight copy, (M, N, K), paired, weight bytes)."""
    hidden, inter = model.hidden_size, model.intermediate_size
    heads, kv, dim = model.num_heads, model.num_kv_heads, model.dim_per_head
    gen = torch.Generator(device=device).manual_seed(m)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(BF16)

    def copies(rows: int, k: int) -> list[torch.Tensor]:
        return rotating_copies(lambda r, c: rand(r, c, scale=c**-0.5), rows, k, l2_bytes)

    qkv_rows = (heads + 2 * kv) * dim
    x, act = rand(m, hidden), rand(m, inter)
    residual, attn = rand(m, hidden), rand(m, heads * dim)
    norm_w = torch.ones(hidden, device=device, dtype=BF16)
    gemm = TritonGemmRunner()
    return {
        "qkv": (
            gemm,
            [[x, w, None, None, False] for w in copies(qkv_rows, hidden)],
            (m, qkv_rows, hidden),
            False,
        ),
        "o": (
            gemm,
            [[attn, w, None, residual, True] for w in copies(hidden, heads * dim)],
            (m, hidden, heads * dim),
            False,
        ),
        "gate_up": (
            _GateUpKernelOnly(),
            [[x, norm_w, w, 1e-5] for w in copies(2 * inter, hidden)],
            (m, inter, hidden),
            True,
        ),
        "down": (
            gemm,
            [[act, w, None, residual, True] for w in copies(hidden, inter)],
            (m, hidden, inter),
            False,
        ),
    }


def sweep_op(
    name: str, case: tuple[Any, ...], smem: int, replays: int, l2_bytes: int
) -> dict[str, Any]:
    """All candidates of one op at one batch (tactic ``-1`` first): offered flags, in-graph
    time, bandwidth."""
    runner, inputs, (m, n, k), paired = case
    offered = {tactic_key(t) for t in runner.tactics_for(inputs[0])}
    nbytes = (2 if paired else 1) * n * k * 2
    swept = sweep_runner(
        runner,
        inputs,
        [TORCH, *space_for(m, n, k, paired=paired, smem=smem)],
        offered,
        nbytes,
        replays=replays,
        calls_per_graph=CALLS_PER_GRAPH,
        l2_bytes=l2_bytes,
    )
    rows = swept["rows"]
    torch_us = rows[0]["us"]
    found = ranked(rows)
    best_triton = next(row for row in found["rows"] if row["tactic"] != TORCH)
    return {
        "op": name,
        "batch": m,
        "mnk": [m, n, k],
        "weight_bytes": nbytes,
        "weight_copies": len(inputs),
        **{key: swept[key] for key in ROTATION_KEYS},
        "offered": len(offered),
        "compile_s": swept["compile_s"],
        "sweep_s": swept["sweep_s"],
        "torch_us": torch_us,
        "best_triton": best_triton,
        **found,
    }


def _tactic_text(t: Any) -> str:
    if t == TORCH:
        return "torch (cuBLAS)"
    return f"bm{t['bm']} bn{t['bn']} bk{t['bk']} w{t['warps']} st{t['stages']} split{t['split_k']}"


def table(found: dict[str, Any]) -> str:
    """The text printed last: per op and batch cuBLAS, the best offered, the best Triton tactic
    of the space, the top 3."""
    lines = [
        "op      | batch | MB   | torch us | best offered us | best Triton us (TB/s) | "
        "Triton/torch-1"
    ]
    for r in found["sweeps"]:
        tri, off = r["best_triton"], r["best_offered"]
        off_us = f"{off['us']:7.2f}" if off else "      -"
        lines.append(
            f"{r['op']:7s} | {r['batch']:5d} | {r['weight_bytes'] / 1e6:4.1f} | "
            f"{r['torch_us']:8.2f} | {off_us} | {tri['us']:7.2f} ({tri['tb_s'] or 0:.2f}) | "
            f"{100 * (tri['us'] / r['torch_us'] - 1):+.1f}%"
        )
        for row in r["rows"][:4]:
            mark = "offered" if row["offered"] else ""
            lines.append(f"          {row['us']:7.2f} {_tactic_text(row['tactic'])} {mark}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, "layer")
    add_projection_arguments(parser, OPS, "128", "batch sizes (>= 2)")
    args = parser.parse_args(argv)
    ops, batches = projection_choices(
        parser, args, lambda b: b >= 2, "be >= 2 (the tiled GEMM offers nothing for one row)"
    )
    model = model_or_usage_error(parser, args.model)
    device = bench.require_cuda_or_exit("gemm_sweep.py")
    target = result_target(parser, args, "gemm-sweep")  # exit 2 on a bad --out, before any work
    props = torch.cuda.get_device_properties(device)
    l2_bytes = int(getattr(props, "L2_cache_size", 60 * 2**20))
    smem, _ = device_limits(device)
    sweeps = sweep_projections(
        batches,
        ops,
        lambda m: op_cases(model, m, device, l2_bytes),
        lambda op, case: sweep_op(op, case, smem, args.replays, l2_bytes),
    )
    found = {"sweeps": sweeps}
    kept = write_result(args, target, found)
    print(table(found))
    return 0 if kept else 1  # 1: the result went to the temporary folder


if __name__ == "__main__":
    sys.exit(main())
