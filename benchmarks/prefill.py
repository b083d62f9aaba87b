#!/usr/bin/env python3
"""Time to first token: prefill through breakable CUDA graphs against eager prefill.

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/prefill.py --out benchmarks/results [--quick]

The engine's ``llama-1b-shape`` (bf16, random weights) with prompts of 16, 128 and 1024 tokens at
batch 1 and 8 (``graphtune.bench.prefill``): TTFT of ``Engine.generate(prompts, 1)`` with the
prefill runner (graphs per token-count bucket, attention as the graph break), with the same
packed prefill eagerly, and with one eager prefill per prompt (the engine before packing).

Targets (issue 15, H200): graph TTFT <= 0.5x eager prefill (one prompt at a time, as the engine
prefilled before) at 16 and 128 tokens, never slower at 1024 (against that, and within 2% noise
of the same packed call run eagerly), at both batch sizes; generated tokens equal to eager
prefill. The ratio to the packed eager call is reported beside it: at batch 8 packing alone is a
gain. Writes
``prefill-<gpu>.json`` into ``--out`` (``-<model>`` added for another model than the default,
``-quick`` with ``--quick``, ``-subset`` for other prompt lengths or batch sizes, so such a run
does not replace the full one), prints one JSON line, then the table last. A prompt length
without a target (not 16, 128 or 1024) is "n/a", listed in ``targets_not_evaluated``, and fails
``pass`` as a no-data target does in the other benchmarks. Exits 1 if ``pass`` is false, the run
could not start (one ``error:`` line) or the result could not be written to ``--out`` (it went to
the temporary folder), 2 for a malformed flag or an ``--out`` that cannot be written (checked
before the run), else 0. On the CPU the graph runner runs eagerly: only the mechanics are
exercised.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

from graphtune import bench
from graphtune.bench.prefill import PrefillBenchConfig, run_prefill_bench
from graphtune.cli._args import (
    Parser,
    add_device_arguments,
    batch_sizes,
    check_script_output,
    report_written,
)
from graphtune.errors import ConfigError, InputError

DEFAULT_MODEL, PROMPT_LENGTHS, BATCH_SIZES = "llama-1b-shape", (16, 128, 1024), (1, 8)


def prompt_lengths(text: str) -> tuple[int, ...]:
    """``argparse`` type: comma-separated prompt lengths in tokens, each an integer >= 1 given
    once (the batch-size rule of :func:`graphtune.cli._args.batch_sizes`, in its own words)."""
    try:
        return batch_sizes(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("batch size", "prompt length")) from None


def result_name(args: argparse.Namespace, slug: str) -> str:
    """``prefill-<gpu>[-<model>][-quick][-subset].json``: only the full default run has the
    plain name, so a quick or partial run never replaces it."""
    model = "" if args.model == DEFAULT_MODEL else "-" + re.sub(r"[^A-Za-z0-9.]+", "-", args.model)
    quick = "-quick" if args.quick else ""
    default = (args.prompt_lengths, args.batch_sizes) == (PROMPT_LENGTHS, BATCH_SIZES)
    return f"prefill-{slug}{model}{quick}{'' if default else '-subset'}.json"


def device_slug(device: str) -> str:
    """The result name's device part, known before the run (the ``--out`` check needs the
    name): the GPU's slug as the provenance records it, else the device type (``cpu``)."""
    import torch

    from graphtune.engine.devices import resolve_device

    resolved = resolve_device(device)
    if resolved.type == "cuda":
        return bench.gpu_slug(torch.cuda.get_device_name(resolved))
    return resolved.type


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the JSON result (required)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="preset or model folder")
    parser.add_argument(
        "--prompt-lengths",
        type=prompt_lengths,
        default=PROMPT_LENGTHS,
        metavar="N,N,...",
        help="prompt lengths in tokens",
    )
    parser.add_argument(
        "--batch-sizes", type=batch_sizes, default=BATCH_SIZES, metavar="B,B,...", help="batches"
    )
    add_device_arguments(parser, dtype=False)
    args = parser.parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv])
    try:
        target = args.out / result_name(args, device_slug(args.device))
    except ConfigError as exc:  # a device not present
        print(f"error: {exc}", file=sys.stderr)
        return 1
    check_script_output(target, "--out", parser)
    try:
        cfg = PrefillBenchConfig(
            model=args.model,
            prompt_lengths=args.prompt_lengths,
            batch_sizes=args.batch_sizes,
            repeats=4 if args.quick else 10,
            device=args.device,
        )
        report = run_prefill_bench(cfg, log=lambda line: print(line, flush=True), command=command)
    except (ConfigError, InputError) as exc:  # an unknown model, a device not present, ...
        print(f"error: {exc}", file=sys.stderr)
        return 1
    path = bench.write_json(target, report)  # target, or the fallback file it went to instead
    summary = {
        "prefill": [
            {
                k: r[k]
                for k in (
                    "batch_size",
                    "prompt_len",
                    "graph_over_per_request",
                    "graph_over_eager",
                    "passed",
                )
            }
            for r in report["results"]
        ],
        "targets_not_evaluated": report.get("targets_not_evaluated", []),
        "pass": report["pass"],
        "json": str(path),
    }
    print(json.dumps(summary))
    print(report["table"])
    # Exit 1 when the result went to the temporary folder: a script would find no file at target.
    written = report_written("--out", target, path)
    return 0 if report["pass"] and written else 1


if __name__ == "__main__":
    raise SystemExit(main())
