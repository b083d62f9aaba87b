#!/usr/bin/env python3
"""Tuning quality and tuning time of the fused-MoE op on the issue's expert shapes.

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/moe.py --out benchmarks/results [--quick]
        [--shapes qwen3-30b-a3b,mixtral-8x7b] [--tokens 1,8,64,512,4096] [--max-tokens 4096]
        [--replays 10] [--min-replay-us 200] [--commit SHA]

Per expert shape (bf16; Qwen3-30B-A3B: 128 experts, top 8, hidden 2048, width 768; Mixtral-8x7B:
8 experts, top 2, hidden 4096, width 14336):

1. **Tune**: a fresh ``AutoTuner`` with default settings (graph timer) tunes ``fused_moe`` for
   every power-of-two bucket of ``T`` from 1 to ``--max-tokens`` (13 buckets for 4096), on the
   op's own synthetic inputs (balanced routing). The wall time of that one call is the tuning
   time; it includes Triton compilation (also reported alone: the first shape compiles, a later
   one mostly reuses the binaries, which Triton specialises on dtypes and divisibility only).
2. **Sweep**: for each ``--tokens`` value, every candidate the tuner timed for that bucket (the
   torch fallback and every Triton tactic the pruning rules keep: the same space) is measured by the
   CUPTI in-graph truth on the same synthetic inputs, all candidates of a bucket in one profiler
   session with interleaved replays (``graphtune.bench.cupti_sweep``). Its wall time is reported
   next to the tuning time. A replay holds ``ceil(--min-replay-us / tuner's time)`` calls (1 .. 50),
   so the sweep stays within a few seconds per bucket even at 4096 tokens of Mixtral.
3. **Scores**: regret = truth(tuner's pick) / truth(best of the sweep) - 1, target <= 2% per
   bucket; tuning time target <= 60 s per shape; achieved bandwidth of the pick and of the best
   against the bytes a call must move: the weights of the experts the routing selects, plus
   ``x`` and the output.

Writes ``moe-<gpu>.json`` (``-quick`` suffix with ``--quick``) with provenance, prints one JSON
line and then the table. Exits 2 without CUDA, 1 when a target fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphtune import bench
from graphtune.bench.cupti_sweep import cupti_graph_sweep

logger = logging.getLogger("benchmarks.moe")

TARGET_REGRET = 0.02
TARGET_TUNE_S = 60.0
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class ExpertShape:
    experts: int
    top_k: int
    hidden: int
    inter: int


SHAPES = {
    "qwen3-30b-a3b": ExpertShape(128, 8, 2048, 768),
    "mixtral-8x7b": ExpertShape(8, 2, 4096, 14336),
}


def live_inputs(shape: ExpertShape, tokens: int, device: torch.device) -> list[Any]:
    """Inputs of the live call that triggers tuning: the tuner reads only their shapes and
    dtypes (and the ids' range) and times its own synthetic inputs; zeros, so that the one call
    made on them computes on finite numbers."""
    from graphtune.ops.moe import balanced_routing

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=DTYPE, device=device)

    x = zeros(tokens, shape.hidden)
    gate_up = zeros(shape.experts, 2 * shape.inter, shape.hidden)
    down = zeros(shape.experts, shape.hidden, shape.inter)
    weights = zeros(tokens, shape.top_k)
    ids = torch.zeros((tokens, shape.top_k), dtype=torch.int64, device=device)
    return balanced_routing([x, gate_up, down, weights, ids])


def tokens_of(profile_text: str) -> int:
    """``T`` of a profile's ``describe()`` text (``"64x2048, ..."``)."""
    return int(profile_text.split("x", 1)[0])


def tune_shape(shape: ExpertShape, max_tokens: int, device: torch.device) -> dict[str, Any]:
    """Step 1: one fresh tuner, every bucket; returns the tuner, runners and times."""
    from graphtune.autotuner import AutoTuner
    from graphtune.ops.moe import (
        OP_NAME,
        TorchFusedMoeRunner,
        TritonFusedMoeRunner,
        TritonMoeGemvRunner,
        fused_moe,
    )

    # Fresh instances of the op's runners (fused_moe_runners' classes), so compile counts are
    # this shape's own.
    runners = (TorchFusedMoeRunner(), TritonFusedMoeRunner(), TritonMoeGemvRunner())
    live = live_inputs(shape, max_tokens, device)
    tuner = AutoTuner(show_progress=False)
    tuner.tuning_mode = True
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fused_moe(*live, tuner=tuner, max_m=max_tokens, runners=runners)
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    tuner.tuning_mode = False
    records = {tokens_of(r.profile): r for r in tuner.history if r.op == OP_NAME}
    return {
        "tuner": tuner,
        "runners": runners,
        "live": live,
        "records": records,
        "tune_s": wall,
        "compile_s": sum(r.compile_seconds for r in runners[1:]),
        "stats": {
            "profiles_tuned": tuner.stats.profiles_tuned,
            "tactics_timed": tuner.stats.tactics_timed,
            "measurements": tuner.stats.measurements,
            "extra_rounds": tuner.stats.extra_rounds,
            "tactic_failures": dict(tuner.stats.tactic_failures),
            "compiled": sum(r.compiled for r in runners[1:]),
        },
    }


def selected_bytes(inputs: list[Any]) -> tuple[int, int]:
    """(bytes a call must move: selected experts' weights + x + out, experts selected)."""
    x, gate_up, down, _, ids = inputs
    selected = int(torch.unique(ids).numel())
    per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    return selected * per_expert + 2 * x.numel() * x.element_size(), selected


def sweep_bucket(tuned: dict[str, Any], tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    """Steps 2 and 3 for one bucket."""
    from graphtune.autotuner.profiles import generate_profiles, synthesize_inputs
    from graphtune.ops.moe import fused_moe_config

    record = tuned["records"].get(tokens)
    if record is None:
        raise RuntimeError(f"the tuner tuned no bucket of {tokens} tokens")
    config = fused_moe_config(args.max_tokens)
    profile = next(p for p in generate_profiles(config, tuned["live"]) if p.shapes[0][0] == tokens)
    inputs = synthesize_inputs(config, tuned["live"], profile)
    runners = tuned["runners"]
    cands = list(record.candidates)

    def call_of(cand: Any) -> Any:
        runner, tactic = runners[cand.runner_index], cand.tactic
        return lambda _i: runner.forward(inputs, tactic)

    calls = [
        bench.graph_calls_for(
            c.median_us if math.isfinite(c.median_us) else None,
            min_replay_us=args.min_replay_us,
            min_calls=1,
            max_calls=50,
        )
        for c in cands
    ]
    start = time.perf_counter()
    truth = cupti_graph_sweep([call_of(c) for c in cands], calls, replays=args.replays)
    sweep_s = time.perf_counter() - start
    times = [t["per_call_us"] for t in truth]
    best = min(range(len(cands)), key=lambda i: times[i])
    pick = record.winner_index
    bytes_moved, selected = selected_bytes(inputs)
    pick_us = times[pick] if pick is not None else math.inf
    regret = pick_us / times[best] - 1 if math.isfinite(pick_us) else math.inf

    def gbps(us: float) -> float | None:
        return bytes_moved / (us * 1e3) if math.isfinite(us) and us > 0 else None

    return {
        "tokens": tokens,
        "n_candidates": len(cands),
        "candidates": [
            {
                "runner": c.runner,
                "runner_index": c.runner_index,
                "tactic": c.tactic,
                "tuner_us": c.median_us,
                "tuner_failed": c.failed,
                "truth": t,
            }
            for c, t in zip(cands, truth, strict=True)
        ],
        "pick": pick,
        "pick_tactic": cands[pick].tactic if pick is not None else None,
        "pick_us": pick_us,
        "best": best,
        "best_tactic": cands[best].tactic,
        "best_us": times[best],
        "fallback_us": times[0] if cands[0].runner_index == 0 else None,
        "regret": regret,
        "regret_pass": regret <= TARGET_REGRET,
        "experts_selected": selected,
        "bytes": bytes_moved,
        "pick_gbps": gbps(pick_us),
        "best_gbps": gbps(times[best]),
        "sweep_s": sweep_s,
    }


def run_shape(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    shape = SHAPES[name]
    result: dict[str, Any] = {"shape": name, **vars(shape), "error": None, "buckets": []}
    try:
        tuned = tune_shape(shape, args.max_tokens, device)
    except Exception as exc:  # one failing shape must not lose the other
        logger.exception("%s: tuning failed", name)
        result["error"] = f"tuning: {type(exc).__name__}: {exc}"
        return result
    result.update(
        tune_s=tuned["tune_s"],
        compile_s=tuned["compile_s"],
        tune_s_without_compile=tuned["tune_s"] - tuned["compile_s"],
        tune_pass=tuned["tune_s"] <= TARGET_TUNE_S,
        tuned_buckets=sorted(tuned["records"]),
        stats=tuned["stats"],
        summary_rows=[list(map(str, row)) for row in tuned["tuner"].summary_rows()],
    )
    print(
        f"{name}: tuned {len(tuned['records'])} buckets in {tuned['tune_s']:.1f} s "
        f"(compile {tuned['compile_s']:.1f} s)",
        flush=True,
    )
    for tokens in args.tokens:
        try:
            bucket = sweep_bucket(tuned, tokens, args)
        except Exception as exc:  # reported per bucket
            logger.exception("%s T=%d: sweep failed", name, tokens)
            bucket = {
                "tokens": tokens,
                "error": f"{type(exc).__name__}: {exc}",
                "regret_pass": False,
            }
        result["buckets"].append(bucket)
        if "error" not in bucket:
            print(
                f"  T={tokens:<5} regret {100 * bucket['regret']:.2f}% over "
                f"{bucket['n_candidates']} candidates, sweep {bucket['sweep_s']:.1f} s",
                flush=True,
            )
    result["sweep_s"] = sum(b.get("sweep_s", 0.0) for b in result["buckets"])
    del tuned
    torch.cuda.empty_cache()
    return result


RUNNER_NAMES = {"TritonFusedMoeRunner": "grouped", "TritonMoeGemvRunner": "gemv"}


def short(bucket: dict[str, Any], index: int | None) -> str:
    """Candidate ``index`` of a bucket as ``torch``, ``grouped bm/bn/bk/g/w/s`` or ``gemv
    bn/bk/w`` (its tactic's values in their order)."""
    if index is None:
        return "none"
    cand = bucket["candidates"][index]
    tactic = cand["tactic"]
    if tactic == -1:
        return "torch"
    name = RUNNER_NAMES.get(cand["runner"], cand["runner"])
    if not isinstance(tactic, dict):
        return f"{name} {tactic}"
    return f"{name} " + "/".join(str(v) for v in tactic.values())


def table(shapes: list[dict[str, Any]]) -> str:
    lines = [
        "| shape | T | cands | pick | pick us | best | best us | regret | <=2% "
        "| pick GB/s | best GB/s | torch us |",
        "|---|---:|---:|---|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    for s in shapes:
        for b in s.get("buckets", []):
            if "error" in b:
                lines.append(f"| {s['shape']} | {b['tokens']} | error: {b['error'][:60]} |")
                continue
            lines.append(
                f"| {s['shape']} | {b['tokens']} | {b['n_candidates']} | {short(b, b['pick'])} "
                f"| {b['pick_us']:.1f} | {short(b, b['best'])} | {b['best_us']:.1f} "
                f"| {100 * b['regret']:.2f}% "
                f"| {'yes' if b['regret_pass'] else 'NO'} | {b['pick_gbps'] or 0:.0f} "
                f"| {b['best_gbps'] or 0:.0f} | {b['fallback_us'] or math.nan:.1f} |"
            )
    lines += [
        "",
        "| shape | buckets | tuning s | compile s | <=60 s | sweep s |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for s in shapes:
        if s.get("error"):
            lines.append(f"| {s['shape']} | error: {s['error'][:80]} |")
            continue
        lines.append(
            f"| {s['shape']} | {len(s['tuned_buckets'])} | {s['tune_s']:.1f} "
            f"| {s['compile_s']:.1f} | {'yes' if s['tune_pass'] else 'NO'} | {s['sweep_s']:.1f} |"
        )
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected positive ints separated by commas, got {text!r}"
        )
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", type=_int_list, default=[1, 8, 64, 512, 4096])
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--min-replay-us", type=float, default=200.0)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--quick", action="store_true", help="tokens 1,64; buckets up to 64")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    if args.quick:
        args.tokens, args.max_tokens = [1, 64], 64
    if max(args.tokens) > args.max_tokens:
        parser.error(f"--tokens {args.tokens} go past --max-tokens {args.max_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    device = bench.require_cuda_or_exit("benchmarks/moe.py")
    started = time.perf_counter()
    prov = bench.provenance(args.commit, device)
    print(f"{prov['gpu']}, torch {prov['torch']}, triton {prov['triton']}, commit {prov['commit']}")
    shapes = [run_shape(name, args, device) for name in args.shapes]
    buckets = [b for s in shapes for b in s.get("buckets", [])]
    summary = {
        "regret_pass": bool(buckets) and all(b.get("regret_pass") for b in buckets),
        "worst_regret": max((b.get("regret", math.inf) for b in buckets), default=None),
        "tune_pass": all(s.get("tune_pass", False) for s in shapes),
        "tune_s": {s["shape"]: s.get("tune_s") for s in shapes},
        "sweep_s": {s["shape"]: s.get("sweep_s") for s in shapes},
    }
    summary["all_pass"] = summary["regret_pass"] and summary["tune_pass"]
    payload = {
        "benchmark": "moe",
        "provenance": prov,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "targets": {
            "regret": f"tuner's pick within {100 * TARGET_REGRET:.0f}% of the sweep's best (CUPTI "
            "in-graph truth) in every bucket",
            "tune_s": f"all buckets of one shape tuned in <= {TARGET_TUNE_S:.0f} s (wall, compile "
            "included)",
        },
        "shapes": shapes,
        "summary": summary,
        "wall_s": time.perf_counter() - started,
    }
    suffix = "-quick" if args.quick else ""
    # A plain atomic write (bench.write_json); moves onto graphtune.bench's writer once it lands.
    path = bench.write_json(args.out / f"moe-{prov['gpu_slug']}{suffix}.json", payload)
    print(json.dumps(bench.json_safe({"benchmark": "moe", "json": str(path), **summary})))
    print(table(shapes))
    return 0 if summary["all_pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
