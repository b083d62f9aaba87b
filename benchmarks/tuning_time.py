#!/usr/bin/env python3
"""Whole-step tuning time: a cold run (no tuning cache, empty Triton cache) and a warm restart.

Usage (on a GPU machine, from the repository root):

    PYTHONPATH=src python3 benchmarks/tuning_time.py --out benchmarks/results
        [--model llama-1b-shape] [--max-batch 128] [--max-seq-len 2048] [--commit SHA]
        [--tune-step MODULE:FUNCTION] [--keep-caches DIR] [--profile DIR]
        [--cold-bytecode installed|empty]

Every phase runs in a fresh process, so nothing survives in memory between them:

1. ``cold``: ``TRITON_CACHE_DIR`` is a new empty folder and there is no tuning cache file. The
   child runs ``tune_step(model, max_batch, tuner, device=, dtype=, max_seq_len=)`` inside
   ``autotune(cache, tuner)``; the default is the engine's path
   (``graphtune.engine.tuning.tune_step`` on the step ``graphtune.engine.build.build_step``
   builds): record one untuned step, compile every missing profile's Triton tactics up front
   (``AutoTuner.prepare``), then run the step at every batch bucket up to ``max_batch``, whose
   ops tune on their first miss. Reported: the wall time of that call (``tune_s``) and of its
   up-front part (``prepare_s``), the tuner's ``stats`` (tuning seconds by phase, measurements,
   untimed picks), the Triton runners' compile seconds (summed over runners, which compile side
   by side) and binaries, and the cost per (tactic, bucket): the median over tuned profiles of
   profile seconds / candidates (``AutoTuner.history``; compilation is not in it) and the
   overall ``tune_s`` / all candidates; per op (``by_op``) its profiles, candidates,
   measurements, profile seconds and slowest candidate; and per Triton runner class
   (``compile_by_runner``) its binaries and compile seconds; and the compile workers' side
   (``compile_workers``): when the last worker was ready, when the compile jobs ran, and their
   seconds per kernel, all from the start of the tuning call; and ``candidates_table``, every
   tuned profile's candidates with their medians (for studies of which tactics to prune).
   Python's bytecode cache is a folder of the run (``PYTHONPYCACHEPREFIX``, with bytecode
   writing on): on a machine whose installed packages carry no ``.pyc`` files and cannot take
   them, every process would compile every module it imports from source, in every phase, where
   a normal installation (``pip install`` writes the ``.pyc`` files) has its bytecode. With
   ``--cold-bytecode installed`` (the default) a first cold run with its own throwaway tuning and
   Triton caches fills that folder, so the cold phase then starts as on a fresh installation:
   no tuning cache, an empty Triton cache, the bytecode present. That first run is the cold run
   with an empty bytecode cache too, and is reported as ``cold_empty_bytecode``. With
   ``--cold-bytecode empty`` there is no first run and the cold phase starts with the folder
   empty (how runs before this option measured).
2. ``warm``: the same Triton cache folder and the tuning cache file the cold run saved; the same
   call must tune nothing (``tune_s`` is loading the file, Triton loading its cached binaries and
   the look-ups), with the bytecode the cold phase's imports wrote. A second call shows the
   steady state. Graph capture before the first replay belongs to the engine and is not in these
   numbers.

Each phase also records its process's ``host_speed`` (``graphtune.bench.timing.host_speed``),
measured after the timed calls: these times are spent on the host, and hosts differ.

``--tune-step`` names the function (default ``graphtune.cli._step_calls:tune_decode_step``, the
engine's step and ``tune_step``). ``--no-prepare`` skips the up-front compile (each op compiles
when it is tuned) and ``--compile-processes N`` sets ``GRAPHTUNE_COMPILE_PROCESSES`` in the
children (``0``: compile in threads of the tuning process only), to compare. ``--profile DIR``
runs each phase's tuning call under ``cProfile`` and writes ``tuning-<phase>.prof`` and a text
top list (``.txt``) to ``DIR``: where the time goes, for example in ``Stream.synchronize`` (the GPU)
or in host work; the profiler slows the Python parts, so read the times from a run without it
(the result records ``options.profiled``). Targets (issue 14):
cold ``tune_s`` <= 15 s, warm ``tune_s`` <= 1 s, median per (tactic, bucket) <= 10 ms. Writes
``tuning-time-<gpu>-<model>[-profiled][-<label>].json`` (``-profiled`` with ``--profile``,
``-<label>`` with ``--label``: a run of another model or under the profiler does not replace a
plain one) with provenance and prints a
table last. Exits 2 without CUDA or for a malformed flag (``--max-batch`` below 1, a
``--keep-caches`` folder that is not new or empty, an ``--out`` that cannot be written), 1 when a
target fails or a phase fails (then the phase reads ``{"error": ...}``, the later ones ``null``,
the file name ends in ``-failed``, and the phases that finished are kept) or when the result went
to the temporary folder instead of ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import io
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tuning_time_report import (  # noqa: E402
    TARGETS,
    by_op,
    candidates_table,
    compile_by_runner,
    compile_workers,
    print_tables,
)
from _tuning_time_report import checks as report_checks  # noqa: E402

DEFAULT_STEP = "graphtune.cli._step_calls:tune_decode_step"


def _load(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One phase in this (fresh) process; returns its measurements."""
    began = time.perf_counter()
    import torch

    from graphtune.autotuner import AutoTuner, autotune
    from graphtune.ops._triton_runner import TritonRunner

    imported = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device: None)
    tune_step = _load(args.tune_step)
    options = {"prepare": False} if args.no_prepare else {}
    tuner = AutoTuner(show_progress=False)

    def tune() -> Any:
        return tune_step(
            args.model,
            args.max_batch,
            tuner,
            device=device,
            dtype=dtype,
            max_seq_len=args.max_seq_len,
            **options,
        )

    profiler = cProfile.Profile() if args.profile else None
    wall_start = time.time()  # the compile workers' job log is in wall-clock time
    start = time.perf_counter()
    # tune=True: this must tune; GRAPHTUNE_CACHE_ONLY (meant for serving) would make it look-ups.
    with tuner.record_calls() as calls, autotune(args.cache, tuner, tune=True):
        if profiler is not None:
            profiler.enable()
        report = tune()
        sync(device)
        if profiler is not None:
            profiler.disable()
    tune_s = time.perf_counter() - start
    if profiler is not None:
        write_profile(profiler, args.profile / f"tuning-{args.child}")
    again = time.perf_counter()
    tune()
    sync(device)
    second_s = time.perf_counter() - again
    runners = {id(r): r for call in calls for r in call.runners}.values()
    triton = [r for r in runners if isinstance(r, TritonRunner)]
    per_tactic = [
        1000.0 * rec.seconds / len(rec.candidates)
        for rec in tuner.history
        if len(rec.candidates) > 1
    ]
    candidates = sum(len(rec.candidates) for rec in tuner.history)
    stats = tuner.stats
    fusion_checks = getattr(report, "fusion_checks", [])
    from graphtune.bench.timing import host_speed
    from graphtune.ops._compile_pool import job_log

    return {
        "phase": args.child,
        "host_speed": host_speed(),
        "import_s": imported - began,
        "tune_s": tune_s,
        "prepare_s": getattr(report, "prepare_seconds", None),
        "prepared_tactics": getattr(report, "prepared", None),
        "bucket_runs_s": getattr(report, "bucket_runs_seconds", None),
        "check_s": getattr(report, "check_seconds", None),
        "fusion_checks": [vars(c) for c in fusion_checks],
        "check_step_timings": sum(c.step_timings for c in fusion_checks),
        "second_call_s": second_s,
        "op_calls": len(calls),
        "profiles_tuned": stats.profiles_tuned,
        "profiles_failed": stats.profiles_failed,
        "untimed_picks": stats.untimed_picks,
        "candidates": candidates,
        "measurements": stats.measurements,
        "raced_out": stats.raced_out,
        "retimed": stats.retimed,
        "tuning_seconds": stats.tuning_seconds,
        "phase_seconds": dict(stats.phase_seconds),
        "fallbacks": dict(stats.fallbacks),
        "compile_s": sum(r.compile_seconds for r in triton),
        "compiled_binaries": sum(r.compiled for r in triton),
        "compile_shared": sum(r.compile_shared for r in triton),
        "median_ms_per_tactic_bucket": statistics.median(per_tactic) if per_tactic else None,
        "overall_ms_per_tactic_bucket": 1000.0 * tune_s / candidates if candidates else None,
        "by_op": by_op(tuner.history),
        "candidates_table": candidates_table(tuner.history),
        "compile_by_runner": compile_by_runner(triton),
        "compile_workers": compile_workers(job_log(), wall_start),
    }


def write_profile(profiler: cProfile.Profile, stem: Path, top: int = 40) -> None:
    """``stem.prof`` (pstats, for snakeviz or ``python -m pstats``) and ``stem.txt``: the ``top``
    functions by own time and by cumulative time."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(str(stem.with_suffix(".prof")))
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(top)
    stem.with_suffix(".txt").write_text(text.getvalue())


def run_phase(
    phase: str, args: argparse.Namespace, triton_cache: Path, bytecode: Path, cache: Path
) -> dict[str, Any]:
    """Runs one phase in a fresh process with these caches (``cache``: the tuning cache file);
    returns what the child measured."""
    env = {
        **os.environ,
        "TRITON_CACHE_DIR": str(triton_cache),
        "PYTHONPYCACHEPREFIX": str(bytecode),
        "GRAPHTUNE_NO_PROGRESS": "1",
    }
    env.pop("GRAPHTUNE_CACHE_ONLY", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if args.compile_processes is not None:
        env["GRAPHTUNE_COMPILE_PROCESSES"] = str(args.compile_processes)
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        phase,
        "--cache",
        str(cache),
        "--model",
        args.model,
        "--max-batch",
        str(args.max_batch),
        "--max-seq-len",
        str(args.max_seq_len),
        "--tune-step",
        args.tune_step,
        "--device",
        args.device,
        *(["--no-prepare"] if args.no_prepare else []),
        *(["--profile", str(args.profile)] if args.profile else []),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{phase} phase failed:\n{done.stderr[-4000:]}")
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):  # the child exited 0 without its JSON line
        raise RuntimeError(
            f"{phase} phase failed:\nno JSON line on its stdout: {done.stdout[-200:]!r}"
        ) from None


def fresh_folder(text: str) -> Path:
    """``argparse`` type of ``--keep-caches``: a folder that does not exist yet or is empty.

    A reused folder holds the last run's Triton cache, tuning cache and bytecode, so its cold
    phase would not be cold. Refused up front rather than run in a new subfolder: the user named
    DIR to find the caches there, and a hidden subfolder per run would surprise.
    """
    path = Path(text)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise argparse.ArgumentTypeError(
            f"{text} exists and is not an empty folder (an earlier run's caches?); the cold "
            "phase needs empty caches: give a new folder or empty this one"
        )
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser
    # A child takes the numbers its parent checked, with int.
    positive_int: Any = int
    non_negative_int: Any = int
    if "--child" not in (sys.argv[1:] if argv is None else argv):
        # The parent only: a child's import_s must count every graphtune module it imports.
        from graphtune.cli._args import Parser as parser_class
        from graphtune.cli._args import non_negative_int, positive_int
    parser = parser_class(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON result"
    )
    parser.add_argument("--model", default="llama-1b-shape", help="preset or model folder")
    parser.add_argument("--max-batch", type=positive_int, default=128, help="largest batch")
    parser.add_argument("--max-seq-len", type=positive_int, default=2048, help="KV cache length")
    parser.add_argument("--commit", default=None, help="commit to record (default: git)")
    parser.add_argument(
        "--tune-step", default=DEFAULT_STEP, metavar="MODULE:FUNCTION", help="tuning function"
    )
    parser.add_argument("--no-prepare", action="store_true", help="no up-front compile")
    parser.add_argument(
        "--compile-processes",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="GRAPHTUNE_COMPILE_PROCESSES of the phases (default: unset, the library's choice)",
    )
    parser.add_argument(
        "--label", default=None, help="suffix of the result file name (default: none)"
    )
    parser.add_argument(
        "--keep-caches",
        type=fresh_folder,
        default=None,
        metavar="DIR",
        help="keep the tuning cache and the Triton cache in DIR, a new or empty folder "
        "(default: a temporary folder)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="run each phase's tuning under cProfile and write tuning-{cold,warm}.prof and .txt "
        "(top functions) to DIR; the profiler slows the Python parts, so take the times from a "
        "run without it (default: none, no profiler)",
    )
    parser.add_argument(
        "--cold-bytecode",
        choices=("installed", "empty"),
        default="installed",
        help="Python bytecode at the cold phase's start: 'installed' (a first, throwaway cold run "
        "writes it, as pip install would; reported as cold_empty_bytecode) or 'empty'",
    )
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: tests only
    parser.add_argument("--child", choices=("cold", "warm"), help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    from graphtune import bench
    from graphtune.cli._args import check_script_output, report_written

    device = bench.require_cuda_or_exit("benchmarks/tuning_time.py")
    prov = bench.provenance(args.commit, device)
    targets = {
        ok: args.out / result_name(args, prov["gpu_slug"], failed=not ok) for ok in (True, False)
    }
    for result_path in targets.values():  # before the phases: exit 2 on a bad --out
        check_script_output(result_path)
    # A phase that did not run stays None; a failed one reads {"error": ...}.
    phases: dict[str, dict[str, Any] | None] = dict.fromkeys(
        ("cold_empty_bytecode", "cold", "warm")
    )
    failed = None
    with contextlib.ExitStack() as stack:
        if args.keep_caches is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="graphtune-tt-")))
        else:
            folder = args.keep_caches  # empty or new: parse_args checked it (fresh_folder)
        cache = folder / "tuning-cache.json"
        triton_cache = folder / "triton-cache"
        triton_cache.mkdir(parents=True, exist_ok=False)  # the cold phase needs it empty
        bytecode = folder / "bytecode"  # see the module docstring
        runs = []
        if args.cold_bytecode == "installed":
            scratch = folder / "bytecode-run"
            (scratch / "triton-cache").mkdir(parents=True, exist_ok=False)
            runs.append(
                (
                    "cold_empty_bytecode",
                    "cold",
                    scratch / "triton-cache",
                    scratch / "tuning-cache.json",
                )
            )
        runs += [("cold", "cold", triton_cache, cache), ("warm", "warm", triton_cache, cache)]
        for key, phase, triton_dir, cache_file in runs:
            try:
                phases[key] = run_phase(phase, args, triton_dir, bytecode, cache_file)
            except RuntimeError as exc:
                # Keep what finished (written below); the later phases start from this one's
                # caches and bytecode, so they are not run.
                phases[key] = {"error": str(exc)}
                # The first run of --cold-bytecode installed is a "cold" child too: say which.
                failed = one_line(exc) if key == phase else f"{key} run: {one_line(exc)}"
                break
    cold, warm, empty_bytecode = phases["cold"], phases["warm"], phases["cold_empty_bytecode"]
    checks = None if failed or cold is None or warm is None else report_checks(cold, warm)
    target = targets[failed is None]  # the -failed name when a phase failed
    path = bench.write_json(  # target, or the fallback file it went to instead
        target,
        {
            "benchmark": "tuning_time",
            "provenance": prov,
            "options": {
                "model": args.model,
                "max_batch": args.max_batch,
                "max_seq_len": args.max_seq_len,
                "tune_step": args.tune_step,
                "prepare": not args.no_prepare,
                "compile_processes": args.compile_processes,
                "profiled": args.profile is not None,
                "cold_bytecode": args.cold_bytecode,
                "bytecode_cache": "PYTHONPYCACHEPREFIX of the run, "
                + (
                    "written by a first cold run before the cold phase"
                    if args.cold_bytecode == "installed"
                    else "empty in the cold phase"
                ),
            },
            "cold": cold,
            "cold_empty_bytecode": empty_bytecode,
            "warm": warm,
            "error": failed,
            "targets": TARGETS,
            "checks": checks,
        },
    )
    line = {"bench": "tuning_time", "file": str(path), "checks": checks}
    print(json.dumps({**line, "error": failed} if failed else line))
    if checks is None or cold is None or warm is None:  # a phase failed: no tables to print
        # One error line, naming where the file went (target or the temporary folder).
        print(f"error: {failed}; the phases that finished are in {path}", file=sys.stderr)
        return 1
    print_tables(cold, warm, empty_bytecode)
    # Exit 1 also when the result went to the temporary folder: a script finds no file at target.
    written = report_written("--out", target, path)
    return 0 if written and all(checks.values()) else 1


def one_line(exc: BaseException) -> str:
    """A phase's failure in one line: its first line (which phase) and the child's last line
    (usually the exception), not the whole stderr tail the JSON keeps."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"


def result_name(args: argparse.Namespace, gpu_slug: str, failed: bool = False) -> str:
    """``tuning-time-<gpu>-<model>[-profiled][-<label>][-failed].json``: a run of another model,
    one under the profiler (slower Python) or one that failed never replaces a plain run's file."""
    model = re.sub(r"[^A-Za-z0-9.]+", "-", args.model).strip("-")
    profiled = "-profiled" if args.profile is not None else ""
    label = f"-{args.label}" if args.label else ""
    return f"tuning-time-{gpu_slug}-{model}{profiled}{label}{'-failed' if failed else ''}.json"


if __name__ == "__main__":
    sys.exit(main())
