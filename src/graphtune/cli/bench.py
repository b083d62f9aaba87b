"""``graphtune bench decode``: eager vs graph runner vs GPU-busy vs bytes floor per batch size."""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

from graphtune.cli._parallel import (
    add_tensor_parallel_arguments,
    start_tensor_parallel,
    stop_tensor_parallel,
)
from graphtune.errors import ConfigError, GraphtuneError

logger = logging.getLogger(__name__)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return values


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``bench decode``."""
    bench = subparsers.add_parser("bench", help="benchmarks (decode step)")
    actions = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    decode = actions.add_parser(
        "decode",
        help="time the decode step: eager, graph runner, GPU-busy, bytes floor",
        description="Times the reference engine's decode step per batch size. Without CUDA only "
        "the eager step runs (CUDA graphs need CUDA); the default model then becomes 'tiny'.",
    )
    decode.add_argument(
        "--model",
        default=None,
        metavar="PATH|PRESET",
        help="checkpoint folder or preset (default: llama-1b-shape on CUDA, tiny otherwise)",
    )
    decode.add_argument(
        "--batch-sizes", type=_int_list, default=(1, 8, 32, 128), metavar="1,8,32,128"
    )
    decode.add_argument(
        "--context",
        type=int,
        default=512,
        metavar="N",
        help="tokens already cached per request (default 512)",
    )
    decode.add_argument(
        "--steps",
        type=int,
        default=20,
        metavar="N",
        help="decode steps per timed repeat (default 20)",
    )
    decode.add_argument("--repeats", type=int, default=5, metavar="N")
    decode.add_argument("--runner", choices=("both", "graph", "eager"), default="both")
    decode.add_argument(
        "--compare-compile",
        action="store_true",
        help="also time torch.compile(mode='reduce-overhead') of the same step",
    )
    decode.add_argument(
        "--compare-hf",
        action="store_true",
        help="also time Hugging Face transformers' static cache + torch.compile("
        "mode='reduce-overhead') on the same shape and weights (CUDA and transformers needed)",
    )
    decode.add_argument(
        "--tune",
        action="store_true",
        help="also tune the step's ops (GEMMs, RMSNorm, RoPE+KV write, "
        "SiLU-and-mul, attention) for the batch buckets and time the tuned step "
        "beside the untuned one",
    )
    decode.add_argument(
        "--tuning-cache",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --tune: tuning cache file, loaded when present and saved "
        "(a second run tunes nothing)",
    )
    decode.add_argument(
        "--tune-cold-l2",
        action="store_true",
        help="with --tune: time the GEMMs with cold-L2 rotation (weights stream "
        "from HBM, as in a decode step)",
    )
    decode.add_argument(
        "--compare-unfused",
        action="store_true",
        help="with --tune: also time the tuned step with its stages unfused (the step as tuned "
        "before the fused kernels)",
    )
    decode.add_argument("--plot", type=Path, default=None, metavar="FILE.png")
    decode.add_argument("--json", type=Path, default=None, metavar="FILE")
    decode.add_argument("--device", default="auto")
    decode.add_argument("--dtype", default="auto")
    decode.add_argument("--seed", type=int, default=0)
    add_tensor_parallel_arguments(decode, "bench decode", "only rank 0 prints and writes files")
    decode.set_defaults(handler=run_bench_decode)
    bench.set_defaults(handler=lambda args: _usage(bench))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def run_bench_decode(args: argparse.Namespace) -> int:
    """Runs the benchmark, prints the table, and writes JSON and the plot when asked."""
    import torch

    from graphtune.bench.decode import run_decode_bench
    from graphtune.bench.decode_report import format_report, plot_report
    from graphtune.bench.decode_results import DecodeBenchConfig
    from graphtune.bench.results import write_json
    from graphtune.engine.devices import resolve_device

    parallel = None
    try:
        device = resolve_device(args.device)
        for flag, on in (
            ("--compare-compile", args.compare_compile),
            ("--compare-hf", args.compare_hf),
        ):
            if args.tp > 1 and on:
                raise ConfigError(
                    f"{flag} is not supported with --tp > 1; drop it to time the "
                    "tensor-parallel step"
                )
        parallel, device = start_tensor_parallel(args, device)
        # Every rank runs the same benchmark (same collectives, same order); rank 0 reports.
        show = parallel is None or parallel.rank == 0
        model = args.model or ("llama-1b-shape" if device.type == "cuda" else "tiny")
        if device.type != "cuda" and show:
            print(
                "note: CUDA is not available; CUDA graphs need CUDA, so only the eager step "
                f"is timed (model {model}).",
                file=sys.stderr,
            )
        runners = ("eager", "graph") if args.runner == "both" else (args.runner,)
        cfg = DecodeBenchConfig(
            model=model,
            batch_sizes=tuple(args.batch_sizes),
            context=args.context,
            steps=args.steps,
            repeats=args.repeats,
            runners=runners,
            compare_compile=args.compare_compile,
            device=str(device),
            dtype=args.dtype,
            seed=args.seed,
            tune=args.tune,
            tuning_cache=str(args.tuning_cache) if args.tuning_cache else None,
            tune_cold_l2=args.tune_cold_l2,
            tp=args.tp,
            compare_hf=args.compare_hf,
            compare_unfused=args.compare_unfused,
        )
        report = run_decode_bench(
            cfg,
            log=lambda line: print(line, file=sys.stderr) if show else None,
            parallel=parallel,
            command=shlex.join(["graphtune", *getattr(args, "argv", [])]),
        )
        if not show:
            return 0
        print(format_report(report))
        if report.runner_stats:
            print(report.runner_stats)
        data = report.to_json()
        if args.json:
            print(f"wrote {write_json(args.json, data)}")
        if args.plot:
            try:
                plot_report(report, str(args.plot))
                print(f"wrote {args.plot}")
            except ConfigError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
        # One JSON line at the end, like every benchmark script in this repository.
        summary = {
            "bench": "decode",
            "model": report.model["name"],
            "device": report.provenance.get("gpu") or str(device),
            "torch": torch.__version__,
            "tp": args.tp,
            "results": [
                {k: v for k, v in r.items() if not k.endswith(("top_kernels", "kernel_families"))}
                for r in data["results"]
            ],
        }
        if report.model.get("all_reduce"):
            summary["all_reduce"] = report.model["all_reduce"]
        if report.tuning_rank_agreement is not None:
            summary["tuning_rank_agreement"] = report.tuning_rank_agreement
        if report.tuning_seconds is not None:
            summary["tuning_seconds"] = report.tuning_seconds
            summary["tuning_fallbacks"] = report.tuning_fallbacks
        print(json.dumps(summary, default=str))
    except GraphtuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        stop_tensor_parallel(parallel)
    return 0
