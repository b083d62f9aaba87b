"""``graphtune generate``: run the reference engine on a checkpoint folder or a preset.

The request is checked before any weight is read: the device, the prompts (text needs the
checkpoint's tokenizer; ids go through ``--prompt-ids``), the one sequence-length rule (the
prompt and all but the last new token within ``max_position_embeddings`` and within
``--max-seq-len``), and that ``--top-k`` / ``--top-p`` come with a positive ``--temperature``.

With a tuning cache the engine is sized the way ``graphtune tune`` tunes, so that its look-ups
land on tuned keys: the batch (``max_batch_size``, the ops' largest bucket) is the prompt count
rounded up to a power of two, and the KV cache length defaults to ``tune``'s ``--max-seq-len``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphtune.cli._args import (
    add_device_arguments,
    cache_file,
    kv_cache_length,
    lookup_cache_path,
    non_negative_float,
    non_negative_int,
    positive_int,
    seed_value,
    usage_error,
)
from graphtune.cli._parallel import (
    add_tensor_parallel_arguments,
    start_tensor_parallel,
    stop_tensor_parallel,
)
from graphtune.cli.tune import DEFAULT_MAX_SEQ_LEN
from graphtune.errors import ConfigError, NumericalError
from graphtune.integer_text import parse_integer

if TYPE_CHECKING:  # it imports rich, which the command's parser does not need
    from graphtune.cli._generate_progress import RequestProgress

logger = logging.getLogger(__name__)


def token_ids(text: str) -> list[int]:
    """``argparse`` type of ``--prompt-ids``: comma-separated non-negative integers (each under
    :func:`~graphtune.integer_text.parse_integer`'s rule, as every integer flag)."""
    try:
        ids = [parse_integer(part) for part in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids like 1,2,3, got {text!r}"
        )
    return ids


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``generate``."""
    parser = subparsers.add_parser(
        "generate",
        help="generate tokens with the reference decode engine",
        description="Generate with a Llama/Qwen2/Mistral/Qwen3/Qwen3-MoE/Mixtral checkpoint "
        "folder or a preset with random weights. --prompt is text (it needs the checkpoint's "
        "tokenizer.json); --prompt-ids takes token ids. Repeat either for a batch of prompts.",
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="PATH|PRESET",
        help="Hugging Face checkpoint folder or preset (tiny, llama-1b-shape, ...) (required)",
    )
    parser.add_argument(
        "--prompt",
        dest="prompts",
        action="append",
        metavar="TEXT",
        help="prompt text, encoded with the checkpoint's tokenizer; repeat for several prompts "
        "(no default: give --prompt or --prompt-ids)",
    )
    parser.add_argument(
        "--prompt-ids",
        dest="prompts",
        action="append",
        type=token_ids,
        metavar="IDS",
        help="prompt as comma-separated token ids (1,2,3); repeat for several prompts (no default)",
    )
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=32, metavar="N", help="tokens to generate"
    )
    parser.add_argument(
        "--runner",
        choices=("graph", "eager"),
        default="graph",
        help="decode step runner (graph: CUDA graphs, eager without CUDA)",
    )
    add_device_arguments(parser)
    parser.add_argument(
        "--max-seq-len",
        type=kv_cache_length,
        default=None,
        metavar="N",
        help="KV cache length per request, at least 2 (default: longest prompt + "
        "--max-new-tokens - 1, the last new token not being cached; with a tuning cache, "
        "`graphtune tune`'s default "
        f"{DEFAULT_MAX_SEQ_LEN} when that fits, so attention finds its picks)",
    )
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument(
        "--top-k",
        type=non_negative_int,
        default=0,
        help="keep the k likeliest tokens (0: all; needs --temperature > 0)",
    )
    parser.add_argument(
        "--top-p",
        type=_probability,
        default=1.0,
        help="nucleus sampling mass (1: all; needs --temperature > 0)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=_probability,
        default=None,
        metavar="F",
        help="share (0-1] of the GPU's memory the engine may use: the KV cache gets as many "
        "slots as fit after weights, activations and graphs, and the memory plan is printed "
        "(default: not planned, one slot per prompt)",
    )
    parser.add_argument(
        "--seed", type=seed_value, default=0, help="seed of random weights and sampling"
    )
    parser.add_argument(
        "--tuning-cache",
        type=cache_file,
        default=None,
        metavar="FILE",
        help="tuning cache the decode step looks its picks up in (written by `graphtune tune` "
        "for the same model, dtype and --max-seq-len, with --max-batch at least the prompt "
        "count rounded up to a power of two; nothing is tuned); a shape it lacks runs "
        "the torch fallback and is recorded in the file GRAPHTUNE_MISSES names, if set "
        "(default: the file GRAPHTUNE_CACHE names, else none: the untuned torch step)",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="always generate N tokens")
    parser.add_argument(
        "--stats",
        action="store_true",
        help="print the step runner's stats (and, with a tuning cache, its look-ups)",
    )
    add_tensor_parallel_arguments(parser, "generate", "only rank 0 prints")
    parser.set_defaults(handler=run_generate)


def _encode(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    """Token ids of every prompt, in the order given."""
    if not args.prompts:
        raise ConfigError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    encoded = []
    for prompt in args.prompts:
        if isinstance(prompt, list):
            encoded.append(prompt)
        elif tokenizer is None:
            raise ConfigError(
                f"{args.model} has no tokenizer.json, so --prompt {prompt!r} cannot be encoded; "
                "pass token ids with --prompt-ids 1,2,3"
            )
        else:
            encoded.append(list(tokenizer.encode(prompt).ids))
    return encoded


def check_lengths(
    args: argparse.Namespace, config: Any, prompts: list[list[int]], tuned: bool = False
) -> int:
    """Checks every prompt against the sequence-length rule; returns the KV cache length.
    ``tuned``: the step looks picks up in a tuning cache (see :func:`_default_seq_len`)."""
    from graphtune.engine.config import request_positions

    for index, ids in enumerate(prompts):
        if not ids:
            raise ConfigError(f"prompt {index} is empty (0 tokens); give at least one token")
        bad = [t for t in ids if not 0 <= t < config.vocab_size]
        if bad:
            raise ConfigError(
                f"prompt {index} has token ids outside [0, {config.vocab_size}) of "
                f"{config.name}: {bad[:5]}"
            )
        config.check_positions(
            request_positions(len(ids), args.max_new_tokens),
            f"prompt {index} ({len(ids)} tokens) with --max-new-tokens {args.max_new_tokens}",
        )
    needed = request_positions(max(len(ids) for ids in prompts), args.max_new_tokens)
    if args.max_seq_len is None:
        return _default_seq_len(config, needed, tuned)
    if args.max_seq_len < needed:
        raise ConfigError(
            f"--max-seq-len {args.max_seq_len} is too small: the longest prompt and "
            f"--max-new-tokens {args.max_new_tokens} need {needed} positions (the last new "
            "token is not cached); raise --max-seq-len or leave it out"
        )
    config.check_positions(args.max_seq_len, f"--max-seq-len {args.max_seq_len}")
    return args.max_seq_len


def _default_seq_len(config: Any, needed: int, tuned: bool) -> int:
    """The KV cache length without ``--max-seq-len``: what the prompts need, but with a tuning
    cache ``tune``'s default length when it fits, since decode attention's picks are keyed by the
    KV cache length and ``tune`` without ``--max-seq-len`` tuned that one (a shorter cache would
    miss every attention pick)."""
    from graphtune.engine.arguments import MIN_SEQ_LEN

    own = max(needed, MIN_SEQ_LEN)
    if not tuned:
        return own
    if needed <= DEFAULT_MAX_SEQ_LEN <= config.max_position_embeddings:
        return DEFAULT_MAX_SEQ_LEN
    logger.warning(
        "the KV cache holds %d positions, not `graphtune tune`'s default %d (%s), so decode "
        "attention finds only picks tuned with --max-seq-len %d; pass the --max-seq-len the "
        "tuning cache was tuned for",
        own,
        DEFAULT_MAX_SEQ_LEN,
        "the prompts need more"
        if needed > DEFAULT_MAX_SEQ_LEN
        else f"past {config.name}'s max_position_embeddings={config.max_position_embeddings}",
        own,
    )
    return own


def engine_batch_size(prompts: int, tuned: bool) -> int:
    """``max_batch_size`` of the engine: one KV slot per prompt, but with a tuning cache the
    prompt count rounded up to a power of two. An op's batch buckets are ``1, 2, 4, ...`` plus
    ``max_batch_size`` itself (``power_of_two_buckets``), so 3 prompts in an engine of 3 look
    up bucket 3, which ``tune`` (buckets ``1, 2, 4, ..., --max-batch``) never tuned; in an
    engine of 4 they look up bucket 2. A request's sampling noise does not depend on
    ``max_batch_size``, so its tokens stay the same."""
    from graphtune.autotuner.config import next_power_of_two

    return next_power_of_two(prompts) if tuned else prompts


def check_sampling_flags(args: argparse.Namespace) -> None:
    """Refuses, in the flags' words, the combinations :class:`~graphtune.engine.SamplingParams`
    refuses (:func:`~graphtune.engine.sampling.sampling_conflict`: ``--top-k`` / ``--top-p`` at
    ``--temperature 0``, a temperature too small for float32). The parser's types already
    refused negative, non-finite and out-of-range values.

    Raises:
        SystemExit: 2, after one ``error:`` line.
    """
    from graphtune.engine.sampling import sampling_conflict

    def flag(name: str, value: object) -> str:
        spelled = "--" + name.replace("_", "-")
        return spelled if value is None else f"{spelled} {value!r}"

    conflict = sampling_conflict(args.temperature, args.top_k, args.top_p, flag)
    if conflict is not None:
        usage_error("graphtune generate", conflict)


def run_generate(args: argparse.Namespace) -> int:
    """Loads the model, builds an Engine with the chosen runner and prints each continuation."""
    import torch

    from graphtune.cli._generate_progress import RequestProgress
    from graphtune.engine import Engine, SamplingParams, load_model
    from graphtune.engine.devices import resolve_device, resolve_dtype
    from graphtune.engine.loading import load_config, load_tokenizer
    from graphtune.reporting import progress

    check_sampling_flags(args)  # before any work, in the flags' words (exit 2)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    # check_sampling_flags refused what SamplingParams would (in its field names, exit 1).
    sampling = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    config = load_config(args.model)
    folder = Path(args.model).expanduser()
    tokenizer = load_tokenizer(folder) if folder.is_dir() else None
    prompts = _encode(args, tokenizer)
    tuning_cache = lookup_cache_path(args.tuning_cache, "--tuning-cache")
    max_seq = check_lengths(args, config, prompts, tuned=tuning_cache is not None)
    if args.gpu_memory_utilization is not None and device.type != "cuda":
        raise ConfigError(
            "--gpu-memory-utilization sizes the KV cache from free GPU memory, and the device is "
            f"{device}; drop it there (the cache then holds what the prompts need)"
        )
    parallel = None
    misses_saved = True
    try:
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
        engine = Engine(
            model,
            runner=args.runner,
            max_batch_size=engine_batch_size(len(prompts), tuning_cache is not None),
            max_seq_len=max_seq,
            capture_sizes=None,
            lazy_capture=True,
            gpu_memory_utilization=args.gpu_memory_utilization,
            tuning_cache=tuning_cache,  # look-ups only: without tune=True nothing is tuned
        )
        follow = RequestProgress(len(prompts), args.max_new_tokens)
        t0 = time.perf_counter()
        try:
            # Progress on rank 0 only, as it prints; the other ranks' hooks only count.
            with progress(follow.label(), follow.total, enabled=None if show else False) as task:
                follow.task = task
                outputs = engine.generate(
                    prompts,
                    args.max_new_tokens,
                    sampling=sampling,
                    stop_token_ids=[] if args.ignore_eos else None,
                    on_tokens=follow,
                )
        except KeyboardInterrupt:
            if not show:
                raise
            elapsed = time.perf_counter() - t0
            summary = _summary(args, engine, follow.generated, elapsed, parallel, device, dtype)
            kept = _print_interrupted(args, engine, follow, summary)
            _save_misses(engine)  # what the finished steps missed is kept too
            raise KeyboardInterrupt(kept) from None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        if show:
            total = sum(len(o) for o in outputs)
            summary = _summary(args, engine, total, elapsed, parallel, device, dtype)
            _print_outputs(args, engine, outputs, summary)
            misses_saved = _save_misses(engine)
        failures = list(engine.failures)
        engine.release()
    finally:
        stop_tensor_parallel(parallel)
    if failures:
        first = failures[0]
        raise NumericalError(
            f"{len(failures)} of {len(prompts)} requests stopped early (their tokens until then "
            f"are printed above); request {first.index}: {first.reason}"
        )
    return 0 if misses_saved else 1


def _print_requests(engine: Any, requests: list[tuple[Any, list[int]]]) -> None:
    """Each request's prompt (as given), tokens and, with a tokenizer, text."""
    for prompt, ids in requests:
        text = engine.decode(ids)
        shown = prompt if isinstance(prompt, str) else ",".join(map(str, prompt))
        print(f"prompt: {shown}")
        print(f"tokens: {','.join(map(str, ids))}")
        if text is not None:
            print(f"text:   {text}")


def _summary(
    args: argparse.Namespace,
    engine: Any,
    tokens: int,
    elapsed: float,
    parallel: Any,
    device: Any,
    dtype: Any,
) -> str:
    """The run's line: ``tokens`` in ``elapsed`` seconds, the runner, model, dtype and device."""
    tp = f", tp {args.tp}" if parallel is not None else ""
    return (
        f"{tokens} tokens in {elapsed:.2f} s ({tokens / max(elapsed, 1e-9):.1f} tokens/s, "
        f"{runner_summary(args.runner, engine.stats)}, {engine.config.name}, "
        f"{str(dtype).replace('torch.', '')}, "
        f"{device}{tp})"
    )


def _print_interrupted(
    args: argparse.Namespace, engine: Any, follow: RequestProgress, summary: str
) -> str:
    """Prints what an interrupted run finished as a run prints its requests (in prompt order,
    the unfinished left out), its summary line (every token generated, finished or not) and a
    line saying it was interrupted; returns what was kept, for the interrupt's message."""
    done, total = sorted(follow.finished), len(args.prompts)
    _print_requests(engine, [(args.prompts[i], follow.finished[i]) for i in done])
    print(summary)
    # On stdout too: a reader of the output alone must not take it for every request's.
    print(f"interrupted: {total - len(done)} of {total} requests did not finish (not shown)")
    if not done:
        return f"no request had finished (of {total})"
    return f"{len(done)} of {total} requests finished and are printed above"


def _print_outputs(
    args: argparse.Namespace, engine: Any, outputs: list[list[int]], summary: str
) -> None:
    _print_requests(engine, list(zip(args.prompts, outputs, strict=True)))
    print(summary)
    if engine.memory_plan is not None:
        print(engine.memory_plan.table())
    if args.stats and hasattr(engine.stats, "table"):
        print(engine.stats.table())
        print(engine.prefill_stats.table())
    if args.stats and engine.tuner is not None:
        print(engine.tuning_report())


def runner_summary(requested: str, stats: Any) -> str:
    """The runner for the summary line, as it ran: ``runner eager``, ``runner graph`` when every
    decode step replayed a graph, else what ran eagerly and why, from the runner's ``stats``
    (:class:`~graphtune.graphs.stats.RunnerStats`): ``runner graph (eager here: no CUDA)``
    when no step replayed, ``runner graph (2 of 9 steps eager: batch too large)`` otherwise."""
    eager = getattr(stats, "eager_calls", 0)
    if requested != "graph" or not eager:
        return f"runner {requested}"
    fallbacks = sorted(getattr(stats, "fallbacks", {}).items(), key=lambda item: -item[1])
    why = ", ".join(str(getattr(reason, "value", reason)) for reason, _ in fallbacks) or "eager"
    replays = getattr(stats, "replays", 0)
    if not replays:
        return f"runner graph (eager here: {why})"
    return f"runner graph ({eager} of {eager + replays} steps eager: {why})"


def _save_misses(engine: Any) -> bool:
    """Adds the shapes the step missed in its tuning cache to the file ``GRAPHTUNE_MISSES``
    names (for ``graphtune tune --from-misses``), as ``autotune()`` does; rank 0 only. Returns
    ``False`` when they could not be written there (the message says where they went instead:
    the command then exits 1, as for any output that went elsewhere)."""
    from graphtune import env
    from graphtune.errors import CacheFileError

    path = env.default_misses_path()
    if engine.tuner is None or path is None or not len(engine.tuner.misses):
        return True
    try:
        engine.tuner.misses.save(path)
    except CacheFileError as exc:  # the tokens are printed: say where the misses went
        print(
            f"error: could not record the missed shapes (GRAPHTUNE_MISSES): {exc}", file=sys.stderr
        )
        return False
    print(
        f"{len(engine.tuner.misses)} shapes missed in the tuning cache, recorded in {path} "
        "(GRAPHTUNE_MISSES; `graphtune tune --from-misses` tunes them)",
        file=sys.stderr,
    )
    return True
