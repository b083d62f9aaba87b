"""Issue 13's numbers in one run: decode latency of the fused, tuned step against the bytes floor,
the step as tuned before the fused kernels, Hugging Face's compiled recipe, PDL on and off, and
the accuracy target.

Parts (``--parts``, all by default, in this order; each writes its own results JSON through
``graphtune.bench.write_json`` as soon as it is done):

* ``1b``: ``graphtune bench decode`` on the Llama-3.2-1B shape at batch 1/8/32/128, context 512:
  eager, graph runner, tuned graph runner (the fused step), the tuned step with its stages
  unfused (the step as tuned before), Hugging Face static cache + ``torch.compile(mode=
  "reduce-overhead")`` and its eager step on the same weights (``bench decode --compare-hf``,
  with its logits check: one decode step of both on transformers' cache), the bytes floor,
  kernels per step and device time by kernel family (``decode-latency-1b-<gpu>.json``);
* ``pdl``: the same tuned step at batch 1 through the graph runner with ``GRAPHTUNE_PDL=0`` and
  then ``1`` (graphs captured each way), same picks, and from a CUPTI trace of one graph replay
  each way the overlap of consecutive kernels (a PDL launch starts before its predecessor ends)
  and the gaps between them; the traces are saved as ``pdl-{on,off}-trace-<gpu>.json``, to open
  in Perfetto (``decode-latency-pdl-<gpu>.json``);
* ``8b``: the Llama-3-8B and Qwen2.5-7B shapes (QKV bias) at batch 1 and 8, tuned for those
  buckets only (1, 2, 4, 8), graph runner, against their floors (``decode-latency-8b-<gpu>.json``);
* ``accuracy``: over 64 decode steps at batch 1 and 8, the tuned and the untuned bf16 1B step
  against a float32 eager reference of the same weights: max abs logit error and KL of the
  next-token distribution (``decode-latency-accuracy-<gpu>.json``).

Run on the GPU machine from the repository root::

    PYTHONPATH=src python3 benchmarks/decode_latency.py --out OUT [--parts 1b,pdl,8b,accuracy]

It prints a progress line per part and the targets table last. ``--tuning-cache DIR`` keeps the
tuning caches in ``DIR`` (a second run on the same machine tunes nothing). Exits 2 without CUDA
or for an ``--out`` where a part's result cannot be written (checked before the first part), 1
when a part's result went to the temporary folder instead, else 0.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
from _sweep import name_list

from graphtune import bench
from graphtune.autotuner import AutoTuner
from graphtune.bench.accuracy import decode_accuracy
from graphtune.bench.decode import run_decode_bench
from graphtune.bench.decode_report import format_report
from graphtune.bench.decode_results import DecodeBenchConfig, DecodeBenchReport
from graphtune.bench.timeline import last_replay
from graphtune.cli._args import Parser, batch_sizes, check_script_output, report_written
from graphtune.engine.build import build_runner, build_step
from graphtune.engine.kv_cache import KVCache, aligned_seq_len
from graphtune.engine.loading import load_model

PARTS = ("1b", "pdl", "8b", "accuracy")
CONTEXT = 512
BIG_MODELS = ("llama-3-8b-shape", "qwen2.5-7b-shape")
# Issue 13's targets (ms), and the tuned step before the fused kernels (results README).
TARGET_1B = {1: 0.76, 8: 0.85}
FLOOR_RATIO_128, FLOOR_RATIO_8B, SLOWER_BY = 1.5, 1.15, 1.02
BEFORE_1B = {1: 0.997, 8: 1.139, 32: 1.273, 128: 1.865}


def _cache(folder: Path | None, name: str) -> str | None:
    return str(folder / f"{name}.json") if folder is not None else None


def _bench(log_prefix: str, tuner: AutoTuner, **fields: Any) -> DecodeBenchReport:
    cfg = DecodeBenchConfig(context=CONTEXT, tune=True, **fields)
    return run_decode_bench(
        cfg, log=lambda line: print(f"{log_prefix}: {line}", flush=True), tuner=tuner
    )


def part_1b(args: argparse.Namespace, tuner: AutoTuner) -> dict[str, Any]:
    report = _bench(
        "1b",
        tuner,
        model="llama-1b-shape",
        batch_sizes=tuple(args.batch_sizes),
        compare_hf=not args.no_hf,
        hf_compile=None if args.no_hf else True,
        compare_unfused=True,
        tuning_cache=_cache(args.tuning_cache, "llama-1b-shape"),
    )
    print(format_report(report), flush=True)
    return report.to_json()


def replay_overlap(tuner: AutoTuner, trace_path: Path) -> dict[str, Any]:
    """Kernel overlap and gaps in one CUDA-graph replay of the tuned 1B step at batch 1 (CUPTI),
    under the current ``GRAPHTUNE_PDL``; the Chrome trace of the replays goes to ``trace_path``."""
    model = load_model("llama-1b-shape", device="cuda", dtype=torch.bfloat16, seed=0)
    cache = KVCache(model.config, 1, aligned_seq_len(CONTEXT + 1), "cuda", torch.bfloat16)
    cache.k.normal_()
    cache.v.normal_()
    step = build_step(model, cache, tuner=tuner)
    runner = build_runner(step, "graph", capture_sizes=[1])
    args = (torch.zeros(1, dtype=torch.long, device="cuda"),)
    args += (torch.full_like(args[0], CONTEXT), torch.zeros_like(args[0]))
    try:
        with torch.inference_mode():
            runner.capture(*step.example_inputs(1))
            runner(*args)
            torch.cuda.synchronize()
            trace = bench.cupti.profile_trace(lambda i: runner(*args), 0, 3, False)
            if not bench.device_events_from_trace(trace):  # some builds need CPU activity too
                trace = bench.cupti.profile_trace(lambda i: runner(*args), 0, 3, True)
    finally:
        runner.release()
    written = bench.write_json(trace_path, trace)  # trace_path, or where it went instead
    return {
        **overlap_stats(bench.device_events_from_trace(trace), replays=3),
        "trace": str(written),
    }


def overlap_stats(events: list[Any], replays: int) -> dict[str, Any]:
    """Overlap and gaps of consecutive kernels in the last of ``replays`` graph replays
    (``graphtune.bench.timeline.last_replay``)."""
    kernels = last_replay(events, replays)
    overlap = gaps = 0.0
    overlapping = 0
    for before, after in zip(kernels, kernels[1:], strict=False):
        if after.start_us < before.end_us:
            overlapping += 1
            overlap += before.end_us - after.start_us
        else:
            gaps += after.start_us - before.end_us
    return {
        "kernels": len(kernels),
        "span_us": kernels[-1].end_us - kernels[0].start_us,
        "kernel_sum_us": sum(e.duration_us for e in kernels),
        "overlapping_pairs": overlapping,
        "overlap_us": overlap,
        "gap_us": gaps,
    }


def part_pdl(args: argparse.Namespace, tuner: AutoTuner) -> dict[str, Any]:
    runs, overlaps = {}, {}
    gpu = bench.gpu_slug(torch.cuda.get_device_name())
    for label, value in (("pdl_off", "0"), ("pdl_on", "1")):
        # The library reads GRAPHTUNE_PDL at every launch (graphtune.env), capture included.
        os.environ["GRAPHTUNE_PDL"] = value
        report = _bench(
            label,
            tuner,
            model="llama-1b-shape",
            batch_sizes=(1,),
            runners=("graph",),
            tuning_cache=_cache(args.tuning_cache, "llama-1b-shape"),
        )
        runs[label] = report.to_json()
        trace = args.out / f"{label.replace('_', '-')}-trace-{gpu}.json"
        overlaps[label] = replay_overlap(tuner, trace)
        print(f"{label}: one replay {overlaps[label]}", flush=True)
    os.environ["GRAPHTUNE_PDL"] = "1"
    on = runs["pdl_on"]["results"][0]["tuned_graph_ms"]
    off = runs["pdl_off"]["results"][0]["tuned_graph_ms"]
    return {"runs": runs, "tuned_graph_ms": {"pdl_on": on, "pdl_off": off}, "replay": overlaps}


def part_8b(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for name in BIG_MODELS:
        tuner = AutoTuner(show_progress=False)
        report = _bench(
            name,
            tuner,
            model=name,
            batch_sizes=tuple(args.big_batch_sizes),
            runners=("graph",),
            compare_unfused=True,
            tuning_cache=_cache(args.tuning_cache, name),
        )
        print(format_report(report), flush=True)
        out[name] = report.to_json()
        torch.cuda.empty_cache()
    return out


def part_accuracy(args: argparse.Namespace, tuner: AutoTuner) -> dict[str, Any]:
    model = load_model("llama-1b-shape", device="cuda", dtype=torch.bfloat16, seed=0)
    results = decode_accuracy(
        model,
        tuner,
        batch_sizes=(1, 8),
        steps=64,
        max_seq_len=aligned_seq_len(CONTEXT + 1),  # the benchmark's: its attention picks apply
    )
    return {"steps": 64, "results": [r.as_dict() for r in results]}


def targets(found: dict[str, Any]) -> list[list[Any]]:
    """Rows ``[what, value, target, verdict]`` for the parts that ran."""
    rows: list[list[Any]] = []

    def verdict(ok: bool | None) -> str:
        return "-" if ok is None else ("pass" if ok else "MISS")

    if "1b" in found:
        for r in found["1b"]["results"]:
            b, tuned, floor = r["batch_size"], r["tuned_graph_ms"], r["floor_ms"]
            unfused = r.get("tuned_unfused_ms")
            if b in TARGET_1B and tuned is not None:
                rows.append(
                    [
                        f"1B b{b} tuned ms",
                        tuned,
                        f"<= {TARGET_1B[b]}",
                        verdict(tuned <= TARGET_1B[b]),
                    ]
                )
            if b == 128 and tuned and floor:
                ratio = tuned / floor
                rows.append(
                    [
                        "1B b128 tuned/floor",
                        ratio,
                        f"<= {FLOOR_RATIO_128}",
                        verdict(ratio <= FLOOR_RATIO_128),
                    ]
                )
            if tuned is not None and unfused:
                ratio = tuned / unfused
                rows.append(
                    [
                        f"1B b{b} tuned / tuned unfused",
                        ratio,
                        f"<= {SLOWER_BY}",
                        verdict(ratio <= SLOWER_BY),
                    ]
                )
            if tuned is not None and b in BEFORE_1B:
                ratio = tuned / BEFORE_1B[b]
                rows.append(
                    [
                        f"1B b{b} tuned / before ({BEFORE_1B[b]} ms)",
                        ratio,
                        f"<= {SLOWER_BY}",
                        verdict(ratio <= SLOWER_BY),
                    ]
                )
            if r.get("hf_ms") and tuned:
                rows.append([f"1B b{b} HF compile / tuned", r["hf_ms"] / tuned, "-", "-"])
            if r.get("hf_argmax_agreement") is not None:
                agree = r["hf_argmax_agreement"]
                rows.append([f"1B b{b} HF vs engine same greedy token", agree, "-", "-"])
    if "pdl" in found:
        ms = found["pdl"]["tuned_graph_ms"]
        if ms["pdl_on"] and ms["pdl_off"]:
            rows.append(
                [
                    "1B b1 tuned PDL off / on",
                    ms["pdl_off"] / ms["pdl_on"],
                    "> 1",
                    verdict(ms["pdl_off"] > ms["pdl_on"]),
                ]
            )
    for name, data in found.get("8b", {}).items():
        for r in data["results"]:
            if r["batch_size"] == 1 and r["tuned_graph_ms"] and r["floor_ms"]:
                ratio = r["tuned_graph_ms"] / r["floor_ms"]
                rows.append(
                    [
                        f"{name} b1 tuned/floor",
                        ratio,
                        f"<= {FLOOR_RATIO_8B}",
                        verdict(ratio <= FLOOR_RATIO_8B),
                    ]
                )
            if r["tuned_graph_ms"] and r.get("tuned_unfused_ms"):
                ratio = r["tuned_graph_ms"] / r["tuned_unfused_ms"]
                rows.append(
                    [
                        f"{name} b{r['batch_size']} tuned / unfused",
                        ratio,
                        f"<= {SLOWER_BY}",
                        verdict(ratio <= SLOWER_BY),
                    ]
                )
    for r in found.get("accuracy", {}).get("results", []):
        ratios = r["ratios"]
        rows.append(
            [
                f"accuracy b{r['batch_size']} tuned/untuned max err",
                ratios["max_abs"],
                "<= 1",
                verdict(ratios["max_abs"] <= 1),
            ]
        )
        rows.append(
            [
                f"accuracy b{r['batch_size']} tuned/untuned mean KL",
                ratios["kl_mean"],
                "<= 1",
                verdict(ratios["kl_mean"] <= 1),
            ]
        )
    return rows  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the JSON results (required)"
    )
    parser.add_argument(
        "--parts", type=name_list(PARTS, "part"), default=",".join(PARTS), help="parts to run"
    )
    parser.add_argument(
        "--batch-sizes", type=batch_sizes, default="1,8,32,128", help="1B batch sizes"
    )
    parser.add_argument("--big-batch-sizes", type=batch_sizes, default="1,8", help="8B batch sizes")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face recipe")
    parser.add_argument(
        "--tuning-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder that keeps the tuning caches (default: none, every run tunes)",
    )
    args = parser.parse_args(argv)
    parts = args.parts
    device = bench.require_cuda_or_exit("decode_latency.py")
    gpu = bench.gpu_slug(torch.cuda.get_device_name(device))
    results = {part: args.out / f"decode-latency-{part}-{gpu}.json" for part in parts}
    for result_path in results.values():  # before the first part: exit 2 on a bad --out
        check_script_output(result_path, "--out", parser)
    if args.tuning_cache is not None:
        try:
            args.tuning_cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file in the way, no permission
            parser.error(f"--tuning-cache {args.tuning_cache}: no folder ({exc.strerror or exc})")
    missed = 0  # results that went to the temporary folder instead of --out
    tuner = AutoTuner(show_progress=False)  # the 1B tuner, shared by 1b, pdl and accuracy
    found: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for part in (p for p in PARTS if p in parts):
        started = time.perf_counter()
        print(f"== part {part}", flush=True)
        if part == "8b":
            data = part_8b(args)
        else:
            data = {"1b": part_1b, "pdl": part_pdl, "accuracy": part_accuracy}[part](args, tuner)
        seconds[part] = time.perf_counter() - started
        found[part] = data
        payload = {"provenance": bench.provenance(device=device), "part": part}
        payload.update(seconds=seconds[part], data=data)
        path = bench.write_json(results[part], payload)
        print(f"== part {part}: {seconds[part]:.0f} s", flush=True)
        missed += not report_written("--out", results[part], path)
        torch.cuda.empty_cache()
    print(f"parts took {', '.join(f'{p} {s:.0f} s' for p, s in seconds.items())}")
    rows = targets(found)
    width = max((len(r[0]) for r in rows), default=10)
    print(f"{'issue 13':{width}}  {'value':>8}  {'target':>8}  verdict")
    for what, value, target, ok in rows:
        print(f"{what:{width}}  {value:8.3f}  {target:>8}  {ok}")
    # Exit 1 when a part's result went to the temporary folder: a script finds no file in --out.
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
