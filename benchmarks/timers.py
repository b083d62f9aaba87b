#!/usr/bin/env python3
"""How close each timer gets to the CUPTI kernel time, from ~1 µs kernels to ~1 ms GEMMs.

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/timers.py --out benchmarks/results [--quick] [--commit SHA]

For each op (bf16 GEMMs, elementwise ops, and a small MLP of several kernels) it measures, in one
run and with the same inputs (hot L2 for all but do_bench):

* ``cupti``: ground truth, the summed device durations of one call's kernels from
  ``torch.profiler`` (median over calls, after warm-up), measured before and after the timers;
  the reference is their mean so clock drift during the case shows up in neither direction.
* ``graph``: :class:`graphtune.autotuner.timing.GraphTimer` (tuner defaults warmup=3, repeat=10).
* ``events``: :class:`graphtune.autotuner.timing.EventTimer` (delay kernel sized from host cost).
* references: ``naive_events`` (events around one call, no delay), ``naive_graph`` (one call per
  graph, events around each replay), ``do_bench`` (``triton.testing.do_bench``, median; it
  flushes L2 between calls, so it reads cold-cache times).

Targets (single-kernel ops): graph within 0.95-1.10x of CUPTI for kernels >= 8 µs and within
1.5x (either way) below; events within 0.95-1.15x for kernels >= 8 µs. The multi-kernel op is
reported without a target. Prints one line per case, a one-line JSON summary, and the table last;
writes ``timers-<gpu>.json`` (``timers-<gpu>-quick.json`` with ``--quick``) into ``--out``.
Exits 2 without CUDA or for an --out that cannot be written, 1 if a target failed, a case errored
or the result went to the temporary folder, else 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphtune.autotuner.timing import EventTimer, GraphTimer, Measurement
from graphtune.bench import (
    capture_calls,
    cupti_kernel_time,
    provenance,
    release,
    require_cuda_or_exit,
    write_json,
)
from graphtune.cli._args import (
    Parser,
    check_script_output,
    non_negative_int,
    positive_int,
    report_written,
)

logger = logging.getLogger("benchmarks.timers")

TimedFn = Callable[[int], object]
SMALL_KERNEL_US = 8.0  # below this the looser ~1 µs target applies


@dataclass(frozen=True)
class Case:
    """One op to time."""

    name: str
    kind: str  # "gemm", "elementwise" or "multi-kernel"
    quick: bool  # part of the --quick set
    build: Callable[[torch.device], TimedFn]

    @property
    def single_kernel_op(self) -> bool:
        return self.kind != "multi-kernel"


def _randn(*shape: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    # Random, never zeros: zero operands can take faster paths in hardware (power, sparsity).
    return torch.randn(*shape, device=device, dtype=dtype)


def gemm(m: int, n: int, k: int, quick: bool = False) -> Case:
    def build(device: torch.device) -> TimedFn:
        a = _randn(m, k, device=device)
        b = _randn(k, n, device=device) / k**0.5
        return lambda i: torch.mm(a, b)

    return Case(f"gemm {m}x{n}x{k}", "gemm", quick, build)


def silu(mib: int, quick: bool = False) -> Case:
    def build(device: torch.device) -> TimedFn:
        x = _randn(mib * 1024 * 1024 // 2, device=device)
        return lambda i: torch.nn.functional.silu(x)

    return Case(f"silu bf16 {mib} MiB", "elementwise", quick, build)


def add(elements: int, quick: bool = False) -> Case:
    def build(device: torch.device) -> TimedFn:
        x = _randn(elements, device=device)
        y = _randn(elements, device=device)
        return lambda i: torch.add(x, y)

    return Case(f"add bf16 {elements} elems", "elementwise", quick, build)


def mlp(tokens: int, hidden: int, inter: int, quick: bool = False) -> Case:
    def build(device: torch.device) -> TimedFn:
        x = _randn(tokens, hidden, device=device)
        w13 = _randn(hidden, 2 * inter, device=device) / hidden**0.5
        w2 = _randn(inter, hidden, device=device) / inter**0.5

        def fn(i: int) -> torch.Tensor:
            gate, up = torch.mm(x, w13).chunk(2, dim=-1)
            return torch.mm(torch.nn.functional.silu(gate) * up, w2)

        return fn

    return Case(f"mlp {tokens}x{hidden}->{inter}", "multi-kernel", quick, build)


CASES = [
    add(8192, quick=True),
    gemm(16, 256, 256, quick=True),
    gemm(16, 1024, 1024),
    gemm(16, 4096, 4096, quick=True),
    gemm(256, 8192, 8192),
    gemm(4096, 4096, 4096, quick=True),
    gemm(8192, 8192, 8192),
    silu(64, quick=True),
    mlp(32, 4096, 8192, quick=True),
]


# --- reference timers (deliberately naive) -----------------------------------------------------


def naive_graph_replay(fn: TimedFn, samples: int) -> dict[str, Any]:
    """One call per graph; events around each replay, replays issued back to back."""
    graph = capture_calls(fn, 1, warmup=3)
    try:
        graph.replay()
        torch.cuda.synchronize()
        pairs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(samples)
        ]
        for start, end in pairs:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        values = [start.elapsed_time(end) * 1000.0 for start, end in pairs]
    finally:
        release(graph)
    return _summary(Measurement.from_samples(values, calls_per_sample=1, timer="naive_graph"))


def do_bench(fn: TimedFn) -> dict[str, Any]:
    """``triton.testing.do_bench`` median, in µs (it flushes L2 between calls)."""
    try:
        from triton.testing import do_bench as triton_do_bench
    except ImportError as exc:
        raise RuntimeError(f"triton.testing.do_bench is not importable: {exc}") from exc
    try:
        ms = triton_do_bench(lambda: fn(0), warmup=25, rep=100, return_mode="median")
    except TypeError:  # older Triton: no return_mode
        ms = triton_do_bench(lambda: fn(0), warmup=25, rep=100, quantiles=[0.5])
    if isinstance(ms, (list, tuple)):
        ms = ms[0]
    return {"per_call_us": float(ms) * 1000.0, "note": "median; flushes L2 between calls"}


def _summary(measurement: Any) -> dict[str, Any]:
    return {
        "per_call_us": measurement.median_us,
        "min_us": measurement.min_us,
        "spread": measurement.spread,
        "n": measurement.n,
        "calls_per_sample": measurement.calls_per_sample,
    }


# --- targets -----------------------------------------------------------------------------------


def graph_verdict(cupti_us: float, ratio: float | None) -> bool | None:
    """GraphTimer target: 0.95-1.10x for kernels >= 8 µs, within 1.5x either way below."""
    if ratio is None:
        return False
    if cupti_us >= SMALL_KERNEL_US:
        return 0.95 <= ratio <= 1.10
    return 1 / 1.5 <= ratio <= 1.5


def events_verdict(cupti_us: float, ratio: float | None) -> bool | None:
    """EventTimer target: 0.95-1.15x for kernels >= 8 µs; no target below."""
    if cupti_us < SMALL_KERNEL_US:
        return None
    if ratio is None:
        return False
    return 0.95 <= ratio <= 1.15


# --- running -----------------------------------------------------------------------------------


def run_case(case: Case, device: torch.device, args: argparse.Namespace, timers: dict) -> dict:
    record: dict[str, Any] = {
        "name": case.name,
        "kind": case.kind,
        "single_kernel_op": case.single_kernel_op,
        "error": None,
        "cupti": None,
        "timers": {},
        "ratios": {},
        "targets": {},
    }
    began = time.perf_counter()
    fn: TimedFn | None = None
    try:
        fn = case.build(device)
        before = cupti_kernel_time(fn, calls=args.cupti_calls, warmup=5)
        measure: dict[str, Callable[[], dict[str, Any]]] = {
            "graph": lambda: _summary(
                timers["graph"].measure(fn, warmup=args.warmup, repeat=args.repeat)
            ),
            "events": lambda: _summary(
                timers["events"].measure(fn, warmup=args.warmup, repeat=args.repeat)
            ),
            "naive_events": lambda: _summary(
                timers["naive_events"].measure(fn, warmup=args.warmup, repeat=1)
            ),
            "naive_graph": lambda: naive_graph_replay(fn, samples=args.samples * 3),
            "do_bench": lambda: do_bench(fn),
        }
        for name, run in measure.items():
            try:
                result = run()
            except Exception as exc:  # one failing timer must not lose the others
                logger.exception("%s: %s failed", case.name, name)
                record["timers"][name] = {"error": f"{type(exc).__name__}: {exc}"}
                _recover()
                continue
            if name == "graph":
                result["calls_per_replay"] = timers["graph"].last_calls
            if name == "events":
                result["delay"] = dict(timers["events"].last_info)
            record["timers"][name] = result
        after = cupti_kernel_time(fn, calls=args.cupti_calls, warmup=2)
        reference = (before.per_call_us + after.per_call_us) / 2
        record["cupti"] = {
            **before.as_dict(),
            "per_call_us": reference,
            "before_us": before.per_call_us,
            "after_us": after.per_call_us,
        }
        for name, result in record["timers"].items():
            value = result.get("per_call_us")
            record["ratios"][name] = value / reference if value and reference > 0 else None
        if case.single_kernel_op:
            record["targets"]["graph"] = graph_verdict(reference, record["ratios"].get("graph"))
            record["targets"]["events"] = events_verdict(reference, record["ratios"].get("events"))
    except Exception as exc:  # one failing case must not lose the others
        logger.exception("%s failed", case.name)
        record["error"] = f"{type(exc).__name__}: {exc}"
        _recover()
    finally:
        fn = None
        gc.collect()
        torch.cuda.empty_cache()
    record["wall_s"] = time.perf_counter() - began
    return record


def _recover() -> None:
    """Drains the device after a failure so the next case starts clean (best effort)."""
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:  # a sticky CUDA error: later cases will report it too
        logger.error("device did not recover: %s", exc)


def _fmt_verdict(value: bool | None) -> str:
    return "-" if value is None else ("pass" if value else "FAIL")


def table(records: list[dict[str, Any]]) -> str:
    from graphtune.reporting import render_table

    columns = [
        "op",
        "CUPTI us",
        "k/call",
        "graph us",
        "graph x",
        "events us",
        "events x",
        "naive ev x",
        "do_bench x",
        "naive graph x",
        "graph target",
        "events target",
    ]
    rows = []
    for rec in records:
        if rec["error"]:
            rows.append([rec["name"], "error", rec["error"][:60]] + [None] * 9)
            continue
        ratios = rec["ratios"]
        timers = rec["timers"]
        rows.append(
            [
                rec["name"],
                rec["cupti"]["per_call_us"],
                rec["cupti"]["kernels_per_call"],
                timers.get("graph", {}).get("per_call_us"),
                ratios.get("graph"),
                timers.get("events", {}).get("per_call_us"),
                ratios.get("events"),
                ratios.get("naive_events"),
                ratios.get("do_bench"),
                ratios.get("naive_graph"),
                _fmt_verdict(rec["targets"].get("graph")),
                _fmt_verdict(rec["targets"].get("events")),
            ]
        )
    return render_table("Timers vs CUPTI kernel time (x = timer / CUPTI)", columns, rows, width=180)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    verdicts = [(r["name"], t, v) for r in records for t, v in r["targets"].items()]
    failed = [f"{name}: {timer}" for name, timer, v in verdicts if v is False]
    errors = [r["name"] for r in records if r["error"]] + [
        f"{r['name']}: {t}" for r in records for t, res in r["timers"].items() if "error" in res
    ]
    return {
        "targets_checked": sum(v is not None for _, _, v in verdicts),
        "targets_passed": sum(v is True for _, _, v in verdicts),
        "targets_failed": failed,
        "errors": errors,
        "all_pass": not failed and not [r for r in records if r["error"]],
    }


def selected_cases(args: argparse.Namespace) -> list[Case]:
    """The cases ``--quick`` and ``--only`` leave."""
    return [c for c in CASES if (c.quick or not args.quick) and (args.only or "") in c.name]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON result"
    )
    parser.add_argument("--quick", action="store_true", help="smaller set, fewer samples")
    parser.add_argument(
        "--commit", default=None, help="commit to record (default: GRAPHTUNE_COMMIT, else git)"
    )
    parser.add_argument(
        "--warmup", type=non_negative_int, default=3, help="timer warm-up (tuner default 3)"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=10, help="calls/sample (tuner default 10)"
    )
    parser.add_argument("--replays", type=positive_int, default=10, help="GraphTimer timed replays")
    parser.add_argument("--samples", type=positive_int, default=10, help="EventTimer samples")
    parser.add_argument(
        "--cupti-calls", type=positive_int, default=50, help="profiled calls per case"
    )
    parser.add_argument(
        "--only", default=None, help="run cases whose name contains this text (default: all)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if not selected_cases(args):  # else the run checks nothing and passes
        names = [c.name for c in CASES if c.quick or not args.quick]
        parser.error(f"--only {args.only!r} matches no case of {names}")
    if args.quick:
        args.replays = min(args.replays, 7)
        args.samples = min(args.samples, 7)
        args.cupti_calls = min(args.cupti_calls, 20)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    device = require_cuda_or_exit("benchmarks/timers.py")
    started = time.perf_counter()
    prov = provenance(args.commit, device)
    target = args.out / f"timers-{prov['gpu_slug']}{'-quick' if args.quick else ''}.json"
    check_script_output(target)  # before the work: exit 2 on a bad --out
    cases = selected_cases(args)
    # One instance of each timer for the whole run, as the tuner keeps them.
    timers = {
        "graph": GraphTimer(replays=args.replays, device=device),
        "events": EventTimer(samples=args.samples, device=device),
        "naive_events": EventTimer(samples=args.samples * 3, delay=False, device=device),
    }
    print(
        f"{prov['gpu']} (sm {prov['compute_capability']}), torch {prov['torch']}, "
        f"CUDA {prov['cuda']}, triton {prov['triton']}, commit {prov['commit']}"
    )
    records = []
    for case in cases:
        rec = run_case(case, device, args, timers)
        records.append(rec)
        if rec["error"]:
            print(f"  {case.name:<28} ERROR {rec['error']}", flush=True)
        else:
            ratios = ", ".join(f"{k} {v:.3f}x" for k, v in rec["ratios"].items() if v is not None)
            print(
                f"  {case.name:<28} cupti {rec['cupti']['per_call_us']:9.2f} us | {ratios} "
                f"({rec['wall_s']:.1f} s)",
                flush=True,
            )
    summary = summarize(records)
    payload = {
        "benchmark": "timers",
        "provenance": prov,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "targets": {
            "graph": "0.95-1.10x of CUPTI for kernels >= 8 us; within 1.5x below 8 us",
            "events": "0.95-1.15x of CUPTI for kernels >= 8 us",
            "scope": "single-kernel ops; the multi-kernel op is reported without a target",
        },
        "cases": records,
        "summary": summary,
        "wall_s": time.perf_counter() - started,
    }
    path = write_json(target, payload)  # target, or the fallback file it went to instead
    line = {"benchmark": "timers", "json": str(path), **summary, "wall_s": payload["wall_s"]}
    print(json.dumps(line))
    print(table(records))
    # Exit 1 also when the result went to the temporary folder: no file at target for a script.
    return 0 if report_written("--out", target, path) and summary["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
