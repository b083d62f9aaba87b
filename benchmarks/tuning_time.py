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
``tuning-time-<gpu>.json`` (``-<label>`` added with ``--label``) with provenance and prints a
table last. Exits 2 without CUDA, 1 when a target fails.
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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGETS = {"cold_tune_s_le": 15.0, "warm_tune_s_le": 1.0, "median_ms_per_tactic_bucket_le": 10.0}
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


def compile_workers(log: list[Any], start: float) -> dict[str, Any] | None:
    """The compile workers' side of a phase from their job log
    (``graphtune.ops._compile_pool.job_log``), times in seconds from ``start`` (the tuning
    call's start): when the last worker was ready, the span the compile jobs ran in, their
    summed seconds, and per kernel its jobs and seconds. ``None`` when no worker ran."""
    if not log:
        return None
    warm = [r for r in log if r.kind == "warm-up"]
    jobs = [r for r in log if r.kind == "compile"]
    by_kernel: dict[str, dict[str, float]] = {}
    for r in jobs:
        row = by_kernel.setdefault(r.name, {"jobs": 0, "seconds": 0.0})
        row["jobs"] += 1
        row["seconds"] += r.finished - r.started
    return {
        "processes": len({r.pid for r in log}),
        "ready_s": max(r.finished for r in warm) - start if warm else None,
        "jobs": len(jobs),
        "failed": sum(1 for r in jobs if r.error is not None),
        "job_seconds": sum(r.finished - r.started for r in jobs),
        "first_job_s": min(r.started for r in jobs) - start if jobs else None,
        "last_job_s": max(r.finished for r in jobs) - start if jobs else None,
        "by_kernel": dict(sorted(by_kernel.items(), key=lambda item: -item[1]["seconds"])),
    }


def compile_by_runner(triton: list[Any]) -> dict[str, dict[str, float]]:
    """Per Triton runner class: binaries compiled, those a compile worker process made (this
    process only loaded them), (profile, tactic) pairs that shared one, and compile seconds
    (wall time of its compiles, which run beside other runners')."""
    table: dict[str, dict[str, float]] = {}
    for runner in triton:
        row = table.setdefault(
            type(runner).__name__,
            {"binaries": 0, "in_workers": 0, "shared": 0, "compile_s": 0.0},
        )
        row["binaries"] += runner.compiled
        row["in_workers"] += runner.compiled_in_workers
        row["shared"] += runner.compile_shared
        row["compile_s"] += runner.compile_seconds
    return dict(sorted(table.items(), key=lambda item: -item[1]["binaries"]))


def by_op(history: Any) -> dict[str, dict[str, float]]:
    """Per op: tuned profiles, candidates, measurements (samples), wall seconds of its profiles,
    and the slowest working candidate's median per call in µs (a slow candidate's samples are
    what make a profile long on the GPU)."""
    table: dict[str, dict[str, float]] = {}
    for rec in history:
        row = table.setdefault(
            rec.op,
            {"profiles": 0, "candidates": 0, "samples": 0, "seconds": 0.0, "slowest_us": 0.0},
        )
        row["profiles"] += 1
        row["candidates"] += len(rec.candidates)
        row["samples"] += sum(c.samples for c in rec.candidates)
        row["seconds"] += rec.seconds
        timed = [c.median_us for c in rec.candidates if c.samples and c.failed is None]
        row["slowest_us"] = max([row["slowest_us"], *timed])
    return dict(sorted(table.items(), key=lambda item: -item[1]["seconds"]))


def candidates_table(history: Any) -> list[dict[str, Any]]:
    """Every tuned profile's candidates as the tuner timed them, for offline pruning studies
    (which tactics never come near a profile's best): per profile its op, shapes, the winner's
    index and one row per candidate, ``[runner, tactic, median µs, samples, failure]`` (a
    candidate raced out after one round has one sample, unless it was re-timed because the
    leader's median rose past it; a failed one a median of ``null``)."""
    from graphtune.autotuner.entries import tactic_text

    return [
        {
            "op": rec.op,
            "profile": rec.profile,
            "winner": rec.winner_index,
            "rows": [
                [
                    c.runner,
                    tactic_text(c.tactic),
                    c.median_us,
                    c.samples,
                    c.failed,
                ]
                for c in rec.candidates
            ],
        }
        for rec in history
    ]


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
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--model", default="llama-1b-shape")
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--tune-step", default=DEFAULT_STEP, metavar="MODULE:FUNCTION")
    parser.add_argument("--no-prepare", action="store_true", help="no up-front compile")
    parser.add_argument("--compile-processes", type=int, default=None, metavar="N")
    parser.add_argument("--label", default=None, help="suffix of the result file name")
    parser.add_argument(
        "--keep-caches",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the tuning cache and the Triton cache in DIR (default: a temporary folder)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="run each phase's tuning under cProfile and write tuning-{cold,warm}.prof and .txt "
        "(top functions) to DIR; the profiler slows the Python parts, so take the times from a "
        "run without it",
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

    device = bench.require_cuda_or_exit("benchmarks/tuning_time.py")
    prov = bench.provenance(args.commit, device)
    with contextlib.ExitStack() as stack:
        if args.keep_caches is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="graphtune-tt-")))
        else:
            folder = args.keep_caches
        cache = folder / "tuning-cache.json"
        triton_cache = folder / "triton-cache"
        triton_cache.mkdir(parents=True, exist_ok=False)  # the cold phase needs it empty
        bytecode = folder / "bytecode"  # see the module docstring
        empty_bytecode = None
        if args.cold_bytecode == "installed":
            scratch = folder / "bytecode-run"
            (scratch / "triton-cache").mkdir(parents=True, exist_ok=False)
            empty_bytecode = run_phase(
                "cold", args, scratch / "triton-cache", bytecode, scratch / "tuning-cache.json"
            )
        cold = run_phase("cold", args, triton_cache, bytecode, cache)
        warm = run_phase("warm", args, triton_cache, bytecode, cache)
    checks = {
        "cold_tune_s_le": cold["tune_s"] <= TARGETS["cold_tune_s_le"],
        "warm_tune_s_le": warm["tune_s"] <= TARGETS["warm_tune_s_le"],
        "median_ms_per_tactic_bucket_le": (cold["median_ms_per_tactic_bucket"] or 0.0)
        <= TARGETS["median_ms_per_tactic_bucket_le"],
        "warm_tunes_nothing": warm["profiles_tuned"] == 0 and warm["measurements"] == 0,
    }
    label = f"-{args.label}" if args.label else ""
    name = f"tuning-time-{prov['gpu_slug']}{label}.json"
    path = bench.write_json(
        args.out / name,
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
                    if empty_bytecode is not None
                    else "empty in the cold phase"
                ),
            },
            "cold": cold,
            "cold_empty_bytecode": empty_bytecode,
            "warm": warm,
            "targets": TARGETS,
            "checks": checks,
        },
    )
    print(json.dumps({"bench": "tuning_time", "file": str(path), "checks": checks}))
    rows = [
        ("tune_s", cold["tune_s"], warm["tune_s"]),
        ("prepare_s (record + compile up front)", cold["prepare_s"], warm["prepare_s"]),
        ("bucket runs s (tuning mode)", cold["bucket_runs_s"], warm["bucket_runs_s"]),
        ("whole-step check s", cold["check_s"], warm["check_s"]),
        ("whole-step check, step timings", cold["check_step_timings"], warm["check_step_timings"]),
        ("compile_s (Triton, summed over runners)", cold["compile_s"], warm["compile_s"]),
        ("binaries compiled", cold["compiled_binaries"], warm["compiled_binaries"]),
        ("profiles tuned / untimed", cold["profiles_tuned"], cold["untimed_picks"]),
        ("candidates / measurements", cold["candidates"], cold["measurements"]),
        ("measured once (out of the race)", cold["raced_out"], None),
        ("re-timed after the race (leader's median rose)", cold["retimed"], None),
        ("median ms per (tactic, bucket)", cold["median_ms_per_tactic_bucket"], None),
        ("overall ms per (tactic, bucket)", cold["overall_ms_per_tactic_bucket"], None),
        *(
            (f"phase {k} s", v, warm["phase_seconds"].get(k))
            for k, v in cold["phase_seconds"].items()
        ),
        ("second call s", cold["second_call_s"], warm["second_call_s"]),
    ]
    head = ("profiles", 9), ("cands", 7), ("samples", 8), ("s", 7), ("slowest us", 11)
    print(f"{'cold, by op':38} " + " ".join(f"{name:>{width}}" for name, width in head))
    for op, row in cold["by_op"].items():
        print(
            f"{op:38} {row['profiles']:9d} {row['candidates']:7d} {row['samples']:8d} "
            f"{row['seconds']:7.2f} {row['slowest_us']:11.1f}"
        )
    print(
        f"{'cold, by Triton runner':38} {'binaries':>9} {'in workers':>10} {'shared':>7} "
        f"{'compile s':>10}"
    )
    for name, row in cold["compile_by_runner"].items():
        print(
            f"{name:38} {row['binaries']:9d} {row['in_workers']:10d} {row['shared']:7d} "
            f"{row['compile_s']:10.2f}"
        )
    workers = cold["compile_workers"]
    if workers is not None:
        ready, first, last = (
            "-" if v is None else f"{v:.2f}"
            for v in (workers["ready_s"], workers["first_job_s"], workers["last_job_s"])
        )
        print(
            f"cold, compile workers: {workers['processes']} processes, the last ready at "
            f"{ready} s; {workers['jobs']} jobs ({workers['failed']} failed), "
            f"{workers['job_seconds']:.1f} job-seconds, run from {first} to {last} s"
        )
        print(f"{'cold, compile jobs by kernel':38} {'jobs':>9} {'job s':>10}")
        for name, row in workers["by_kernel"].items():
            print(f"{name:38} {row['jobs']:9d} {row['seconds']:10.2f}")
    if empty_bytecode is not None:
        print(
            f"cold run with an empty bytecode cache first: tune_s {empty_bytecode['tune_s']:.3f}, "
            f"import_s {empty_bytecode['import_s']:.3f}"
        )
    print(f"{'':38} {'cold':>10} {'warm':>10}")
    for label, a, b in rows:
        fa = f"{a:10.3f}" if isinstance(a, float) else f"{a!s:>10}"
        fb = f"{b:10.3f}" if isinstance(b, float) else f"{b!s:>10}"
        print(f"{label:38} {fa} {fb}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
