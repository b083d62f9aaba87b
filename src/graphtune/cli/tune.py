"""``graphtune tune``: tune a model's decode-step ops for every batch bucket and save the picks.

The model is only read for its dimensions (a preset name or a Hugging Face folder's
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
        description="Times every (runner, tactic) of each op of a model's decode step for batch "
        "buckets 1, 2, 4, ... up to --max-batch and saves the fastest per bucket to --cache. "
        "Entries already in the cache file are reused, not re-tuned. Decode attention is tuned "
        "for a KV cache of --max-seq-len positions: pass the engine's (Engine rounds its "
        "max_seq_len up to a multiple of 16).",
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
    parser.add_argument(
        "--ops",
        default=None,
        metavar="LIST",
        help="comma-separated op groups (default all: gemm,lm_head,rms_norm,"
        "rope_kv_cache,silu_and_mul,attention)",
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
    """Tunes the ops and prints the picks table."""
    from graphtune.autotuner import AutoTuner, autotune
    from graphtune.autotuner.timing import resolve_timer
    from graphtune.engine.bench import resolve_device, resolve_dtype
    from graphtune.ops.tuning import ALL_GROUPS, OpDims, tune_ops

    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        config = _model_config(args.model)
        dims = OpDims.from_model_config(config)
        ops = tuple(args.ops.split(",")) if args.ops else ALL_GROUPS
        timer = None if args.timing == "auto" else resolve_timer(args.timing, device)
        tuner = AutoTuner(timer=timer)
        print(
            f"tuning {config.name} ops on {device} ({str(dtype).removeprefix('torch.')}), "
            f"batch buckets up to {args.max_batch} -> {args.cache}",
            flush=True,
        )
        started = time.perf_counter()
        with autotune(args.cache, tuner):
            report = tune_ops(
                dims,
                args.max_batch,
                device=device,
                dtype=dtype,
                tuner=tuner,
                ops=ops,
                max_seq_len=args.max_seq_len,
                on_op=lambda name: print(f"  {name} ...", flush=True),
            )
    except (GraphtuneError, ValueError) as exc:
        print(f"graphtune tune: {exc}", file=sys.stderr)
        return 2
    table = tuner.summary_table(f"picks for {config.name} (buckets {list(report.buckets)})")
    print(table or "every shape was already in the cache file; nothing to tune")
    print(
        f"done in {time.perf_counter() - started:.1f} s "
        f"({report.compile_seconds:.1f} s compiling Triton tactics ahead of timing); "
        f"{len(report.rows)} (op, bucket) picks added to {args.cache}"
    )
    if torch.cuda.is_available() and device.type == "cuda":
        torch.cuda.synchronize(device)
    return 0
