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
   time; it includes Triton compilation (also reported alone, the down stage's share as well: the
   first shape compiles, a later one mostly reuses the binaries, which Triton specialises on
   dtypes and divisibility only).
2. **Sweep**: for each ``--tokens`` value, every candidate the tuner timed for that bucket (the
   torch fallback and every Triton tactic the pruning rules keep: the same space) is measured by the
   CUPTI in-graph truth on the same synthetic inputs, all of a bucket's measurements in one
   profiler session with interleaved replays (``graphtune.bench.cupti_sweep``). Each op candidate
   runs as the op times it (a GEMV tactic with the down tile it implies: ``candidates``). At a
   bucket the GEMV runner serves (``T * top_k <= MAX_PAIRS``), the step runs two tuned choices,
   the op's gate/up tile and then the down stage's tile (``graphtune.fused_moe.gemv_down``, tuned
   by the same call), so two more sets are measured there: every pair of the op's GEMV tactics
   and the down stage's tiles, run as ``fused_moe`` runs them (``runner.forward(inputs,
   tactic=gate_up, down_tile=tile)``: ``pairs``, the full cross product), and every down-stage
   candidate on the down stage's own runner (its fixed gate/up tile, then the tile: ``down``).
   The sweep's wall time is reported next to the tuning time. A replay holds
   ``ceil(--min-replay-us / tuner's time)`` calls (1 .. 50; a pair uses its gate/up tactic's
   time), so the sweep stays within seconds per bucket even at 4096 tokens of Mixtral; a GEMV
   bucket of the issue's shapes measures a few hundred pairs.
3. **Scores**: ``regret`` = truth(what the step runs) / truth(fastest configuration measured at
   the bucket) - 1, target <= 2% per bucket. The step runs the pair (op's pick, down stage's
   pick) when the op picks a GEMV tactic and the down stage has a pick, else the op's pick; the
   fastest is over every op candidate and every pair, so at a GEMV bucket where the op picks
   another runner a faster pair still counts against it. Beside it: ``regret_op`` (the op's pick
   against its own candidates, all as the op times them: what ``regret`` meant before the down
   stage), ``regret_down`` (the down stage's pick against its tiles, after its fixed gate/up
   tile) and ``regret_gate_up`` (the op's gate/up pick against every gate/up tactic, all with
   the down stage's pick); ``step`` names what the step runs and the fastest configuration
   (``[i, j]``: op candidate ``i`` with tile ``j`` of ``down``, or ``j`` ``None`` for the op's
   own run). Tuning time target <= 60 s per shape. Achieved bandwidth of the pick and of the
   best against the bytes a call must move: the weights of the experts the routing selects,
   plus ``x`` and the output.

Writes ``moe-<gpu>.json`` (``-quick`` suffix with ``--quick``) with provenance, prints one JSON
line and then the table. Exits 2 without CUDA or for an --out that cannot be written, 1 when a
target fails or the result went to the temporary folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _moe_scores import (
    config_text,
    down_choice,
    pair_plan,
    pct,
    pick_scores,
    records_by_tokens,
    step_scores,
    tile_text,
)
from _sweep import name_list

from graphtune import bench
from graphtune.bench.cupti_sweep import cupti_graph_sweep
from graphtune.cli._args import (
    Parser,
    batch_sizes,
    check_script_output,
    non_negative_float,
    positive_int,
    report_written,
)

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


def tune_shape(shape: ExpertShape, max_tokens: int, device: torch.device) -> dict[str, Any]:
    """Step 1: one fresh tuner, every bucket; returns the tuner, runners, records and times."""
    from graphtune.autotuner import AutoTuner
    from graphtune.ops.moe import (
        OP_NAME,
        TorchFusedMoeRunner,
        TritonFusedMoeRunner,
        TritonMoeGemvRunner,
        fused_moe,
    )
    from graphtune.ops.moe.gemv_down import OP_NAME as DOWN_OP_NAME
    from graphtune.ops.moe.gemv_down import down_runners

    # Fresh instances of the op's runners (fused_moe_runners' classes), so compile counts are
    # this shape's own. The down stage's runners are the process-wide ones choose_down asks
    # with (no parameter reaches them), so their counts are taken as differences.
    runners = (TorchFusedMoeRunner(), TritonFusedMoeRunner(), TritonMoeGemvRunner())
    down: tuple[Any, ...] = down_runners()  # TritonRunners: compile counts
    down_before = [(r.compile_seconds, r.compiled) for r in down]
    live = live_inputs(shape, max_tokens, device)
    tuner = AutoTuner(show_progress=False)
    tuner.tuning_mode = True
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fused_moe(*live, tuner=tuner, max_m=max_tokens, runners=runners)
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    tuner.tuning_mode = False
    down_compile_s = sum(r.compile_seconds - b[0] for r, b in zip(down, down_before, strict=True))
    down_compiled = sum(r.compiled - b[1] for r, b in zip(down, down_before, strict=True))
    return {
        "tuner": tuner,
        "runners": runners,
        "down_runners": down,
        "live": live,
        "records": records_by_tokens(tuner.history, OP_NAME),
        "down_records": records_by_tokens(tuner.history, DOWN_OP_NAME),
        "tune_s": wall,
        "compile_s": sum(r.compile_seconds for r in runners[1:]) + down_compile_s,
        "down_compile_s": down_compile_s,
        "stats": {
            "profiles_tuned": tuner.stats.profiles_tuned,
            "tactics_timed": tuner.stats.tactics_timed,
            "measurements": tuner.stats.measurements,
            "extra_rounds": tuner.stats.extra_rounds,
            "tactic_failures": dict(tuner.stats.tactic_failures),
            "compiled": sum(r.compiled for r in runners[1:]) + down_compiled,
        },
    }


def selected_bytes(inputs: list[Any]) -> tuple[int, int]:
    """(bytes a call must move: selected experts' weights + x + out, experts selected)."""
    x, gate_up, down, _, ids = inputs
    selected = int(torch.unique(ids).numel())
    per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    return selected * per_expert + 2 * x.numel() * x.element_size(), selected


def candidate_rows(cands: list[Any], truth: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The JSON rows of a record's candidates with their truth."""
    return [
        {
            "runner": c.runner,
            "runner_index": c.runner_index,
            "tactic": c.tactic,
            "tuner_us": c.median_us,
            "tuner_failed": c.failed,
            "truth": t,
        }
        for c, t in zip(cands, truth, strict=True)
    ]


Sweep = Callable[..., list[dict[str, Any]]]


def sweep_bucket(
    tuned: dict[str, Any], tokens: int, args: argparse.Namespace, sweep: Sweep | None = None
) -> dict[str, Any]:
    """Steps 2 and 3 for one bucket; ``sweep``: the truth (``cupti_graph_sweep`` when
    ``None``), called once with every configuration of the bucket."""
    from graphtune.autotuner import FALLBACK_TACTIC
    from graphtune.autotuner.profiles import generate_profiles, synthesize_inputs
    from graphtune.ops.moe import TritonMoeGemvRunner, fused_moe_config, moe_gemv_tactics
    from graphtune.ops.moe.gemv import gemv_shape

    record = tuned["records"].get(tokens)
    if record is None:
        raise RuntimeError(f"the tuner tuned no bucket of {tokens} tokens")
    down_record = tuned["down_records"].get(tokens)
    config = fused_moe_config(args.max_tokens)
    profile = next(p for p in generate_profiles(config, tuned["live"]) if p.shapes[0][0] == tokens)
    inputs = synthesize_inputs(config, tuned["live"], profile)
    runners, down_runners = tuned["runners"], tuned["down_runners"]
    cands = list(record.candidates)
    tiles, down_pick = down_choice(down_record)
    gemv = [
        isinstance(runners[c.runner_index], TritonMoeGemvRunner) and c.tactic != FALLBACK_TACTIC
        for c in cands
    ]
    pairs = pair_plan(gemv, len(tiles))

    # Each closure binds its own runner and tactics (a loop variable would be late-bound).
    def op_call(cand: Any) -> Callable[[int], object]:
        runner, tactic = runners[cand.runner_index], cand.tactic
        return lambda _i: runner.forward(inputs, tactic)

    def pair_call(gate_up: Any, tile: Any) -> Callable[[int], object]:
        runner, tactic, down_tile = runners[gate_up.runner_index], gate_up.tactic, tile.tactic
        return lambda _i: runner.forward(inputs, tactic=tactic, down_tile=down_tile)

    def down_call(tile: Any) -> Callable[[int], object]:
        # The down stage's runner runs its fixed gate/up tile, then the tile (its launch).
        runner, tactic = down_runners[tile.runner_index], tile.tactic
        return lambda _i: runner.forward(inputs, tactic=tactic)

    fns = [op_call(c) for c in cands]
    fns += [pair_call(cands[i], tiles[j]) for i, j in pairs]
    fns += [down_call(tile) for tile in tiles]
    estimates = [c.median_us for c in cands] + [cands[i].median_us for i, _ in pairs]
    estimates += [tile.median_us for tile in tiles]
    calls = [
        bench.graph_calls_for(
            us if math.isfinite(us) else None,
            min_replay_us=args.min_replay_us,
            min_calls=1,
            max_calls=50,
        )
        for us in estimates
    ]
    start = time.perf_counter()
    truth = (sweep or cupti_graph_sweep)(fns, calls, replays=args.replays)
    sweep_s = time.perf_counter() - start
    op_truth = truth[: len(cands)]
    pair_truth = truth[len(cands) : len(cands) + len(pairs)]
    down_truth = truth[len(cands) + len(pairs) :]
    times = [t["per_call_us"] for t in op_truth]
    op = pick_scores(times, record.winner_index)
    pick, best = op["pick"], op["best"]
    step = step_scores(times, pick, gemv, pairs, [t["per_call_us"] for t in pair_truth], down_pick)
    bytes_moved, selected = selected_bytes(inputs)

    def gbps(us: float) -> float | None:
        return bytes_moved / (us * 1e3) if math.isfinite(us) and us > 0 else None

    down: dict[str, Any] | None = None
    if tiles:
        scores = pick_scores([t["per_call_us"] for t in down_truth], down_pick)
        # As TritonMoeGemvDownRunner.launch chooses it: every down tile is timed after it.
        fixed = moe_gemv_tactics(*gemv_shape(inputs), itemsize=inputs[0].element_size())
        down = {
            "n_candidates": len(tiles),
            "candidates": candidate_rows(tiles, down_truth),
            "gate_up_tactic": fixed[0] if fixed else None,
            "pick_tactic": tiles[down_pick].tactic if down_pick is not None else None,
            "best_tactic": tiles[scores["best"]].tactic,
            **scores,
        }
    step.update(pick_gbps=gbps(step["pick_us"]), best_gbps=gbps(step["best_us"]))
    return {
        "tokens": tokens,
        "n_candidates": len(cands),
        "n_measured": len(fns),
        "candidates": candidate_rows(cands, op_truth),
        "pick": pick,
        "pick_tactic": cands[pick].tactic if pick is not None else None,
        "pick_us": op["pick_us"],
        "best": best,
        "best_tactic": cands[best].tactic,
        "best_us": op["best_us"],
        "fallback_us": times[0] if cands[0].runner_index == 0 else None,
        "regret": step["regret"],
        "regret_pass": step["regret"] <= TARGET_REGRET,
        "regret_op": op["regret"],
        "regret_down": down["regret"] if down is not None else None,
        "regret_gate_up": step["regret_gate_up"],
        "step": step,
        "down": down,
        "pairs": [
            {"gate_up": i, "down": j, "truth": t}
            for (i, j), t in zip(pairs, pair_truth, strict=True)
        ],
        "experts_selected": selected,
        "bytes": bytes_moved,
        "pick_gbps": gbps(op["pick_us"]),
        "best_gbps": gbps(op["best_us"]),
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
        down_compile_s=tuned["down_compile_s"],
        tuned_buckets=sorted(tuned["records"]),
        down_buckets=sorted(tuned["down_records"]),
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
                f"  T={tokens:<5} regret {pct(bucket['regret'])} (op {pct(bucket['regret_op'])}, "
                f"down {pct(bucket['regret_down'])}) over {bucket['n_measured']} "
                f"configurations, sweep {bucket['sweep_s']:.1f} s",
                flush=True,
            )
    result["sweep_s"] = sum(b.get("sweep_s", 0.0) for b in result["buckets"])
    del tuned
    torch.cuda.empty_cache()
    return result


def table(shapes: list[dict[str, Any]]) -> str:
    """The buckets (what the step runs, beside the op's and the down stage's own regret), then
    the tuning times."""
    lines = [
        "| shape | T | measured | pick | pick us | best | best us | regret | <=2% | op regret "
        "| down pick | down regret | pick GB/s | best GB/s | torch us |",
        "|---|---:|---:|---|---:|---|---:|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for s in shapes:
        for b in s.get("buckets", []):
            if "error" in b:
                lines.append(f"| {s['shape']} | {b['tokens']} | error: {b['error'][:60]} |")
                continue
            step, down = b["step"], b["down"]
            down_pick = "-" if down is None else tile_text(down["pick_tactic"])
            lines.append(
                f"| {s['shape']} | {b['tokens']} | {b['n_measured']} "
                f"| {config_text(b, step['pick'])} | {step['pick_us']:.1f} "
                f"| {config_text(b, step['best'])} | {step['best_us']:.1f} | {pct(b['regret'])} "
                f"| {'yes' if b['regret_pass'] else 'NO'} | {pct(b['regret_op'])} "
                f"| {down_pick} | {pct(b['regret_down'])} | {step['pick_gbps'] or 0:.0f} "
                f"| {step['best_gbps'] or 0:.0f} | {b['fallback_us'] or math.nan:.1f} |"
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON result"
    )
    parser.add_argument(
        "--shapes", type=name_list(tuple(SHAPES), "shape"), default=",".join(SHAPES), help="shapes"
    )
    parser.add_argument(
        "--tokens", type=batch_sizes, default="1,8,64,512,4096", help="tokens per swept bucket"
    )
    parser.add_argument("--max-tokens", type=positive_int, default=4096, help="largest bucket")
    parser.add_argument("--replays", type=positive_int, default=10, help="CUPTI replays")
    parser.add_argument(
        "--min-replay-us",
        type=non_negative_float,
        default=200.0,
        help="calls per replay: at least this long by the tuner's time",
    )
    parser.add_argument("--commit", default=None, help="commit to record (default: git)")
    parser.add_argument("--quick", action="store_true", help="tokens 1,64; buckets up to 64")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    args.shapes = list(args.shapes)
    if args.quick:
        args.tokens, args.max_tokens = [1, 64], 64
    args.tokens = list(args.tokens)
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
    target = args.out / f"moe-{prov['gpu_slug']}{'-quick' if args.quick else ''}.json"
    check_script_output(target)  # before the work: exit 2 on a bad --out
    print(f"{prov['gpu']}, torch {prov['torch']}, triton {prov['triton']}, commit {prov['commit']}")
    shapes = [run_shape(name, args, device) for name in args.shapes]
    buckets = [b for s in shapes for b in s.get("buckets", [])]
    summary = {
        "regret_pass": bool(buckets) and all(b.get("regret_pass") for b in buckets),
        "worst_regret": max((b.get("regret", math.inf) for b in buckets), default=None),
        "worst_regret_op": max((b.get("regret_op", math.inf) for b in buckets), default=None),
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
            "regret": f"what the step runs (the op's pick, with the down stage's pick at a GEMV "
            f"pick) within {100 * TARGET_REGRET:.0f}% of the fastest configuration measured "
            "(CUPTI in-graph truth) in every bucket",
            "tune_s": f"all buckets of one shape tuned in <= {TARGET_TUNE_S:.0f} s (wall, compile "
            "included)",
        },
        "shapes": shapes,
        "summary": summary,
        "wall_s": time.perf_counter() - started,
    }
    path = bench.write_json(target, payload)  # target, or the fallback file it went to instead
    print(json.dumps(bench.json_safe({"benchmark": "moe", "json": str(path), **summary})))
    print(table(shapes))
    # Exit 1 also when the result went to the temporary folder: no file at target for a script.
    return 0 if report_written("--out", target, path) and summary["all_pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
