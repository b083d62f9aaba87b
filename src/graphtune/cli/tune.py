"""``graphtune tune``: tune a model's decode step for every batch bucket and save the picks.

The step is tuned by running it (``graphtune.engine.tuning.tune_step``), as ``Engine(tune=True)``
does. The model is only read for its dimensions (a preset name or a Hugging Face folder's
``config.json``); weights are random, since the kernels' speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

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
        required=True,
        metavar="PRESET|PATH",
        help="preset (tiny, llama-1b-shape, ...) or a folder with config.json",
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
    parser.set_defaults(handler=run_tune)


def _model_config(spec: str):  # -> graphtune.engine.config.ModelConfig
    from graphtune.engine.config import from_hf_config, get_preset
    from graphtune.errors import ConfigError

    path = Path(spec).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"{path} has no config.json; pass a Hugging Face model folder.")
        return from_hf_config(json.loads(config_file.read_text()), name=path.name)
    return get_preset(spec)


def run_tune(args: argparse.Namespace) -> int:
    """Tunes the step and prints the picks table."""
    from graphtune.autotuner import AutoTuner, autotune
    from graphtune.autotuner.timing import resolve_timer
    from graphtune.engine.build import build_step
    from graphtune.engine.devices import resolve_device, resolve_dtype
    from graphtune.engine.kv_cache import KVCache, aligned_seq_len
    from graphtune.engine.model import random_model
    from graphtune.engine.tuning import tune_step
    from graphtune.errors import ConfigError

    try:
        if args.max_batch < 1:
            raise ConfigError(f"--max-batch must be >= 1, got {args.max_batch}")
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        config = _model_config(args.model)
        timer = None if args.timing == "auto" else resolve_timer(args.timing, device)
        tuner = AutoTuner(timer=timer)
        model = random_model(config, device=device, dtype=dtype)
        cache = KVCache(config, args.max_batch, aligned_seq_len(args.max_seq_len), device, dtype)
        step = build_step(model, cache, tuner=tuner)
        print(
            f"tuning {config.name} ops on {device} ({str(dtype).removeprefix('torch.')}), "
            f"batch buckets up to {args.max_batch} -> {args.cache}",
            flush=True,
        )
        started = time.perf_counter()
        with autotune(args.cache, tuner):
            report = tune_step(step, log=lambda line: print(f"  {line}", flush=True))
    except (GraphtuneError, ValueError) as exc:
        print(f"graphtune tune: {exc}", file=sys.stderr)
        return 2
    table = tuner.summary_table(f"picks for {config.name} (buckets {list(report.buckets)})")
    print(table or "every shape was already in the cache file; nothing to tune")
    print(
        f"done in {time.perf_counter() - started:.1f} s "
        f"({report.compile_seconds:.1f} s compiling Triton tactics ahead of timing); "
        f"{report.profiles_tuned} (op, bucket) picks added to {args.cache}"
    )
    if torch.cuda.is_available() and device.type == "cuda":
        torch.cuda.synchronize(device)
    return 0
