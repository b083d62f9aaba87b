"""``graphtune tune``: tune a model's decode step for every batch bucket and save the picks.

The step is tuned by running it (``graphtune.engine.tuning.tune_step``), as ``Engine(tune=True)``
does. The model is only read for its dimensions (a preset name or a Hugging Face folder's
``config.json``); weights are random, since the kernels' speed does not depend on their values.
With ``--from-misses FILE`` it instead tunes exactly the shapes a serving process recorded as
missed (:mod:`graphtune.cli.from_misses`); ``--model`` is not needed then.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from graphtune.cli import from_misses
from graphtune.errors import GraphtuneError


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
        help="preset (tiny, llama-1b-shape, ...) or a folder with config.json (required unless "
        "--from-misses is given)",
    )
    parser.add_argument(
        "--cache",
        required=True,
        type=Path,
        metavar="FILE",
        help="tuning cache file (created or extended)",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=64,
        metavar="N",
        help="largest decode batch to tune (default 64)",
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=2048,
        metavar="N",
        help="KV cache length of the engine that will use the cache, for "
        "attention (default 2048, the Engine default; a multiple of 16)",
    )
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cpu, ...")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32",
    )
    parser.add_argument(
        "--timing",
        default="auto",
        choices=("auto", "graph", "events", "wallclock"),
        help="timer (auto: graph replay on CUDA, wall clock on CPU)",
    )
    from_misses.add_arguments(parser)
    parser.set_defaults(handler=run_tune)


def run_tune(args: argparse.Namespace) -> int:
    """Tunes the step (or the recorded misses) and prints the picks table."""
    if args.from_misses is not None:
        return from_misses.run(args)
    from graphtune.autotuner import AutoTuner, autotune
    from graphtune.autotuner.timing import resolve_timer
    from graphtune.cli._step_calls import decode_step, resolve_device_and_dtype
    from graphtune.engine.tuning import tune_step
    from graphtune.errors import ConfigError

    try:
        if args.model is None:
            raise ConfigError("pass --model PRESET|PATH (or --from-misses FILE)")
        if args.max_batch < 1:
            raise ConfigError(f"--max-batch must be >= 1, got {args.max_batch}")
        device, dtype = resolve_device_and_dtype(args.device, args.dtype)
        timer = None if args.timing == "auto" else resolve_timer(args.timing, device)
        tuner = AutoTuner(timer=timer)
        step = decode_step(
            args.model,
            args.max_batch,
            tuner,
            device=device,
            dtype=dtype,
            max_seq_len=args.max_seq_len,
        )
        name = step.model.config.name
        print(
            f"tuning {name} ops on {device} ({str(dtype).removeprefix('torch.')}), "
            f"batch buckets up to {args.max_batch} -> {args.cache}",
            flush=True,
        )
        started = time.perf_counter()
        with autotune(args.cache, tuner):
            report = tune_step(step, log=lambda line: print(f"  {line}", flush=True))
    except (GraphtuneError, ValueError) as exc:
        print(f"graphtune tune: {exc}", file=sys.stderr)
        return 2
    table = tuner.summary_table(f"picks for {name} (buckets {list(report.buckets)})")
    print(table or "every shape was already in the cache file; nothing to tune")
    print(
        f"done in {time.perf_counter() - started:.1f} s "
        f"({report.prepare_seconds:.1f} s recording the step and compiling "
        f"{report.prepared} Triton tactics up front); "
        f"{report.profiles_tuned} (op, bucket) picks added to {args.cache}"
    )
    if torch.cuda.is_available() and device.type == "cuda":
        torch.cuda.synchronize(device)
    return 0
