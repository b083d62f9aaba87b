"""``graphtune check-tactics``: does every (runner, tactic) of every decode op match the fallback?

Runs one decode step of the model per batch size with an untuned tuner and records the op calls
it makes (so exactly the ops and shapes the step uses), then runs every (runner, tactic) of each
distinct call on copies of its inputs and compares outputs and in-place writes with the fallback's
(:func:`graphtune.autotuner.check_tactics`). Exit 0 when all pass, 1 when any tactic differs or
raises (or the model cannot be built), 2 on bad arguments. Ctrl-C prints the table of the op
calls checked so far (and writes them to ``--json``, with a note naming the batch sizes that
finished) before exiting with 130. A line on stderr names each batch size and op call as it is
checked (``GRAPHTUNE_NO_PROGRESS=1`` hides them, as it hides the other commands' progress bars).

``--json`` writes one object, like every result: ``provenance`` (the record of
:func:`graphtune.bench.schema.provenance`: GPU, versions, commit, command), ``config`` (the
model, batch sizes, resolved device and dtype, tolerances), ``passed`` and ``reports`` (one per
op call), through the atomic results writer (:func:`graphtune.bench.results.write_json`); a run
stopped early (Ctrl-C, or a batch refused because its checks would not fit in the host's memory:
:func:`graphtune.cli._step_calls.check_calls_fit`) writes the reports it finished with
``notes`` saying which batch sizes they cover, and ``passed`` false.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphtune import env
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
from graphtune.errors import GraphtuneError, one_line

logger = logging.getLogger(__name__)


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


@dataclass
class CheckRun:
    """What :func:`check_step` has finished so far, filled as it goes: an interrupted run (its
    caller catches the ``KeyboardInterrupt``) still has the reports it gathered."""

    #: One :class:`~graphtune.autotuner.ConsistencyReport` per distinct op call checked.
    reports: list[Any] = field(default_factory=list)
    #: The batch sizes whose op calls were all checked.
    finished: list[int] = field(default_factory=list)


def check_step(
    model: str,
    batches: tuple[int, ...],
    *,
    device: str = "auto",
    dtype: str = "auto",
    max_seq_len: int = 256,
    atol: float | None = None,
    rtol: float | None = None,
    run: CheckRun | None = None,
    log: Callable[[str], None] = logger.info,
    available_memory: Callable[[], int | None] | None = None,
) -> list[Any]:
    """:class:`~graphtune.autotuner.ConsistencyReport` of every distinct op call of one decode
    step of ``model`` at each batch size.

    ``run`` (a new one by default) receives each report as soon as it is made, so a caller that
    catches an interrupt keeps what finished; the list returned is ``run.reports``. ``log``
    gets a line as each batch's step is recorded and as each op call's check starts.
    ``available_memory`` (bytes of host memory free now; default
    :func:`graphtune.engine.kv_cache.available_host_memory`) decides whether a batch's checks
    fit (:func:`graphtune.cli._step_calls.check_calls_fit`).

    Raises:
        ConfigError: A batch's checks need more host memory than is available (before they
            start; the reports of the batches before it are in ``run``).
    """
    from graphtune.autotuner import AutoTuner, check_tactics
    from graphtune.cli._step_calls import (
        check_calls_fit,
        decode_step_calls,
        resolve_device_and_dtype,
    )

    run = CheckRun() if run is None else run
    where, kind = resolve_device_and_dtype(device, dtype)
    # The step's untuned tuner: a fused op's fallback (check_tactics' reference) runs its
    # unfused ops through it, in dry-run recording so that they neither count nor warn of
    # missing picks (nothing here is meant to be tuned).
    tuner = AutoTuner(show_progress=False)
    seen: set[str] = set()
    for batch in batches:
        log(f"checking batch {batch}: running one decode step to record its op calls")
        calls = []
        for call in decode_step_calls(
            model, batch, device=where, dtype=kind, max_seq_len=max_seq_len, tuner=tuner
        ):
            key = _call_key(call)
            if key not in seen:
                seen.add(key)
                calls.append(call)
        check_calls_fit(
            calls, batch=batch, max_seq_len=max_seq_len, device=where, available=available_memory
        )
        for i, call in enumerate(calls, 1):
            # Before the check, so that a slow or stuck one is named while it runs.
            log(
                f"checking batch {batch}: op {call.op}, {len(call.runners)} runners "
                f"(op call {i} of {len(calls)})"
            )
            with tuner.record_calls(dry_run=True):
                run.reports.append(
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
        run.finished.append(batch)
    return run.reports


def _number(value: float) -> float | None:
    return value if math.isfinite(value) else None


def run_check(args: argparse.Namespace) -> int:
    """Prints one row per (op call, runner, tactic); 1 when any check failed.

    Raises:
        KeyboardInterrupt: Ctrl-C; its message says which reports were printed and written.
        GraphtuneError: A batch that cannot be checked (its KV cache or its checks do not fit
            in memory); the batches before it are printed and written first.
    """
    from graphtune.cli._step_calls import resolve_device_and_dtype

    check_output_path(args.json, "--json", result_json=True)
    where, kind = resolve_device_and_dtype(args.device, args.dtype)
    dtype = str(kind).removeprefix("torch.")
    run = CheckRun()
    try:
        check_step(
            args.model,
            args.batch,
            device=str(where),
            dtype=dtype,
            max_seq_len=args.max_seq_len,
            atol=args.atol,
            rtol=args.rtol,
            run=run,
            log=_progress_line,
        )
    except KeyboardInterrupt:
        why = "interrupted (Ctrl-C)"
        raise KeyboardInterrupt(_report_partial(args, where, dtype, run, why)) from None
    except GraphtuneError as exc:
        if run.reports:  # main() prints the error's own line after these
            kept = _report_partial(args, where, dtype, run, f"stopped ({one_line(exc)})")
            print(f"check-tactics stopped: {kept}", file=sys.stderr)
        raise
    kept, failed = _emit(args, where, dtype, run.reports)
    return EXIT_FAILURE if failed or not kept else EXIT_OK


def _progress_line(line: str) -> None:
    # Plain lines rather than a bar: a run piped to a log shows them too. The switch that hides
    # the other commands' progress bars hides them.
    if not env.progress_disabled():
        print(line, file=sys.stderr, flush=True)


def _report_partial(
    args: argparse.Namespace, device: Any, dtype: str, run: CheckRun, why: str
) -> str:
    """Prints and writes the reports a run stopped by ``why`` gathered; says what was kept (the
    interrupt's message, as ``bench decode`` and ``tune`` say it)."""
    if not run.reports:
        return "no op call had been checked yet"
    unfinished = [b for b in args.batch if b not in run.finished]
    # The reports of a batch cut short are kept too: each is a whole op call's check.
    note = f"{why}: finished batch sizes {run.finished}" + (
        f"; batch sizes {unfinished} not (or only partly) checked" if unfinished else ""
    )
    kept, _ = _emit(args, device, dtype, run.reports, notes=[note])
    where = f" and written to {args.json}" if kept and args.json and str(args.json) != "-" else ""
    return (
        f"{len(run.reports)} op calls checked (finished batch sizes {run.finished}) "
        f"printed above{where}"
    )


def _emit(
    args: argparse.Namespace,
    device: Any,
    dtype: str,
    reports: list[Any],
    notes: list[str] | None = None,
) -> tuple[bool, bool]:
    """Writes ``--json``, then prints the table; returns whether the JSON went where asked
    (:func:`report_written`) and whether any check failed."""
    from graphtune.autotuner.entries import tactic_text
    from graphtune.bench.results import json_safe, write_json
    from graphtune.reporting import render_table

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
    data = _result_json(args, device, dtype, reports, notes)
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
    for note in notes or ():
        print(note, file=table_stream)
    if to_stdout:
        print(json.dumps(json_safe(data), indent=1))
    kept = written is None or report_written("--json", args.json, written)
    return kept, bool(failed)


def _result_json(
    args: argparse.Namespace,
    device: Any,
    dtype: str,
    reports: list,
    notes: list[str] | None = None,
) -> dict:
    """``--json``'s object: the provenance record every result carries, then the run's inputs
    and the op reports; ``notes`` only when the run stopped early (what it covers)."""
    from graphtune.bench.schema import provenance

    data = {
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
        # A run stopped early did not check everything it was asked to: not a pass, whatever
        # the finished reports say (its ``notes`` tell that failure from a tactic's).
        "passed": not notes and all(r.passed for r in reports),
        "reports": [_report_json(r) for r in reports],
    }
    if notes:
        data["notes"] = list(notes)
    return data


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
