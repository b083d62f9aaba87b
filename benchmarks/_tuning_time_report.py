"""Pure helpers of ``benchmarks/tuning_time.py``, kept apart so the script stays short: the
summaries a phase's child builds from the tuner's history and the compile workers' job log, the
target checks, and the printed tables (cold and warm phase side by side, by op, by Triton runner,
the compile workers)."""

from __future__ import annotations

from typing import Any

TARGETS = {"cold_tune_s_le": 15.0, "warm_tune_s_le": 1.0, "median_ms_per_tactic_bucket_le": 10.0}


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


def checks(cold: dict[str, Any], warm: dict[str, Any]) -> dict[str, bool]:
    """Each target (:data:`TARGETS`) and that the warm phase tuned nothing. A target the run
    did not measure fails: the cold median is ``None`` when no profile timed two candidates."""
    median = cold["median_ms_per_tactic_bucket"]
    return {
        "cold_tune_s_le": cold["tune_s"] <= TARGETS["cold_tune_s_le"],
        "warm_tune_s_le": warm["tune_s"] <= TARGETS["warm_tune_s_le"],
        "median_ms_per_tactic_bucket_le": median is not None
        and median <= TARGETS["median_ms_per_tactic_bucket_le"],
        "warm_tunes_nothing": warm["profiles_tuned"] == 0 and warm["measurements"] == 0,
    }


def print_tables(
    cold: dict[str, Any], warm: dict[str, Any], empty_bytecode: dict[str, Any] | None
) -> None:
    """What the script prints last, after its JSON line."""
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
