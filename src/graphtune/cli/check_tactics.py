"""``graphtune check-tactics``: does every (runner, tactic) of every decode op match the fallback?

Runs one decode step of the model per batch size with an untuned tuner and records the op calls
it makes (so exactly the ops and shapes the step uses), then runs every (runner, tactic) of each
distinct call on copies of its inputs and compares outputs and in-place writes with the fallback's
(:func:`graphtune.autotuner.check_tactics`). Exit 0 when all pass, 1 when any tactic differs or
raises (or the model cannot be built), 2 on bad arguments.

``--json`` writes one object, like every result: ``provenance`` (the record of
:func:`graphtune.bench.schema.provenance`: GPU, versions, commit, command), ``config`` (the
model, batch sizes, resolved device and dtype, tolerances), ``passed`` and ``reports`` (one per
op call), through the atomic results writer (:func:`graphtune.bench.results.write_json`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from graphtune.cli._args import (
    EXIT_FAILURE,
    EXIT_OK,
    add_device_arguments,
    batch_sizes,
    check_output_path,
    non_negative_float,
    positive_int,
    report_written,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``check-tactics``."""
    parser = subparsers.add_parser(
        "check-tactics",
        help="run every (runner, tactic) of the decode-step ops and compare with the fallback",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    parser.add_argument(
        "--model", default="tiny", metavar="PRESET|PATH", help="preset or checkpoint folder"
    )
    parser.add_argument(
        "--batch",
        type=batch_sizes,
        default=(1, 8, 32),
        metavar="1,8,32",
        help="decode batch sizes (the tiled GEMM offers tactics from 17 rows)",
    )
    parser.add_argument(
        "--max-seq-len", type=positive_int, default=256, metavar="N", help="KV cache length"
    )
    add_device_arguments(parser)
    parser.add_argument(
        "--atol", type=non_negative_float, default=None, help="absolute tolerance (default 0)"
    )
    parser.add_argument(
        "--rtol",
        type=non_negative_float,
        default=None,
        help="relative tolerance (default by dtype)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the report as JSON ('-': to stdout, and the table to stderr; an existing "
        "FILE is replaced only when it is an earlier graphtune result; default: no report)",
    )
    parser.set_defaults(handler=run_check)


def _call_key(call: Any) -> str:
    from graphtune.autotuner.identity import runner_id
    from graphtune.autotuner.profiles import profile_for

    profile = profile_for(call.config, call.inputs)
    shapes = profile.describe() if profile is not None else "-"
    return json.dumps(
        [call.op, [runner_id(r) for r in call.runners], shapes, call.kwargs], default=str
    )


def check_step(
    model: str,
    batches: tuple[int, ...],
    *,
    device: str = "auto",
    dtype: str = "auto",
    max_seq_len: int = 256,
    atol: float | None = None,
    rtol: float | None = None,
) -> list[Any]:
    """:class:`~graphtune.autotuner.ConsistencyReport` of every distinct op call of one decode
    step of ``model`` at each batch size."""
    from graphtune.autotuner import AutoTuner, check_tactics
    from graphtune.cli._step_calls import decode_step_calls, resolve_device_and_dtype

    where, kind = resolve_device_and_dtype(device, dtype)
    # The step's untuned tuner: a fused op's fallback (check_tactics' reference) runs its
    # unfused ops through it, in dry-run recording so that they neither count nor warn of
    # missing picks (nothing here is meant to be tuned).
    tuner = AutoTuner(show_progress=False)
    reports, seen = [], set()
    for batch in batches:
        for call in decode_step_calls(
            model, batch, device=where, dtype=kind, max_seq_len=max_seq_len, tuner=tuner
        ):
            key = _call_key(call)
            if key in seen:
                continue
            seen.add(key)
            with tuner.record_calls(dry_run=True):
                reports.append(
                    check_tactics(
                        call.op,
                        call.runners,
                        call.config,
                        call.inputs,
                        atol=atol,
                        rtol=rtol,
                        **call.kwargs,
                    )
                )
    return reports


def _number(value: float) -> float | None:
    return value if math.isfinite(value) else None


def run_check(args: argparse.Namespace) -> int:
    """Prints one row per (op call, runner, tactic); 1 when any check failed."""
    from graphtune.autotuner.entries import tactic_text
    from graphtune.bench.results import json_safe, write_json
    from graphtune.cli._step_calls import resolve_device_and_dtype
    from graphtune.reporting import render_table

    check_output_path(args.json, "--json", result_json=True)
    where, kind = resolve_device_and_dtype(args.device, args.dtype)
    dtype = str(kind).removeprefix("torch.")
    reports = check_step(
        args.model,
        args.batch,
        device=str(where),
        dtype=dtype,
        max_seq_len=args.max_seq_len,
        atol=args.atol,
        rtol=args.rtol,
    )
    rows: list[tuple[Any, ...]] = []
    for report in reports:
        if report.reference_error is not None:
            rows.append((report.op, report.profile, "fallback", -1, None, None, "ERROR"))
        for c in report.checks:
            verdict = "ok" if c.passed else f"FAIL {c.error or ''}".strip()
            rows.append(
                (
                    report.op,
                    report.profile,
                    c.runner,
                    tactic_text(c.tactic),
                    _number(c.max_abs),
                    _number(c.max_rel),
                    verdict[:60],
                )
            )
    columns = ("op", "profile", "runner", "tactic", "max abs", "max rel", "result")
    to_stdout = args.json is not None and str(args.json) == "-"
    data = _result_json(args, where, dtype, reports)
    # Written before the table, so a reader of stdout that is gone (``| head -1``: the print
    # raises BrokenPipeError) never loses a finished report.
    written = write_json(args.json, data) if args.json is not None and not to_stdout else None
    table_stream = sys.stderr if to_stdout else sys.stdout
    title = f"tactic consistency of {args.model}"
    print(render_table(title, columns, rows, width=200), file=table_stream)
    failed = [r for r in reports if not r.passed]
    checked = sum(len(r.checks) for r in reports)
    fallback_only = sum(1 for r in reports if not r.checks)
    print(
        f"{checked} (runner, tactic) checked on {len(reports)} op calls; {len(failed)} failed; "
        f"{fallback_only} op calls offered no Triton tactic (only the fallback runs there)",
        file=table_stream,
    )
    if to_stdout:
        print(json.dumps(json_safe(data), indent=1))
    elif written is not None and not report_written("--json", args.json, written):
        return EXIT_FAILURE
    return EXIT_FAILURE if failed else EXIT_OK


def _result_json(args: argparse.Namespace, device: Any, dtype: str, reports: list) -> dict:
    """``--json``'s object: the provenance record every result carries, then the run's inputs
    and the op reports."""
    from graphtune.bench.schema import provenance

    return {
        "provenance": provenance(device=device),
        "config": {
            "model": args.model,
            "batch": list(args.batch),
            "device": str(device),
            "dtype": dtype,
            "max_seq_len": args.max_seq_len,
            "atol": args.atol,
            "rtol": args.rtol,
        },
        "passed": all(r.passed for r in reports),
        "reports": [_report_json(r) for r in reports],
    }


def _report_json(report: Any) -> dict[str, Any]:
    return {
        "op": report.op,
        "profile": report.profile,
        "passed": report.passed,
        "reference_error": report.reference_error,
        "checks": [
            {
                "runner": c.runner,
                "tactic": c.tactic,
                "max_abs": _number(c.max_abs),
                "max_rel": _number(c.max_rel),
                "passed": c.passed,
                "error": c.error,
            }
            for c in report.checks
        ],
    }
