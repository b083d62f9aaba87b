"""``graphtune tune``: tune a model's decode step for every batch bucket and save the picks.

The step is tuned by running it (``graphtune.engine.tuning.tune_step``), as ``Engine(tune=True)``
does. The model is only read for its dimensions (a preset name or a Hugging Face folder's
``config.json``); weights are random, since the kernels' speed does not depend on their values.
The cache path is checked (folder, lock) before anything runs; Ctrl-C keeps the picks finished so
far in the cache file.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from graphtune.cli._args import add_device_arguments, check_output_path, positive_int


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
        required=True,
        metavar="PRESET|PATH",
        help="preset (tiny, llama-1b-shape, ...) or a folder with config.json (required)",
    )
    parser.add_argument(
        "--cache",
        required=True,
        type=Path,
        metavar="FILE",
        help="tuning cache file, created or extended (required)",
    )
    parser.add_argument(
        "--max-batch",
        type=positive_int,
        default=64,
        metavar="N",
        help="largest decode batch to tune",
    )
    parser.add_argument(
        "--max-seq-len",
        type=positive_int,
        default=2048,
        metavar="N",
        help="KV cache length of the engine that will use the cache, for attention (the Engine "
        "default; rounded up to a multiple of 16)",
    )
    add_device_arguments(parser)
    parser.add_argument(
        "--timing",
        default="auto",
        choices=("auto", "graph", "events", "wallclock"),
        help="timer (auto: graph replay on CUDA, wall clock on CPU)",
    )
    parser.set_defaults(handler=run_tune)


def run_tune(args: argparse.Namespace) -> int:
    """Tunes the step and prints the picks table."""
    import torch

    from graphtune import autotuner
    from graphtune.autotuner.persist import check_lockable
    from graphtune.autotuner.timing import resolve_timer
    from graphtune.engine.build import build_step
    from graphtune.engine.devices import resolve_device, resolve_dtype
    from graphtune.engine.kv_cache import KVCache, aligned_seq_len
    from graphtune.engine.loading import resolve_config
    from graphtune.engine.model import random_model
    from graphtune.engine.tuning import tune_step

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    check_output_path(args.cache, "--cache")
    check_lockable(args.cache)
    config = resolve_config(args.model)
    max_seq = aligned_seq_len(args.max_seq_len)
    timer = None if args.timing == "auto" else resolve_timer(args.timing, device)
    tuner = autotuner.AutoTuner(timer=timer)
    model = random_model(config, device=device, dtype=dtype)
    cache = KVCache(config, args.max_batch, max_seq, device, dtype)
    step = build_step(model, cache, tuner=tuner)
    print(
        f"tuning {config.name} ops on {device} ({str(dtype).removeprefix('torch.')}), "
        f"batch buckets up to {args.max_batch} -> {args.cache}",
        flush=True,
    )
    started = time.perf_counter()
    try:
        with autotuner.autotune(args.cache, tuner):
            report = tune_step(step, log=lambda line: print(f"  {line}", flush=True))
    except KeyboardInterrupt:
        # autotune() saved the picks finished so far before the interrupt reached here.
        kept = len(tuner.cache)
        raise KeyboardInterrupt(
            f"{kept} finished picks kept in {args.cache}" if kept else "nothing was tuned yet"
        ) from None
    table = tuner.summary_table(f"picks for {config.name} (buckets {list(report.buckets)})")
    print(table or "every shape was already in the cache file; nothing to tune")
    print(
        f"done in {time.perf_counter() - started:.1f} s "
        f"({report.compile_seconds:.1f} s compiling Triton tactics ahead of timing); "
        f"{report.profiles_tuned} (op, bucket) picks added to {args.cache}"
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 0
