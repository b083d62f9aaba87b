"""``graphtune tune``: tune a model's decode step for every batch bucket and save the picks.

The step is tuned by running it (``graphtune.engine.tuning.tune_step``), as ``Engine(tune=True)``
does. The model is only read for its dimensions (a preset name or a Hugging Face folder's
``config.json``); weights are random, since the kernels' speed does not depend on their values.
With ``--from-misses FILE`` it instead tunes exactly the shapes a serving process recorded as
missed (:mod:`graphtune.cli.from_misses`); ``--model`` is not needed then. The cache path is
checked (folder, lock) before anything runs; Ctrl-C keeps the picks finished so far in the cache
file. When no op has more than one candidate (a CPU: every op is its torch code), nothing is
timed and it says so.
"""

from __future__ import annotations

import argparse
import time

from graphtune.cli import from_misses
from graphtune.cli._args import (
    add_device_arguments,
    cache_file,
    check_cache_path,
    check_misses_path,
    positive_int,
    timing_timer,
)
from graphtune.cli._interrupted import interrupted_picks
from graphtune.errors import ConfigError

#: Defaults of ``--max-batch`` and ``--max-seq-len`` (the Engine's ``max_seq_len`` default).
DEFAULT_MAX_BATCH, DEFAULT_MAX_SEQ_LEN = 64, 2048


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``tune``."""
    parser = subparsers.add_parser(
        "tune",
        help="tune the decode-step ops (GEMMs, RMSNorm, RoPE+KV write, SiLU-and-mul, attention) "
        "of a model",
        description="Runs a model's decode step (random weights) at batch sizes 1, 2, 4, ... up "
        "to --max-batch in tuning mode: every op it calls times each (runner, tactic) for every "
        "batch bucket and the fastest per bucket is saved to --cache, under the keys the "
        "engine's step looks up. Entries already in the cache file are reused, not re-tuned. "
        "Decode attention is tuned for a KV cache of --max-seq-len positions (rounded up to a "
        "multiple of 16, as the Engine rounds its max_seq_len).",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="PRESET|PATH",
        help="preset (tiny, llama-1b-shape, ...) or a folder with config.json (no default: "
        "required unless --from-misses is given)",
    )
    parser.add_argument(
        "--cache",
        required=True,
        type=cache_file,
        metavar="FILE",
        help="tuning cache file, created or extended (required)",
    )
    # --max-batch, --max-seq-len and --dtype default to None, resolved in run_tune, so that
    # --from-misses can refuse them when given, even at their default values.
    parser.add_argument(
        "--max-batch",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"largest decode batch to tune (default: {DEFAULT_MAX_BATCH})",
    )
    parser.add_argument(
        "--max-seq-len",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"KV cache length of the engine that will use the cache, for attention (default: "
        f"{DEFAULT_MAX_SEQ_LEN}, the Engine's; rounded up to a multiple of 16)",
    )
    add_device_arguments(parser, dtype_unset=True)
    parser.add_argument(
        "--timing",
        default="auto",
        choices=("auto", "graph", "events", "wallclock"),
        help="timer (auto: graph replay on CUDA, wall clock on CPU)",
    )
    parser.add_argument(
        "--refine-in-step",
        action="store_true",
        help="after tuning, race each pick against its nearest rivals in the whole step and "
        "keep the fastest (CUDA; several seconds per batch bucket; see docs/engine.md)",
    )
    from_misses.add_arguments(parser)
    parser.set_defaults(handler=run_tune)


def run_tune(args: argparse.Namespace) -> int:
    """Tunes the step (or the recorded misses) and prints the picks table."""
    check_cache_path(args.cache, "--cache")
    check_misses_path(args.cache)
    if args.from_misses is not None:
        step_only = (
            ("--model", args.model is not None),
            (f"--max-batch {args.max_batch}", args.max_batch is not None),
            (f"--max-seq-len {args.max_seq_len}", args.max_seq_len is not None),
            (f"--dtype {args.dtype}", args.dtype is not None),
            ("--refine-in-step", args.refine_in_step),
        )
        given = [flag for flag, on in step_only if on]
        if given:
            raise ConfigError(
                f"--from-misses tunes the recorded calls with their own shapes and dtypes, so "
                f"{', '.join(given)} (options of a model's step) has no use with it; drop it"
            )
        return from_misses.run(args)
    if args.max_batch is None:
        args.max_batch = DEFAULT_MAX_BATCH
    if args.max_seq_len is None:
        args.max_seq_len = DEFAULT_MAX_SEQ_LEN
    if args.dtype is None:
        args.dtype = "auto"
    if args.imports:
        raise ConfigError(
            "--import names modules whose ops --from-misses rebuilds, and no --from-misses is "
            "given; add --from-misses FILE or drop --import"
        )
    if args.model is None:
        raise ConfigError("pass --model PRESET|PATH (or --from-misses FILE)")
    import torch

    from graphtune import autotuner
    from graphtune.cli._step_calls import decode_step, resolve_device_and_dtype
    from graphtune.engine.loading import load_config
    from graphtune.engine.tuning import tune_step

    device, dtype = resolve_device_and_dtype(args.device, args.dtype)
    if args.refine_in_step and device.type != "cuda":
        raise ConfigError(
            f"--refine-in-step times the whole step on the GPU, and the device is {device}: "
            "run with --device cuda, or drop it"
        )
    load_config(args.model)  # a model that cannot load fails before anything is built
    timer = timing_timer(args.timing, device)
    tuner = autotuner.AutoTuner(timer=timer)
    step = decode_step(
        args.model, args.max_batch, tuner, device=device, dtype=dtype, max_seq_len=args.max_seq_len
    )
    name = step.model.config.name
    print(
        f"tuning {name} ops on {device} ({str(dtype).removeprefix('torch.')}), "
        f"batch buckets up to {args.max_batch} -> {args.cache}",
        flush=True,
    )
    started = time.perf_counter()
    try:
        # tune=True: GRAPHTUNE_CACHE_ONLY (meant for serving) must not turn this into look-ups.
        with autotuner.autotune(args.cache, tuner, tune=True):
            report = tune_step(
                step,
                log=lambda line: print(f"  {line}", flush=True),
                refine=args.refine_in_step,
            )
    except KeyboardInterrupt:
        raise KeyboardInterrupt(interrupted_picks(tuner, args.cache)) from None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats = tuner.stats
    if _nothing_timed(tuner):
        # Saved all the same: the engine's look-ups then find a pick instead of counting misses.
        print(
            f"nothing to tune on {device}: every op of the step has a single candidate (its "
            f"torch code), so its {stats.untimed_picks} (op, bucket) picks were taken without "
            f"timing and saved to {args.cache}"
        )
        return 0
    table = tuner.summary_table(f"picks for {name} (buckets {list(report.buckets)})")
    if table:
        print(table)
    elif stats.profiles_failed:
        print(
            f"no pick was tuned: every candidate of {stats.profiles_failed} (op, bucket) "
            "profiles failed (the warnings above say why)"
        )
    else:
        print("every shape was already in the cache file; nothing to tune")
    if stats.untimed_picks:
        print(
            f"{stats.untimed_picks} of {report.profiles_tuned} picks had a single candidate on "
            f"{device} and were taken without timing"
        )
    print(
        f"done in {time.perf_counter() - started:.1f} s "
        f"({report.prepare_seconds:.1f} s recording the step and preparing "
        f"{report.prepared} tactics up front); "
        f"{report.profiles_tuned} (op, bucket) picks added to {args.cache}"
    )
    return 0


def _nothing_timed(tuner: object) -> bool:
    """Whether every profile tuned so far had one candidate (picked without timing)."""
    stats = tuner.stats  # type: ignore[attr-defined]
    return stats.untimed_picks > 0 and stats.profiles_tuned == 0 and stats.tactics_timed == 0
