#!/usr/bin/env python3
"""Tuning quality of graphtune.ops: each timing mode's picks against CUPTI ground truth.

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/tuning.py --out benchmarks/results [--quick] [--commit SHA]

For each op at Llama-1B decode shapes (bf16 GEMMs qkv 2048->3072, o_proj 2048->2048, gate_up
2048->16384, down 8192->2048, the LM head 2048->128256 on a few buckets; fused RMSNorm with
residual, SiLU-and-mul, RoPE + KV-cache write) and each batch bucket:

1. every Triton tactic is compiled ahead of time (parallel threads; compile time reported apart);
2. ground truth: the CUPTI kernel time (``torch.profiler``) of EVERY (runner, tactic), summed over
   its kernels, on the same random inputs (hot L2, as the timers see them);
3. tuning with each timing mode (``graph``, ``events``, ``wallclock`` = host clock around
   ``torch.cuda.synchronize``), 3 independent runs each (a fresh AutoTuner per run, default
   settings), recording the pick and the tuning wall time.

Reported per (op, bucket): the pick of each mode and run, regret = CUPTI time of the pick / CUPTI
time of the best candidate (worst of the 3 runs), whether the 3 picks agree, and tuning wall time
per (tactic, bucket) (compilation excluded: it happened in step 1). Targets (graph mode): regret
<= 1% in >= 95% of cases and never > 5%; the same pick 3/3 in >= 95% of cases; median tuning time
per (tactic, bucket) <= 30 ms. Writes ``tuning-<gpu>.json`` (``-quick`` suffix with ``--quick``)
with provenance and prints the table last. Exits 2 without CUDA, 1 when a target fails.

``graphtune bench tuning`` runs :func:`main` of this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402  (benchmarks/ is not a package)

logger = logging.getLogger("benchmarks.tuning")

MODES = ("graph", "events", "wallclock")
RUNS = 3
HIDDEN, INTER, HEADS, KV, DIM, VOCAB = 2048, 8192, 32, 8, 64, 128256
FULL_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TARGET_REGRET, MAX_REGRET, TARGET_SHARE, TARGET_MS = 0.01, 0.05, 0.95, 30.0


@dataclass(frozen=True)
class Case:
    """One (op, bucket) to tune."""

    op: str
    label: str
    bucket: int
    build: Callable[[torch.device, int], tuple[str, tuple[Any, ...], Any, list[Any]]]


def _randn(device: torch.device, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(torch.bfloat16)


def _only_bucket(config: Any, m: int) -> Any:
    """The op's tuning config restricted to one bucket (the case), so a run tunes just it."""
    from graphtune.autotuner import DynamicTensorSpec

    return dataclasses.replace(
        config, dynamic_specs=(DynamicTensorSpec(0, 0, buckets=(m,)),), max_value=m
    )


def gemm_case(label: str, n: int, k: int, m: int, max_tactics: int = 20) -> Case:
    def build(device: torch.device, m: int):
        from graphtune.ops.gemm import OP_NAME, TorchGemmRunner, TritonGemmRunner, gemm_config

        runners = (TorchGemmRunner(), TritonGemmRunner(max_tactics=max_tactics))
        inputs = [_randn(device, m, k), _randn(device, n, k, scale=k ** -0.5), None, None, False]
        return OP_NAME, runners, _only_bucket(gemm_config(m), m), inputs

    return Case("gemm", f"{label} {k}->{n}", m, build)


def norm_case(m: int) -> Case:
    def build(device: torch.device, m: int):
        from graphtune.ops.rmsnorm import (
            OP_NAME,
            TorchRMSNormRunner,
            TritonRMSNormRunner,
            rms_norm_config,
        )

        inputs = [_randn(device, m, HIDDEN), _randn(device, HIDDEN), _randn(device, m, HIDDEN),
                  1e-5]
        runners = (TorchRMSNormRunner(), TritonRMSNormRunner())
        return OP_NAME, runners, _only_bucket(rms_norm_config(m, True), m), inputs

    return Case("rms_norm", f"add+rmsnorm {HIDDEN}", m, build)


def silu_case(m: int) -> Case:
    def build(device: torch.device, m: int):
        from graphtune.ops.activation import (
            OP_NAME,
            TorchSiluAndMulRunner,
            TritonSiluAndMulRunner,
            silu_and_mul_config,
        )

        runners = (TorchSiluAndMulRunner(), TritonSiluAndMulRunner())
        inputs = [_randn(device, m, 2 * INTER)]
        return OP_NAME, runners, _only_bucket(silu_and_mul_config(m), m), inputs

    return Case("silu_and_mul", f"silu*mul {INTER}", m, build)


def rope_case(m: int) -> Case:
    def build(device: torch.device, m: int):
        from graphtune.ops.rotary import (
            CACHE_ROWS,
            OP_NAME,
            TABLE_ROWS,
            TorchRopeRunner,
            TritonRopeRunner,
            rope_config,
        )

        runners = (TorchRopeRunner(HEADS, KV, True), TritonRopeRunner(HEADS, KV, True))
        rows = torch.randperm(CACHE_ROWS, device=device)[: m * KV]
        inputs = [
            _randn(device, m, (HEADS + 2 * KV) * DIM),
            torch.randint(0, TABLE_ROWS, (m,), device=device),
            _randn(device, TABLE_ROWS, DIM), _randn(device, TABLE_ROWS, DIM),
            _randn(device, CACHE_ROWS, DIM), _randn(device, CACHE_ROWS, DIM), rows,
        ]
        return OP_NAME, runners, _only_bucket(rope_config(KV, m), m), inputs

    return Case("rope_kv_cache", f"rope+kv {HEADS}/{KV}x{DIM}", m, build)


def cases(quick: bool) -> list[Case]:
    gemm_buckets = (1, 16, 128) if quick else FULL_BUCKETS
    fused_buckets = (1, 64) if quick else (1, 8, 64)
    shapes = [("qkv", 3072, 2048), ("o_proj", 2048, 2048), ("gate_up", 16384, 2048),
              ("down", 2048, 8192)]
    if quick:
        shapes = [shapes[0], shapes[3]]
    out = [gemm_case(label, n, k, m) for label, n, k in shapes for m in gemm_buckets]
    if not quick:
        out += [gemm_case("lm_head", VOCAB, HIDDEN, m, max_tactics=8) for m in (1, 16, 128)]
    for m in fused_buckets:
        out += [norm_case(m), silu_case(m), rope_case(m)]
    return out


def short_tactic(runner: str, tactic: Any) -> str:
    """Compact label: ``Triton 16x64x128 w4 s3 k4`` for a GEMM tactic."""
    name = runner.replace("Runner", "").split("[")[0]
    if isinstance(tactic, dict) and "split_k" in tactic:
        t = tactic
        return (f"{name} {t['bm']}x{t['bn']}x{t['bk']} w{t['warps']} s{t['stages']} "
                f"k{t['split_k']}")
    if isinstance(tactic, dict):
        return f"{name} " + " ".join(f"{k[0]}{v}" for k, v in tactic.items())
    return f"{name} {tactic}"


def run_case(case: Case, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    from graphtune.autotuner import AutoTuner
    from graphtune.autotuner.runner import runner_id, short_runner_name
    from graphtune.autotuner.timing import resolve_timer
    from graphtune.ops._triton import TritonRunner

    op, runners, config, inputs = case.build(device, case.bucket)
    record: dict[str, Any] = {"op": case.op, "shape": case.label, "bucket": case.bucket,
                              "error": None, "modes": {}}
    began = time.perf_counter()
    candidates: list[tuple[int, Any]] = [(0, -1)]
    compile_s = 0.0
    for index, runner in enumerate(runners):
        tactics = [t for t in runner.get_valid_tactics(inputs, None) if (index, t) != (0, -1)]
        if isinstance(runner, TritonRunner) and tactics:
            start = time.perf_counter()
            report = runner.precompile(inputs, tactics)
            compile_s += time.perf_counter() - start
            failed = {k: v for k, v in report.items() if v}
            if failed:
                logger.warning("%s: %d tactics failed to compile: %s", case.label, len(failed),
                               list(failed.values())[:2])
        candidates += [(index, t) for t in tactics]
    record["compile_s"] = compile_s
    truth = []
    for index, tactic in candidates:
        runner = runners[index]

        def call(i: int, runner=runner, tactic=tactic) -> object:
            return runner.forward(inputs, tactic)

        try:
            kt = _common.cupti_kernel_time(call, calls=args.cupti_calls, warmup=3)
            us = kt.per_call_us
        except Exception as exc:  # a candidate that cannot run is reported, not fatal
            logger.warning("%s %s: %s", case.label, tactic, exc)
            us = float("inf")
        truth.append({"runner": short_runner_name(runner_id(runner)), "runner_index": index,
                      "tactic": tactic, "cupti_us": us})
    best = min(truth, key=lambda t: t["cupti_us"])
    record.update(candidates=truth, best=best, n_candidates=len(truth))

    def true_time(runner: Any, tactic: Any) -> float:
        index = runners.index(runner)
        for t in truth:
            if t["runner_index"] == index and json.dumps(t["tactic"]) == json.dumps(tactic):
                return t["cupti_us"]
        return float("inf")

    for mode in MODES:
        picks, regrets, tune_s = [], [], []
        for _ in range(RUNS):
            tuner = AutoTuner(timer=resolve_timer(mode, device), show_progress=False)
            tuner.tuning_mode = True
            start = time.perf_counter()
            runner, tactic = tuner.choose_one(op, runners, config, inputs)
            torch.cuda.synchronize(device)
            tune_s.append(time.perf_counter() - start)
            picks.append({"runner": short_runner_name(runner_id(runner)), "tactic": tactic})
            regrets.append(true_time(runner, tactic) / best["cupti_us"] - 1.0)
        keys = {json.dumps(p, sort_keys=True) for p in picks}
        record["modes"][mode] = {
            "picks": picks,
            "regrets": regrets,
            "regret": max(regrets),
            "agree": len(keys) == 1,
            "tune_s": tune_s,
            "ms_per_tactic": [1000.0 * s / len(truth) for s in tune_s],
        }
    record["wall_s"] = time.perf_counter() - began
    return record


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if not r["error"]]
    out: dict[str, Any] = {"cases": len(records), "errors": len(records) - len(ok)}
    for mode in MODES:
        regrets = [r["modes"][mode]["regret"] for r in ok]
        agree = [r["modes"][mode]["agree"] for r in ok]
        ms = [v for r in ok for v in r["modes"][mode]["ms_per_tactic"]]
        out[mode] = {
            "share_regret_le_1pct": sum(g <= TARGET_REGRET for g in regrets) / max(1, len(ok)),
            "max_regret": max(regrets, default=None),
            "mean_regret": statistics.mean(regrets) if regrets else None,
            "share_agree_3of3": sum(agree) / max(1, len(ok)),
            "median_ms_per_tactic": statistics.median(ms) if ms else None,
        }
    graph = out["graph"]
    out["targets"] = {
        "graph_regret_le_1pct_in_95pct": graph["share_regret_le_1pct"] >= TARGET_SHARE,
        "graph_regret_never_gt_5pct": (graph["max_regret"] or 0) <= MAX_REGRET,
        "graph_same_pick_3of3_in_95pct": graph["share_agree_3of3"] >= TARGET_SHARE,
        "graph_median_ms_per_tactic_le_30": (graph["median_ms_per_tactic"] or 0) <= TARGET_MS,
    }
    out["compile_s_total"] = sum(r.get("compile_s", 0.0) for r in records)
    out["all_pass"] = all(out["targets"].values()) and not out["errors"]
    return out


def table(records: list[dict[str, Any]]) -> str:
    from graphtune.reporting import render_table

    columns = ["op", "M", "cands", "best (CUPTI)", "best us", "graph pick", "graph regret",
               "events regret", "wallclock regret", "agree g/e/w", "ms/tactic g"]
    rows = []
    for r in records:
        if r["error"]:
            rows.append([r["shape"], r["bucket"], "error", r["error"][:50]] + [None] * 7)
            continue
        modes = r["modes"]
        graph_pick = modes["graph"]["picks"][0]
        rows.append([
            r["shape"], r["bucket"], r["n_candidates"],
            short_tactic(r["best"]["runner"], r["best"]["tactic"]), r["best"]["cupti_us"],
            short_tactic(graph_pick["runner"], graph_pick["tactic"]),
            f"{100 * modes['graph']['regret']:.1f}%",
            f"{100 * modes['events']['regret']:.1f}%",
            f"{100 * modes['wallclock']['regret']:.1f}%",
            "/".join("3" if modes[m]["agree"] else "<3" for m in MODES),
            statistics.median(modes["graph"]["ms_per_tactic"]),
        ])
    return render_table("Tuning picks vs CUPTI ground truth (regret = worst of 3 runs)", columns,
                        rows, width=200)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and buckets")
    parser.add_argument("--commit", default=None, help="commit to record (else env / git)")
    parser.add_argument("--cupti-calls", type=int, default=30, help="profiled calls per tactic")
    parser.add_argument("--only", default=None, help="run cases whose label contains this text")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if args.quick:
        args.cupti_calls = min(args.cupti_calls, 20)
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status (2 without CUDA, 1 if a target failed)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    device = _common.require_cuda_or_exit("benchmarks/tuning.py")
    try:
        import graphtune.ops  # noqa: F401
    except ImportError:  # run without PYTHONPATH=src: use the checkout's sources
        sys.path.insert(0, str(_common.REPO_ROOT / "src"))
    from graphtune.ops import triton_available

    if not triton_available():
        print("benchmarks/tuning.py: Triton is not importable; pip install triton",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    prov = _common.provenance(args.commit, device)
    print(f"{prov['gpu']} (sm {prov['compute_capability']}), torch {prov['torch']}, "
          f"CUDA {prov['cuda']}, triton {prov['triton']}, commit {prov['commit']}", flush=True)
    todo = [c for c in cases(args.quick) if not args.only or args.only in c.label]
    records = []
    for case in todo:
        try:
            rec = run_case(case, device, args)
        except Exception as exc:  # one failing case must not lose the others
            logger.exception("%s M=%d failed", case.label, case.bucket)
            rec = {"op": case.op, "shape": case.label, "bucket": case.bucket,
                   "error": f"{type(exc).__name__}: {exc}", "modes": {}}
            torch.cuda.synchronize(device)
        records.append(rec)
        if rec["error"]:
            print(f"  {case.label:<24} M={case.bucket:<4} ERROR {rec['error']}", flush=True)
        else:
            g = rec["modes"]["graph"]
            print(f"  {case.label:<24} M={case.bucket:<4} {rec['n_candidates']:>3} cands  "
                  f"best {rec['best']['cupti_us']:8.2f} us  graph regret "
                  f"{100 * g['regret']:5.1f}%  agree {g['agree']}  "
                  f"{rec['wall_s']:.1f} s", flush=True)
    summary = summarize(records)
    summary["wall_s"] = time.perf_counter() - started
    name = f"tuning-{prov['gpu_slug']}{'-quick' if args.quick else ''}.json"
    path = _common.write_json(args.out / name, {
        "benchmark": "tuning", "provenance": prov, "summary": summary, "cases": records,
        "targets": {"graph_regret_le": TARGET_REGRET, "share": TARGET_SHARE,
                    "graph_regret_never_gt": MAX_REGRET, "ms_per_tactic_median_le": TARGET_MS},
    })
    for target, passed in summary["targets"].items():
        print(f"target {target}: {'pass' if passed else 'FAIL'}")
    print(json.dumps({"bench": "tuning", "file": str(path), "all_pass": summary["all_pass"],
                      **{m: summary[m] for m in MODES}}))
    print(table(records))
    return 0 if summary["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
