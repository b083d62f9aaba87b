"""``graphtune bench decode``: eager vs graph runner vs GPU-busy vs bytes floor per batch size.

stdout carries the table; JSON goes where ``--json`` says (``--json -``: stdout, and the table
then goes to stderr). Everything the run needs is checked before it starts: the device, the
model and its context length, the output paths and matplotlib for ``--plot``. Ctrl-C prints the
batch sizes that finished (and writes them to ``--json``) before exiting with 130; so does a
failure after the first measurement (a note names the phase and the error), before the error's
own line and exit 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

from graphtune.cli._args import (
    EXIT_FAILURE,
    EXIT_OK,
    add_device_arguments,
    batch_sizes,
    cache_file,
    check_distinct_outputs,
    check_output_path,
    non_negative_int,
    positive_int,
    report_written,
    seed_value,
    tuning_cache_path,
    usage,
)
from graphtune.cli._parallel import (
    add_tensor_parallel_arguments,
    start_tensor_parallel,
    stop_tensor_parallel,
)
from graphtune.errors import ConfigError, ResultsWriteError, one_line

logger = logging.getLogger(__name__)

#: ``--tune-l2`` choices and the ``DecodeBenchConfig.tune_cold_l2`` each stands for.
L2_MODES: dict[str, bool | None] = {"auto": None, "cold": True, "hot": False}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``bench decode``."""
    bench = subparsers.add_parser(
        "bench", help="benchmarks (decode step)", description="Benchmarks of the decode step."
    )
    actions = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    decode = actions.add_parser(
        "decode",
        help="time the decode step: eager, graph runner, GPU-busy, bytes floor",
        description="Times the reference engine's decode step per batch size. Without CUDA only "
        "the eager step runs (CUDA graphs need CUDA); the default model then becomes 'tiny'. "
        "stdout carries the table; JSON only where --json says.",
    )
    decode.add_argument(
        "--model",
        default=None,
        metavar="PATH|PRESET",
        help="checkpoint folder or preset (default: llama-1b-shape on CUDA, tiny otherwise)",
    )
    decode.add_argument(
        "--batch-sizes",
        type=batch_sizes,
        default=(1, 8, 32, 128),
        metavar="1,8,32,128",
        help="batch sizes to time (each is a captured graph size)",
    )
    decode.add_argument(
        "--context",
        type=non_negative_int,
        default=512,
        metavar="N",
        help="tokens already cached per request",
    )
    decode.add_argument(
        "--steps", type=positive_int, default=20, metavar="N", help="decode steps per timed repeat"
    )
    decode.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        metavar="N",
        help="timed repeats per measurement (the median is reported)",
    )
    decode.add_argument(
        "--runner",
        choices=("both", "graph", "eager"),
        default="both",
        help="which step runners to time (graph needs CUDA)",
    )
    decode.add_argument(
        "--compare-compile",
        action="store_true",
        help="also time torch.compile(mode='reduce-overhead') of the same step",
    )
    decode.add_argument(
        "--compare-hf",
        action="store_true",
        help="also run transformers' implementation of the model on the same weight tensors: "
        "its eager step and (see --hf-compile) its static cache + torch.compile recipe, with a "
        "logits check against the engine (transformers needed)",
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
        type=cache_file,
        default=None,
        metavar="FILE",
        help="with --tune: tuning cache file, loaded when present and saved "
        "(a second run tunes nothing; default: the file GRAPHTUNE_CACHE names, else none)",
    )
    decode.add_argument(
        "--tune-l2",
        choices=sorted(L2_MODES),
        default="auto",
        help="with --tune: time the GEMMs with cold-L2 rotation (cold: weights stream from "
        "HBM, as in a decode step), in place (hot), or cold exactly when the weights exceed "
        "the L2 (auto, default)",
    )
    decode.add_argument(
        "--compare-unfused",
        action="store_true",
        help="with --tune: also time the tuned step with its stages unfused (the step as tuned "
        "before the fused kernels)",
    )
    decode.add_argument(
        "--refine-in-step",
        action="store_true",
        help="with --tune: after tuning, race each pick against its nearest rivals in the "
        "whole step and keep the fastest (as graphtune tune --refine-in-step)",
    )
    decode.add_argument(
        "--tune-lead-in",
        action="store_true",
        help="with --tune, experimental: time each call right after a small PDL kernel and take "
        "that kernel's own time off (a chain of a candidate after itself overlaps under PDL "
        "unlike the step); needs PDL (compute capability >= 9.0)",
    )
    decode.add_argument(
        "--hf-compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --compare-hf: also time transformers' static cache + torch.compile("
        "mode='reduce-overhead') recipe (CUDA only); default: on for dense models, off for "
        "mixture-of-experts models (their eager step is the anchor)",
    )
    decode.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        metavar="N",
        help="quick runs: only the first N layers of a preset, labelled as such (default: every "
        "layer)",
    )
    decode.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="save a plot (matplotlib; the suffix picks the format: .png, .svg, .pdf, ...; "
        "default: no plot)",
    )
    decode.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the full result as JSON ('-': to stdout, and the table to stderr; an "
        "existing FILE is replaced only when it is an earlier graphtune result; default: no "
        "JSON)",
    )
    add_device_arguments(decode)
    decode.add_argument(
        "--seed", type=seed_value, default=0, help="seed of weights, tokens and KV data"
    )
    add_tensor_parallel_arguments(decode, "bench decode", "only rank 0 prints and writes files")
    decode.set_defaults(handler=run_bench_decode)
    bench.set_defaults(handler=lambda args: usage(bench))


def _check_before_run(args: argparse.Namespace, model: str) -> Path | None:
    """Everything that would otherwise fail after the whole benchmark ran; returns the tuning
    cache file the run uses (:func:`tuning_cache_path`; ``GRAPHTUNE_CACHE`` only with --tune)."""
    from graphtune.engine.loading import load_config

    cache = args.tuning_cache
    if args.tune or cache is not None:  # without --tune, DecodeBenchConfig refuses the flag
        cache = tuning_cache_path(cache, "--tuning-cache")
    check_output_path(args.json, "--json", result_json=True)
    check_output_path(args.plot, "--plot", results=True)
    check_distinct_outputs(("--json", args.json), ("--plot", args.plot), ("--tuning-cache", cache))
    if args.plot is not None:
        from graphtune.bench.decode_report import plot_formats

        formats = plot_formats()
        suffix = args.plot.suffix
        if not suffix:
            raise ConfigError(
                f"--plot {args.plot} has no suffix, and the suffix picks the image format "
                f"({', '.join(sorted(formats))}); give e.g. plot.png"
            )
        if suffix.lstrip(".").lower() not in formats:
            raise ConfigError(
                f"--plot {args.plot}: its suffix picks the image format, and {suffix!r} is none "
                f"of {', '.join(sorted(formats))}; give e.g. plot.png"
            )
    load_config(model).check_positions(args.context + 1, f"--context {args.context}")
    return cache


def run_bench_decode(args: argparse.Namespace) -> int:
    """Runs the benchmark, prints the table, and writes JSON and the plot when asked."""
    from graphtune.bench.decode import run_decode_bench
    from graphtune.bench.decode_results import DecodeBenchConfig
    from graphtune.engine.devices import resolve_device

    device = resolve_device(args.device)
    for flag, on in (
        ("--compare-compile", args.compare_compile),
        ("--compare-hf", args.compare_hf),
    ):
        if args.tp > 1 and on:
            raise ConfigError(
                f"{flag} is not supported with --tp > 1; drop it to time the tensor-parallel step"
            )
    model = args.model or ("llama-1b-shape" if device.type == "cuda" else "tiny")
    # The resolved file replaces the flag's value, so the config (and the JSON) records the
    # file actually used and an interrupted run names it.
    args.tuning_cache = _check_before_run(args, model)
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
        tune_cold_l2=L2_MODES[args.tune_l2],
        tp=args.tp,
        compare_hf=args.compare_hf,
        compare_unfused=args.compare_unfused,
        refine_in_step=args.refine_in_step,
        tune_lead_in=args.tune_lead_in,
        hf_compile=args.hf_compile,
        layers=args.layers,
    )
    parallel = None
    started: list[Any] = []
    try:
        parallel, device = start_tensor_parallel(args, device)
        # Every rank runs the same benchmark (same collectives, same order); rank 0 reports.
        show = parallel is None or parallel.rank == 0
        try:
            report = run_decode_bench(
                cfg,
                log=lambda line: print(line, file=sys.stderr) if show else None,
                parallel=parallel,
                command=shlex.join(["graphtune", *getattr(args, "argv", [])]),
                on_start=started.append,
                show_progress=None if show else False,
            )
        except KeyboardInterrupt:
            if not show or not started:
                raise
            kept = _report_partial(args, started[0], "interrupted (Ctrl-C)")
            raise KeyboardInterrupt(kept) from None
        except Exception:
            if not show or not started:
                raise
            # The run's note names the phase and the error; main() still reports the error
            # itself (one line, or a bug's traceback), so the measurements are only added.
            try:
                kept = _report_partial(args, started[0], "failed")
            except Exception as lost:
                kept = f"what finished could not be kept: {one_line(lost)}"
            print(f"bench decode failed: {kept}", file=sys.stderr)
            raise
        kept_all = _emit(args, report) if show else True
    finally:
        stop_tensor_parallel(parallel)
    return EXIT_OK if kept_all else EXIT_FAILURE


def _report_partial(args: argparse.Namespace, report: Any, why: str) -> str:
    """Prints and writes what an interrupted or failed run finished; says what was kept."""
    report.derive()
    done = [r.batch_size for r in report.results if r.eager_ms or r.graph_ms]
    report.notes.append(f"{why}: finished batch sizes {done}")
    # autotune() saved the picks tuned so far before the interrupt or error reached here.
    picks = f"; tuned picks so far kept in {args.tuning_cache}" if args.tuning_cache else ""
    if not done:
        return "no batch size had finished" + picks
    kept_files = _emit(args, report)
    where = (
        f" and written to {args.json}" if kept_files and args.json and str(args.json) != "-" else ""
    )
    return f"finished batch sizes {done} printed above{where}{picks}"


def _emit(args: argparse.Namespace, report: Any) -> bool:
    """The JSON file and the plot, then the table (stdout, or stderr with ``--json -``);
    ``False`` when a file went to the temporary folder instead of its path
    (:func:`report_written`). The files are written first, so a reader of stdout that is gone
    (``| head -1``: the print raises ``BrokenPipeError``) never loses a finished result."""
    from graphtune.bench.decode_report import format_report, plot_report
    from graphtune.bench.results import json_safe, write_json

    to_stdout = args.json is not None and str(args.json) == "-"
    data = report.to_json()
    written: Path | None = None
    json_error: ResultsWriteError | None = None
    if args.json is not None and not to_stdout:
        try:
            written = write_json(args.json, data)
        except ResultsWriteError as exc:
            json_error = exc  # the results go to stdout below, and the error says so
    plotted: Path | None = None
    plot_error: Exception | None = None
    if args.plot is not None:
        try:
            plotted = plot_report(report, args.plot)
        except Exception as exc:  # the table still prints; the error is raised after it
            plot_error = exc
    table_stream = sys.stderr if to_stdout else sys.stdout
    print(format_report(report), file=table_stream)
    if report.runner_stats:
        print(report.runner_stats, file=table_stream)
    if to_stdout or json_error is not None:
        print(json.dumps(json_safe(data), indent=2, default=str))
    # Every file is reported before an error is raised: one failure must not hide another.
    kept_json = written is None or report_written("--json", args.json, written)
    kept_plot = plotted is None or report_written("--plot", args.plot, plotted)
    if json_error is not None:
        if plot_error is not None:
            print(f"error: --plot {args.plot}: {one_line(plot_error)}", file=sys.stderr)
        raise ResultsWriteError(f"{json_error}; the JSON result is printed above") from None
    if plot_error is not None:
        raise plot_error
    return kept_json and kept_plot
