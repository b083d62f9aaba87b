"""The decode benchmark behind ``graphtune bench decode``.

For each batch size it times the engine's decode step eagerly, through the engine's graph runner
(with its copy-in, padding and slicing: what a server pays), and optionally through
``torch.compile(mode="reduce-overhead")``; it reads the GPU-busy time of one step from CUPTI
(:func:`graphtune.bench.cupti.gpu_busy`) and computes the bytes floor: weights plus the KV cache a
step must read, over a measured device copy bandwidth. For a mixture-of-experts model the weights
counted are those the step really reads: per MoE layer only the experts the batch's tokens were
routed to in that step (:mod:`graphtune.bench.moe_floor`).

With ``tune=True`` the same run then builds the tuned step, tunes it by running it
(:func:`graphtune.engine.tuning.tune_step`; a cache file is reused when given) and times it the
same way: through a graph runner on CUDA (else eagerly), with its GPU-busy time, top kernels and
its ratios to the untuned step and to the bytes floor (and, with ``compare_unfused``, the tuned
step with its stages unfused). With ``compare_hf`` transformers' implementation of the same
model runs last on the same weight tensors, with a logits check: eagerly, and through the static
cache + ``torch.compile`` recipe (:mod:`graphtune.bench.decode_hf`). Every GPU-busy reading also
groups the kernels by family (:mod:`graphtune.bench.kernel_families`). Steps and runners come from
the engine's own factories (:func:`graphtune.engine.build.build_step`,
:func:`~graphtune.engine.build.build_runner`), so the benchmark times what the engine serves. A
progress bar on stderr names each phase and batch size while it runs
(:mod:`graphtune.bench.decode_progress`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from graphtune import autotuner
from graphtune.bench.cupti import gpu_busy
from graphtune.bench.decode_compile import time_compiled
from graphtune.bench.decode_hf import time_hf
from graphtune.bench.decode_progress import PhaseBar, phase_labels
from graphtune.bench.decode_results import BatchResult, DecodeBenchConfig, DecodeBenchReport
from graphtune.bench.decode_spread import timed_ms
from graphtune.bench.decode_tuner import check_lead_in, default_tuner
from graphtune.bench.moe_floor import expected_experts_hit, step_bytes
from graphtune.bench.schema import provenance
from graphtune.bench.timing import bytes_floor_ms, copy_bandwidth_gbps, kv_positions_read, sync
from graphtune.engine.build import build_runner, build_step
from graphtune.engine.devices import resolve_device, resolve_dtype
from graphtune.engine.kv_cache import KVCache, aligned_seq_len
from graphtune.engine.loading import load_model
from graphtune.engine.presets import fewer_layers
from graphtune.engine.step import DecodeStep
from graphtune.engine.tuning import tune_step
from graphtune.errors import ConfigError, one_line
from graphtune.reporting import progress

logger = logging.getLogger(__name__)

NO_CUDA_NOTE = "CUDA is not available: CUDA graphs need CUDA, so only the eager step is timed."

Inputs = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class _Run:
    """What every timed phase of one benchmark run reads (and the results it fills in)."""

    step: DecodeStep
    inputs: Inputs
    results: list[BatchResult]
    device: torch.device
    cfg: DecodeBenchConfig
    runners: tuple[str, ...]
    report: DecodeBenchReport
    log: Callable[[str], None]
    bar: PhaseBar

    @property
    def sizes(self) -> list[int]:
        """The batch sizes, ascending."""
        return [r.batch_size for r in self.results]

    def rows(self) -> Any:
        """(inputs, result) per batch size."""
        return zip(self.inputs, self.results, strict=True)

    @property
    def measure_busy(self) -> bool:
        """Whether GPU-busy time (CUPTI kernel sums) is read, of every step: on CUDA with tp 1.

        Summed kernel time means nothing with tp > 1: an NCCL all-reduce kernel's duration
        includes the time it spins waiting for the other rank (many times the step's length), so
        GPU-busy and graph/busy are left out rather than reported wrong.
        """
        return self.device.type == "cuda" and self.cfg.tp == 1


Busy = tuple[float | None, float | None, list[dict[str, Any]], dict[str, dict[str, Any]]]
#: An eager step slower than this is profiled for one call instead of five: its trace is large
#: (the untuned step of an MoE model loops over the hit experts, tens of thousands of kernels).
SLOW_STEP_MS = 50.0


def _busy(fn: Callable[[], object], eager_ms: float | None = None) -> Busy:
    """GPU-busy ms, activities, top kernels and kernel families of one call of ``fn``."""
    busy = gpu_busy(fn, calls=1 if eager_ms is not None and eager_ms > SLOW_STEP_MS else 5)
    if busy is None:
        return None, None, [], {}
    return busy.per_call_ms, busy.activities_per_call, busy.top, busy.families


@torch.inference_mode()
def run_decode_bench(
    cfg: DecodeBenchConfig,
    log: Callable[[str], None] = logger.info,
    *,
    tuner: Any = None,
    parallel: Any = None,
    command: str | None = None,
    on_start: Callable[[DecodeBenchReport], None] | None = None,
    show_progress: bool | None = None,
) -> DecodeBenchReport:
    """Runs the decode benchmark described by ``cfg``.

    Args:
        cfg: What to measure.
        log: Where progress lines go.
        tuner: The :class:`~graphtune.autotuner.AutoTuner` for ``cfg.tune`` (a new one when
            ``None``; with ``agree`` over the group for a tensor-parallel run).
        parallel: The :class:`~graphtune.engine.parallel.ParallelContext` when ``cfg.tp > 1``
            (its ``world_size`` must equal ``cfg.tp``). Every rank must call this with the same
            ``cfg``: the steps, captures and timings run the same collectives in the same order.
        command: The command line to record in the provenance (default: this process's).
        on_start: Called with the report as soon as it exists, before anything is timed; the
            report fills in as phases and batch sizes finish, so a caller that is interrupted
            (Ctrl-C) or fails still holds what finished (:meth:`DecodeBenchReport.derive`
            completes it); on a failure a note names the phase and the error.
        show_progress: Force the progress bar on or off; ``None`` decides from the terminal.

    Raises:
        ConfigError: ``cfg.tp`` and ``parallel`` disagree, the model does not split, or
            ``compare_compile`` or ``refine_in_step`` is asked for off CUDA, or ``runners`` is
            ``("graph",)`` alone off CUDA (with the eager runner too, only eager is timed and a
            note says so).
        InputError: ``cfg.context + 1`` positions exceed the model's ``max_position_embeddings``.

    Returns:
        The report (per-batch results, capture seconds, graph MiB, provenance).
    """
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    runners = tuple(cfg.runners)
    notes = []
    if device.type != "cuda":
        for flag, on, why in (
            ("--compare-compile", cfg.compare_compile, "captures CUDA graphs"),
            ("--refine-in-step", cfg.refine_in_step, "times the whole step on the GPU"),
        ):
            if on:
                raise ConfigError(f"{flag} {why}, and the device is {device}: drop it")
        if set(runners) == {"graph"}:
            raise ConfigError(
                f"--runner graph times CUDA graphs, and CUDA graphs need CUDA (the device is "
                f"{device}): use --runner eager, or run on a CUDA device"
            )
        if "graph" in runners:
            notes.append(NO_CUDA_NOTE)
        runners = ("eager",)
    check_lead_in(cfg.tune_lead_in, device, tuner)
    world = parallel.world_size if parallel is not None else 1
    if world != cfg.tp:
        raise ConfigError(
            f"DecodeBenchConfig.tp={cfg.tp} but the parallel context has world_size={world}"
        )
    spec: Any = cfg.model
    if cfg.layers is not None:
        spec = fewer_layers(cfg.model, cfg.layers)
        notes.append(f"quick run: {spec.name} (not the whole model)")
    model = load_model(
        spec,
        device=device,
        dtype=dtype,
        seed=cfg.seed,
        parallel=parallel if cfg.tp > 1 else None,
    )
    mcfg = model.config
    sizes = sorted(set(cfg.batch_sizes))
    max_batch_size = sizes[-1]
    max_seq = aligned_seq_len(cfg.context + 1)
    mcfg.check_positions(cfg.context + 1, f"a decode step at context {cfg.context}")
    names = ("--batch-sizes", "--context")  # bench decode's flags, for the KV cache's errors
    cache = KVCache(mcfg, max_batch_size, max_seq, device, dtype, size_names=names)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    # Never time on zeros: random keys and values, random tokens.
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    step = build_step(model, cache)
    reducer = getattr(step, "reducer", None)
    if reducer is not None:
        notes.append(f"tensor-parallel all-reduce: {reducer.name}")
    inputs: Inputs = []
    for b in sizes:
        tokens = torch.randint(0, mcfg.vocab_size, (b,), generator=gen, device=device)
        positions = torch.full((b,), cfg.context, dtype=torch.long, device=device)
        inputs.append((tokens, positions, torch.arange(b, device=device)))
    report = DecodeBenchReport(
        config={
            **asdict(cfg),
            "device": str(device),
            "dtype": str(dtype).replace("torch.", ""),
            "runners": list(runners),
            "max_seq_len": max_seq,
        },
        model={
            "name": mcfg.name,
            "source": model.source,
            "parameters": (model.global_config or mcfg).num_parameters(),
            "weight_bytes": model.weight_bytes(),
            "kv_bytes_per_token": cache.bytes_per_token(),
            "config": asdict(model.global_config or mcfg),
            "tp": cfg.tp,
            "all_reduce": getattr(reducer, "name", None),
        },
        provenance=provenance(device=device, command=command),
        notes=notes,
    )
    results = [BatchResult(b) for b in sizes]
    report.results = results
    if on_start is not None:
        on_start(report)
    labels = phase_labels(cfg, runners, device.type == "cuda")
    with progress(labels[0], len(labels), enabled=show_progress) as task:
        bar = PhaseBar(task, labels)
        run = _Run(step, inputs, results, device, cfg, runners, report, log, bar)
        try:
            _run_phases(run, tuner)
        except Exception as exc:
            # The caller holds the report (on_start) and may keep what finished: the note says
            # where the run stopped and why.
            report.notes.append(f"failed during {bar.current}: {one_line(exc)}")
            raise
    report.derive()
    return report


def _run_phases(run: _Run, tuner: Any) -> None:
    """The timed phases, in the order of :func:`~graphtune.bench.decode_progress.phase_labels`."""
    step, cfg, device, report, log = run.step, run.cfg, run.device, run.report, run.log
    cache, mcfg = step.cache, step.model.config
    bandwidth = copy_bandwidth_gbps(device)
    report.copy_bandwidth_gbps = bandwidth
    if device.type == "cuda" and not run.measure_busy:
        report.notes.append(
            "GPU-busy not measured with tp > 1: NCCL kernel durations include "
            "waiting for the other ranks."
        )

    for args, result in run.rows():
        b = result.batch_size
        if "eager" in run.runners:
            result.eager_ms = timed_ms(result, "eager_ms", lambda a=args: step(*a), device, cfg)
            log(f"batch {b}: eager {result.eager_ms:.3f} ms/step")
        if run.measure_busy:
            (
                result.busy_ms,
                result.kernels_per_step,
                result.top_kernels,
                result.kernel_families,
            ) = _busy(lambda a=args: step(*a), result.eager_ms)
        read = step_bytes(step, *args)  # an MoE step reads only the experts it routes to
        result.weight_bytes_read = read.total
        if read.experts_hit:
            result.experts_hit = list(read.experts_hit)
            result.experts_hit_uniform = expected_experts_hit(
                mcfg.num_experts, mcfg.num_experts_per_tok, b
            )
        if bandwidth:
            needed = read.total + b * kv_positions_read(cfg.context, mcfg) * cache.bytes_per_token()
            result.floor_ms = bytes_floor_ms(needed, bandwidth)
        if "eager" in run.runners:
            run.bar.done()

    if "graph" in run.runners:
        _time_graph(run)
    if cfg.compare_compile and device.type == "cuda":
        log("timing torch.compile(mode='reduce-overhead') (compiles once per batch size)")
        time_compiled(step, run.inputs, cfg, device, run.results, run.bar)
    if cfg.tune:
        _time_tuned(run, tuner)
    if cfg.compare_hf:  # last: its logits check overwrites cache slots of the untuned step
        time_hf(step, run.results, cfg, report, log)
        run.bar.done()


def _time_tuned(run: _Run, tuner: Any) -> None:
    step, cfg, device, report, log, bar = (
        run.step,
        run.cfg,
        run.device,
        run.report,
        run.log,
        run.bar,
    )
    sizes = run.sizes
    tuner = tuner if tuner is not None else default_tuner(step, device, cfg.tune_lead_in)
    tuned = build_step(
        step.model,
        step.cache,
        tuner=tuner,
        gemm_cold_l2=cfg.tune_cold_l2,
        reducer=getattr(step, "reducer", None),
    )
    report.tuning_cold_l2 = tuned.ops.gemm_cold_l2
    log(
        f"tuning the step by running it at batch buckets up to {sizes[-1]}, GEMMs timed "
        + ("with cold-L2 rotation" if tuned.ops.gemm_cold_l2 else "in place (hot L2)")
        + (f" (cache {cfg.tuning_cache})" if cfg.tuning_cache else "")
    )
    # tune=True: --tune asks for tuning, and GRAPHTUNE_CACHE_ONLY (meant for serving) would turn
    # it into look-ups that tune nothing yet save no cache.
    with autotuner.autotune(cfg.tuning_cache, tuner, tune=True):
        tuned_report = tune_step(
            tuned, log=lambda line: log(f"  {line}"), refine=cfg.refine_in_step
        )
    bar.done()
    report.tuning_seconds = tuned_report.seconds
    report.tuning_compile_seconds = tuned_report.compile_seconds
    report.tuning_compile_seconds_by_op = dict(tuned_report.compile_seconds_by_op)
    report.tuning_profiles = tuned_report.profiles_tuned
    report.tuning_picks = [list(row) for row in tuned_report.rows]
    report.tuning_fusion_checks = [dataclasses.asdict(c) for c in tuned_report.fusion_checks]
    if cfg.refine_in_step:
        report.tuning_refinements = [dataclasses.asdict(r) for r in tuned_report.refinements]
    log(f"tuning: {tuned_report.summary()}")
    if step.parallel is not None:
        report.tuning_rank_agreement = rank_agreement(tuner, step.parallel)
        log(f"tuned picks identical on every rank: {100 * report.tuning_rank_agreement:.1f}%")
    for args, result in run.rows():
        want = step(*args).float()
        got = tuned(*args).float()
        result.tuned_max_abs_diff = (got - want).abs().max().item()
        if run.measure_busy:
            (
                result.tuned_busy_ms,
                result.tuned_kernels_per_step,
                result.tuned_top_kernels,
                result.tuned_kernel_families,
            ) = _busy(lambda a=args: tuned(*a))
        bar.done()
    if "graph" in run.runners:
        runner, seconds, _ = _capture(tuned, sizes, device, report)
        bar.done()
        report.tuned_capture_seconds = seconds
        try:
            for args, result in run.rows():
                result.tuned_graph_ms = timed_ms(
                    result, "tuned_graph_ms", lambda a=args: runner(*a), device, cfg
                )
                log(f"batch {result.batch_size}: tuned graph {result.tuned_graph_ms:.3f} ms/step")
                bar.done()
        finally:
            runner.release()
    else:
        for args, result in run.rows():
            result.tuned_eager_ms = timed_ms(
                result, "tuned_eager_ms", lambda a=args: tuned(*a), device, cfg
            )
            log(f"batch {result.batch_size}: tuned eager {result.tuned_eager_ms:.3f} ms/step")
            bar.done()
    if cfg.compare_unfused:
        _time_unfused(run, tuned)
    # Look-ups of shapes never tuned ran the torch fallback (should be none).
    report.tuning_fallbacks = dict(tuner.stats.fallbacks)
    if tuner.stats.fallbacks:
        report.notes.append(
            f"tuned step: untuned shapes ran the torch fallback {dict(tuner.stats.fallbacks)}"
        )


def _time_unfused(run: _Run, tuned: DecodeStep) -> None:
    """The tuned step with its stages unfused (the step as tuned before the fused ops), on the
    same tuner's picks (``tune_step`` tuned every single op first), timed as the tuned step is:
    through its own graphs on CUDA, else eagerly."""
    cfg, device = run.cfg, run.device
    unfused = build_step(
        tuned.model,
        tuned.cache,
        tuner=tuned.tuner,
        gemm_cold_l2=tuned.ops.gemm_cold_l2,
        reducer=getattr(tuned, "reducer", None),
        fused=False,
    )
    graph = "graph" in run.runners
    runner = _capture(unfused, run.sizes, device, run.report)[0] if graph else None
    if runner is not None:
        run.bar.done()
    call = runner if runner is not None else unfused
    try:
        for args, result in run.rows():
            result.tuned_unfused_ms = timed_ms(
                result, "tuned_unfused_ms", lambda a=args: call(*a), device, cfg
            )
            if run.measure_busy:
                result.tuned_unfused_kernels_per_step = _busy(lambda a=args: unfused(*a))[1]
            kind = "graph" if graph else "eager"
            run.log(
                f"batch {result.batch_size}: tuned unfused {kind} "
                f"{result.tuned_unfused_ms:.3f} ms/step"
            )
            run.bar.done()
    finally:
        if runner is not None:
            runner.release()


def rank_agreement(tuner: Any, parallel: Any) -> float:
    """Share of this rank's cache keys whose pick equals the pick of every other rank (a
    collective over ``parallel.group``)."""
    import torch.distributed as dist

    picks = {
        json.dumps(key.to_json(), sort_keys=True, default=str): json.dumps(
            [entry.runner_id, entry.tactic], default=str
        )
        for key, entry in tuner.cache.items()
    }
    views: list[Any] = [None] * parallel.world_size
    dist.all_gather_object(views, picks, group=parallel.group)
    if not picks:
        return 1.0
    same = sum(all(view.get(key) == pick for view in views) for key, pick in picks.items())
    return same / len(picks)


def _capture(
    step: DecodeStep, sizes: list[int], device: torch.device, report: DecodeBenchReport
) -> tuple[Any, float, float]:
    """The engine's graph runner over ``step`` with every size captured; (runner, s, MiB)."""
    runner = build_runner(step, "graph", capture_sizes=sizes, device=device)
    sync(device)
    reserved = torch.cuda.memory_reserved(device)
    t0 = time.perf_counter()
    runner.capture(*step.example_inputs(step.max_batch_size))
    sync(device)
    seconds = time.perf_counter() - t0  # warm-up + capture, wall clock
    mib = (torch.cuda.memory_reserved(device) - reserved) / 2**20
    stats = runner.stats
    if stats.records and not all(r.ok for r in stats.records):
        report.notes.append(
            f"graph capture failed for some sizes"
            f"{' (tuned step)' if step.tuner is not None else ''}: "
            f"{[(r.size, r.error) for r in stats.failed_captures]}"
        )
    # The runner's own account of the shared pool, when it has one (excludes static buffers).
    if stats.pool_bytes:
        mib = stats.pool_bytes / 2**20
    return runner, seconds, mib


def _time_graph(run: _Run) -> None:
    step, cfg, device, report, log, sizes = (
        run.step,
        run.cfg,
        run.device,
        run.report,
        run.log,
        run.sizes,
    )
    runner, report.capture_seconds, report.graph_mib = _capture(step, sizes, device, report)
    run.bar.done()
    stats = runner.stats
    log(
        f"captured {len(sizes)} sizes in {report.capture_seconds:.2f} s, {report.graph_mib:.0f} MiB"
    )
    try:
        for args, result in run.rows():
            # Same inputs, same cache position: the replay must reproduce the eager logits.
            want = step(*args).float()
            got = runner(*args).float()
            result.graph_max_abs_diff = (got - want).abs().max().item()
            result.graph_ms = timed_ms(result, "graph_ms", lambda a=args: runner(*a), device, cfg)
            log(f"batch {result.batch_size}: graph {result.graph_ms:.3f} ms/step")
            run.bar.done()
        report.runner_stats = stats.table()
        report.runner_stats_detail = stats.as_dict()
    finally:
        runner.release()
