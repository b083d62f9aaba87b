"""``graphtune generate``: run the reference engine on a checkpoint folder or a preset."""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from graphtune.cli._parallel import (
    add_tensor_parallel_arguments,
    start_tensor_parallel,
    stop_tensor_parallel,
)
from graphtune.errors import GraphtuneError

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``generate``."""
    parser = subparsers.add_parser(
        "generate",
        help="generate tokens with the reference decode engine",
        description="Generate with a Llama/Qwen2/Mistral checkpoint folder or a preset with "
        "random weights. Without a tokenizer, prompts and outputs are token ids ('1,2,3').",
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="PATH|PRESET",
        help="Hugging Face checkpoint folder or preset (tiny, llama-1b-shape, ...)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        required=True,
        metavar="TEXT|IDS",
        help="prompt text (needs tokenizer.json) or comma-separated token ids; "
        "repeat for several prompts",
    )
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    parser.add_argument("--runner", choices=("graph", "eager"), default="graph")
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cpu, ...")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32",
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        metavar="N",
        help="KV cache length per request (default: longest prompt + N new)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="F",
        help="share (0-1] of the GPU's memory the engine may use: the KV cache gets as many "
        "slots as fit after weights, activations and graphs (prints the memory plan)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of random weights and sampling")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate N tokens")
    parser.add_argument("--stats", action="store_true", help="print the step runner's stats")
    add_tensor_parallel_arguments(parser, "generate", "only rank 0 prints")
    parser.set_defaults(handler=run_generate)


def _parse_prompt(text: str) -> str | list[int]:
    parts = [p.strip() for p in text.split(",")]
    if parts and all(p.lstrip("-").isdigit() for p in parts):
        return [int(p) for p in parts]
    return text


def run_generate(args: argparse.Namespace) -> int:
    """Loads the model, builds an Engine with the chosen runner and prints each continuation."""
    from graphtune.engine import Engine, SamplingParams, load_model
    from graphtune.engine.devices import resolve_device, resolve_dtype

    parallel = None
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        parallel, device = start_tensor_parallel(args, device)
        show = parallel is None or parallel.rank == 0
        if args.runner == "graph" and device.type != "cuda" and show:
            print(
                "note: CUDA graphs need CUDA; the graph runner falls back to eager here",
                file=sys.stderr,
            )
        model = load_model(
            args.model, device=device, dtype=dtype, seed=args.seed, parallel=parallel
        )
        prompts = [_parse_prompt(p) for p in args.prompt]
        if any(isinstance(p, str) for p in prompts) and model.tokenizer is None:
            print(
                f"error: {args.model} has no tokenizer.json; pass token ids like --prompt '1,2,3'",
                file=sys.stderr,
            )
            return 2
        lengths = [
            len(p) if isinstance(p, list) else len(model.tokenizer.encode(p).ids) for p in prompts
        ]
        max_seq = args.max_seq_len or max(lengths) + args.max_new_tokens
        engine = Engine(
            model,
            runner=args.runner,
            max_batch_size=len(prompts),
            max_seq_len=max_seq,
            capture_sizes=None,
            lazy_capture=True,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        sampling = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
        )
        t0 = time.perf_counter()
        outputs = engine.generate(
            prompts,
            args.max_new_tokens,
            sampling=sampling,
            stop_token_ids=[] if args.ignore_eos else None,
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
    except GraphtuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        stop_tensor_parallel(parallel)
        return 2
    if not show:
        engine.release()
        stop_tensor_parallel(parallel)
        return 0
    for prompt, ids in zip(args.prompt, outputs, strict=True):
        text = engine.decode(ids)
        print(f"prompt: {prompt}")
        print(f"tokens: {','.join(map(str, ids))}")
        if text is not None:
            print(f"text:   {text}")
    total = sum(len(o) for o in outputs)
    tp = f", tp {args.tp}" if parallel is not None else ""
    print(
        f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s, runner "
        f"{args.runner}, {model.config.name}, {str(dtype).replace('torch.', '')}, "
        f"{device}{tp})"
    )
    if engine.memory_plan is not None:
        print(engine.memory_plan.table())
    if args.stats and hasattr(engine.stats, "table"):
        print(engine.stats.table())
        print(engine.prefill_stats.table())
    engine.release()
    stop_tensor_parallel(parallel)
    return 0
