"""The decode benchmark behind ``graphtune bench decode``.

For each batch size it times the engine's decode step eagerly, through a ``CUDAGraphRunner`` (with
its copy-in, padding and slicing: what a server pays), and optionally through
``torch.compile(mode="reduce-overhead")``; it reads the GPU-busy time of one step from
``torch.profiler`` (sum of device kernel durations, median of several steps) and computes the
bytes floor: weights plus the KV cache a step must read, over a measured device copy bandwidth.

With ``tune=True`` the same run then tunes every op of the step for the batch buckets
(:func:`graphtune.ops.tuning.tune_ops`, attention included; a cache file is reused when given),
and times the tuned step the same way: through a graph runner on CUDA (else eagerly), with its
GPU-busy time, top kernels and its ratios to the untuned step and to the bytes floor.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from graphtune.engine.engine import step_pad_rule
from graphtune.engine.kv_cache import KVCache
from graphtune.engine.loading import load_model
from graphtune.engine.provenance import provenance
from graphtune.engine.step import DecodeStep
from graphtune.errors import ConfigError

logger = logging.getLogger(__name__)

NO_CUDA_NOTE = "CUDA is not available: CUDA graphs need CUDA, so only the eager step is timed."


@dataclass(frozen=True)
class DecodeBenchConfig:
    """What ``bench decode`` measures.

    Attributes:
        model: Checkpoint folder or preset name.
        batch_sizes: Batch sizes to time (each is also a captured size).
        context: Tokens already in the cache for every request (attention length).
        steps: Decode steps per timed repeat.
        repeats: Timed repeats; the median is reported.
        runners: Subset of ``("eager", "graph")``.
        compare_compile: Also time ``torch.compile(mode="reduce-overhead")`` of the same step.
        device: ``"auto"`` (CUDA when present), ``"cuda"``, ``"cuda:1"``, ``"cpu"``...
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU) or a torch dtype name.
        seed: Seed for random weights, tokens and cache contents.
        tune: Also tune the step's ops and time the tuned step beside the untuned one.
        tuning_cache: Tuning cache file for ``tune`` (loaded when present, saved after).
        tune_cold_l2: With ``tune``, time the GEMMs with cold-L2 rotation (see
            :func:`graphtune.ops.tuning.tune_ops`).
        tp: Tensor-parallel degree (``run_decode_bench`` then needs a matching ``parallel``
            context; every rank runs the same benchmark and times its own shard). With ``tune``
            the ranks tune with the ``agree`` strategy and the report says whether every rank
            holds the same picks.
    """

    model: str = "llama-1b-shape"
    batch_sizes: tuple[int, ...] = (1, 8, 32, 128)
    context: int = 512
    steps: int = 20
    repeats: int = 5
    runners: tuple[str, ...] = ("eager", "graph")
    compare_compile: bool = False
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    tune: bool = False
    tuning_cache: str | None = None
    tune_cold_l2: bool = False
    tp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"tp must be >= 1, got {self.tp}")
        if self.tp > 1 and self.compare_compile:
            raise ConfigError(
                "--compare-compile is not supported with --tp > 1; drop it to time "
                "the tensor-parallel step"
            )
        if not self.batch_sizes or min(self.batch_sizes) <= 0:
            raise ConfigError(f"batch sizes must be positive, got {self.batch_sizes}")
        if self.context < 0 or self.steps <= 0 or self.repeats <= 0:
            raise ConfigError("context must be >= 0 and steps, repeats > 0")
        bad = set(self.runners) - {"eager", "graph"}
        if bad or not self.runners:
            raise ConfigError(f"runners must be a non-empty subset of eager, graph; got {bad}")


@dataclass
class BatchResult:
    """Measurements for one batch size (milliseconds per decode step unless named otherwise)."""

    batch_size: int
    eager_ms: float | None = None
    graph_ms: float | None = None
    compile_ms: float | None = None
    busy_ms: float | None = None
    floor_ms: float | None = None
    speedup: float | None = None
    graph_over_busy: float | None = None
    tokens_per_s: float | None = None
    graph_max_abs_diff: float | None = None
    compile_note: str | None = None
    kernels_per_step: float | None = None
    top_kernels: list[dict[str, Any]] = field(default_factory=list)
    # With ``tune``: the tuned step, timed like the untuned one (graph on CUDA, else eager).
    tuned_graph_ms: float | None = None
    tuned_eager_ms: float | None = None
    tuned_busy_ms: float | None = None
    tuned_over_untuned: float | None = None
    tuned_over_floor: float | None = None
    tuned_max_abs_diff: float | None = None
    tuned_kernels_per_step: float | None = None
    tuned_top_kernels: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class DecodeBenchReport:
    """Everything ``bench decode`` measured, ready for a table, a plot or JSON."""

    config: dict[str, Any]
    model: dict[str, Any]
    provenance: dict[str, Any]
    results: list[BatchResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    copy_bandwidth_gbps: float | None = None
    capture_seconds: float | None = None
    graph_mib: float | None = None
    runner_stats: str | None = None
    runner_stats_detail: dict[str, Any] | None = None
    tuning_seconds: float | None = None
    tuning_compile_seconds: float | None = None
    tuning_profiles: int | None = None
    tuning_fallbacks: dict[str, int] | None = None
    tuning_picks: list[list[Any]] | None = None
    tuning_rank_agreement: float | None = None
    tuned_capture_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        out = asdict(self)
        out["results"] = [asdict(r) for r in self.results]
        return out


def resolve_device(device: str) -> torch.device:
    """``"auto"`` becomes CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``"auto"`` becomes bfloat16 on CUDA and float32 elsewhere; else a torch dtype name."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32")
    return value


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call_ms(
    fn: Callable[[], Any], device: torch.device, steps: int, repeats: int, warmup: int = 3
) -> float:
    """Median over ``repeats`` of the mean time of ``steps`` back-to-back calls (ms per call).

    CUDA events bracket the calls on the GPU, so host-bound eager steps are measured as the GPU
    sees them (idle gaps included), and graph replays are not charged a synchronisation each.
    """
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(samples)


def gpu_busy_ms(
    fn: Callable[[], Any], device: torch.device, repeats: int = 5, top: int = 8
) -> tuple[float | None, float | None, list[dict[str, Any]]]:
    """GPU-busy time of one call and where it goes, from ``torch.profiler`` (CUPTI).

    Args:
        fn: One decode step.
        device: Its device.
        repeats: Profiled calls; the busy time is their median.
        top: How many kernels to list.

    Returns:
        The median summed device-kernel time of one call in ms (``None`` when the profiler
        records no device activity, e.g. without CUPTI), the device activities (kernels,
        copies) per call, and the ``top`` kernels by device time per call:
        ``{"name", "calls", "us", "share"}`` averaged over the profiled calls.
    """
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync(device)
    samples = []
    by_name: dict[str, list[float]] = {}
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            _sync(device)
        total_us = 0.0
        for event in prof.events():
            # Kernels, memcpys and memsets run on the device; GPU-side user annotations span
            # other events and would count them twice.
            if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(
                event, "is_user_annotation", False
            ):
                elapsed = event.time_range.elapsed_us()
                total_us += elapsed
                entry = by_name.setdefault(event.name, [0.0, 0.0])
                entry[0] += elapsed
                entry[1] += 1
        if total_us > 0:
            samples.append(total_us / 1e3)
    if not samples:
        return None, None, []
    busy_us = sum(v[0] for v in by_name.values()) / repeats
    kernels = [
        {
            "name": name,
            "calls": count / repeats,
            "us": total / repeats,
            "share": total / repeats / busy_us,
        }
        for name, (total, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    ]
    launches = sum(count for _, count in by_name.values()) / repeats
    return statistics.median(samples), launches, kernels


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = time_per_call_ms(lambda: dst.copy_(src), device, steps=10, repeats=5)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _compile_skips() -> int | None:
    # The counter inductor bumps when reduce-overhead declines to use CUDA graphs for a graph.
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return int(counters["inductor"].get("cudagraph_skips", 0))


def _time_compiled(
    step: DecodeStep,
    inputs: Sequence[tuple[torch.Tensor, ...]],
    cfg: DecodeBenchConfig,
    device: torch.device,
    results: list[BatchResult],
) -> None:
    def plain(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return step(tokens, positions, slots)

    compiled = torch.compile(plain, mode="reduce-overhead", dynamic=False)
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)

    def call(args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if mark is not None:
            mark()
        return compiled(*args)

    for args, result in zip(inputs, results, strict=True):
        before = _compile_skips()
        t0 = time.perf_counter()
        try:
            call(args)
            _sync(device)
            compile_s = time.perf_counter() - t0
            result.compile_ms = time_per_call_ms(
                lambda a=args: call(a), device, cfg.steps, cfg.repeats
            )
        except Exception as exc:  # any compiler failure is a result to report, not a crash
            logger.warning("torch.compile failed at batch %d: %s", result.batch_size, exc)
            result.compile_note = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            continue
        after = _compile_skips()
        skipped = before is not None and after is not None and after > before
        result.compile_note = f"compiled in {compile_s:.1f} s; " + (
            "skipped cudagraphs (see TORCH_LOGS=perf_hints)" if skipped else "cudagraphs used"
        )


@torch.inference_mode()
def run_decode_bench(
    cfg: DecodeBenchConfig,
    log: Callable[[str], None] = logger.info,
    *,
    tuner: Any = None,
    parallel: Any = None,
) -> DecodeBenchReport:
    """Runs the decode benchmark described by ``cfg``.

    Args:
        cfg: What to measure.
        log: Where progress lines go.
        tuner: The :class:`~graphtune.autotuner.AutoTuner` for ``cfg.tune`` (a new one when
            ``None``).
        parallel: The :class:`~graphtune.engine.parallel.ParallelContext` when ``cfg.tp > 1``
            (its ``world_size`` must equal ``cfg.tp``). Every rank must call this with the same
            ``cfg``: the steps, captures and timings run the same collectives in the same order.

    Raises:
        ConfigError: ``cfg.tp`` and ``parallel`` disagree, or the model does not split.

    Returns:
        The report (per-batch results, capture seconds, graph MiB, provenance).
    """
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    runners = tuple(cfg.runners)
    notes = []
    if device.type != "cuda":
        if "graph" in runners or cfg.compare_compile:
            notes.append(NO_CUDA_NOTE)
        runners = ("eager",)
    world = parallel.world_size if parallel is not None else 1
    if world != cfg.tp:
        raise ConfigError(
            f"DecodeBenchConfig.tp={cfg.tp} but the parallel context has world_size={world}"
        )
    model = load_model(
        cfg.model,
        device=device,
        dtype=dtype,
        seed=cfg.seed,
        parallel=parallel if cfg.tp > 1 else None,
    )
    mcfg = model.config
    sizes = sorted(set(cfg.batch_sizes))
    max_batch = sizes[-1]
    max_seq = -(-(cfg.context + 1) // 16) * 16
    if cfg.context + 1 > mcfg.max_position_embeddings:
        raise ConfigError(f"context {cfg.context} exceeds the model's max_position_embeddings")
    cache = KVCache(mcfg, max_batch, max_seq, device, dtype)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    # Never time on zeros: random keys and values, random tokens.
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    if model.parallel is None:
        step = DecodeStep(model, cache, contiguous_slots=True)
    else:
        from graphtune.engine.parallel import TensorParallelDecodeStep

        step = TensorParallelDecodeStep(model, cache, contiguous_slots=True)
        notes.append(f"tensor-parallel all-reduce: {step.reducer.name}")
    inputs = []
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
            "all_reduce": getattr(getattr(step, "reducer", None), "name", None),
        },
        provenance=provenance(device),
        notes=notes,
    )
    results = [BatchResult(b) for b in sizes]
    report.results = results
    bandwidth = copy_bandwidth_gbps(device)
    report.copy_bandwidth_gbps = bandwidth
    # Summed kernel time means nothing with tp > 1: an NCCL all-reduce kernel's duration includes
    # the time it spins waiting for the other rank (seen on two H200s: 42 ms "busy" for a
    # 1.6 ms step), so GPU-busy and graph/busy are left out rather than reported wrong.
    measure_busy = device.type == "cuda" and cfg.tp == 1
    if device.type == "cuda" and not measure_busy:
        report.notes.append(
            "GPU-busy not measured with tp > 1: NCCL kernel durations include "
            "waiting for the other ranks."
        )

    for args, result in zip(inputs, results, strict=True):
        b = result.batch_size
        if "eager" in runners:
            result.eager_ms = time_per_call_ms(
                lambda a=args: step(*a), device, cfg.steps, cfg.repeats
            )
            log(f"batch {b}: eager {result.eager_ms:.3f} ms/step")
        if measure_busy:
            result.busy_ms, result.kernels_per_step, result.top_kernels = gpu_busy_ms(
                lambda a=args: step(*a), device
            )
        if bandwidth:
            needed = model.weight_bytes() + b * (cfg.context + 1) * cache.bytes_per_token()
            result.floor_ms = needed / (bandwidth * 1e9) * 1e3

    if "graph" in runners:
        _time_graph(step, cache, inputs, results, sizes, device, cfg, report, log)
    if cfg.compare_compile and device.type == "cuda":
        log("timing torch.compile(mode='reduce-overhead') (compiles once per batch size)")
        _time_compiled(step, inputs, cfg, device, results)
    if cfg.tune:
        _time_tuned(
            step, cache, inputs, results, sizes, device, dtype, cfg, runners, report, log, tuner
        )

    for result in results:
        best = result.graph_ms or result.eager_ms
        if result.graph_ms and result.eager_ms:
            result.speedup = result.eager_ms / result.graph_ms
        if result.graph_ms and result.busy_ms:
            result.graph_over_busy = result.graph_ms / result.busy_ms
        if best:
            result.tokens_per_s = result.batch_size / (best * 1e-3)
    return report


def _time_tuned(
    step: DecodeStep,
    cache: KVCache,
    inputs: list,
    results: list[BatchResult],
    sizes: list[int],
    device: torch.device,
    dtype: torch.dtype,
    cfg: DecodeBenchConfig,
    runners: tuple[str, ...],
    report: DecodeBenchReport,
    log: Callable[[str], None],
    tuner: Any,
) -> None:
    from graphtune.autotuner import AutoTuner, DistributedTuning, autotune
    from graphtune.ops.tuning import ALL_GROUPS, OpDims, tune_ops

    parallel = step.parallel
    if tuner is None:
        # Shards must run the same kernels: time everything on every rank, slowest rank counts.
        tuner = (
            AutoTuner()
            if parallel is None
            else AutoTuner(distributed=DistributedTuning("agree", parallel.group))
        )
    log(
        f"tuning the step's ops for batch buckets up to {sizes[-1]}"
        + (f" (cache {cfg.tuning_cache})" if cfg.tuning_cache else "")
    )
    with autotune(cfg.tuning_cache, tuner):
        tuned_report = tune_ops(
            OpDims.from_model_config(step.model.config),
            sizes[-1],
            device=device,
            dtype=dtype,
            tuner=tuner,
            ops=ALL_GROUPS,
            max_seq_len=cache.max_seq_len,
            on_op=lambda name: log(f"  tuning {name}"),
            gemm_cold_l2=cfg.tune_cold_l2,
        )
    report.tuning_seconds = tuned_report.seconds
    report.tuning_compile_seconds = tuned_report.compile_seconds
    report.tuning_profiles = len(tuned_report.rows)
    report.tuning_picks = [list(row) for row in tuned_report.rows]
    log(
        f"tuned {len(tuned_report.rows)} (op, bucket) profiles in {tuned_report.seconds:.1f} s "
        f"({tuned_report.compile_seconds:.1f} s compiling)"
    )
    if parallel is not None:
        report.tuning_rank_agreement = _rank_agreement(tuner, parallel)
        log(f"tuned picks identical on every rank: {100 * report.tuning_rank_agreement:.1f}%")
        from graphtune.engine.parallel import TensorParallelDecodeStep

        tuned: DecodeStep = TensorParallelDecodeStep(
            step.model, cache, contiguous_slots=True, tuner=tuner, reducer=step.reducer
        )
    else:
        tuned = DecodeStep(step.model, cache, contiguous_slots=True, tuner=tuner)
    for args, result in zip(inputs, results, strict=True):
        want = step(*args).float()
        got = tuned(*args).float()
        result.tuned_max_abs_diff = (got - want).abs().max().item()
        if device.type == "cuda":
            result.tuned_busy_ms, result.tuned_kernels_per_step, result.tuned_top_kernels = (
                gpu_busy_ms(lambda a=args: tuned(*a), device)
            )
    if "graph" in runners:
        runner, seconds, _ = _capture(tuned, cache, sizes, device, report)
        report.tuned_capture_seconds = seconds
        for args, result in zip(inputs, results, strict=True):
            result.tuned_graph_ms = time_per_call_ms(
                lambda a=args: runner(*a), device, cfg.steps, cfg.repeats
            )
            log(f"batch {result.batch_size}: tuned graph {result.tuned_graph_ms:.3f} ms/step")
        runner.release()
    else:
        for args, result in zip(inputs, results, strict=True):
            result.tuned_eager_ms = time_per_call_ms(
                lambda a=args: tuned(*a), device, cfg.steps, cfg.repeats
            )
            log(f"batch {result.batch_size}: tuned eager {result.tuned_eager_ms:.3f} ms/step")
    for result in results:
        if result.tuned_graph_ms and result.graph_ms:
            result.tuned_over_untuned = result.tuned_graph_ms / result.graph_ms
        elif result.tuned_eager_ms and result.eager_ms:
            result.tuned_over_untuned = result.tuned_eager_ms / result.eager_ms
        if result.tuned_graph_ms and result.floor_ms:
            result.tuned_over_floor = result.tuned_graph_ms / result.floor_ms
    # Look-ups of shapes never tuned ran the torch fallback (should be none).
    report.tuning_fallbacks = dict(tuner.stats.fallbacks)
    if tuner.stats.fallbacks:
        report.notes.append(
            f"tuned step: untuned shapes ran the torch fallback {dict(tuner.stats.fallbacks)}"
        )


def _rank_agreement(tuner: Any, parallel: Any) -> float:
    """Share of this rank's cache keys whose pick equals the pick of every other rank."""
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
    step: DecodeStep,
    cache: KVCache,
    sizes: list[int],
    device: torch.device,
    report: DecodeBenchReport,
) -> tuple[Any, float, float]:
    """A graph runner over ``step`` with every size captured; (runner, seconds, MiB)."""
    from graphtune.graphs import CUDAGraphRunner

    runner = CUDAGraphRunner(
        step,
        max_batch_size=sizes[-1],
        capture_sizes=sizes,
        pad=step_pad_rule(cache.scratch_slot),
        device=device,
    )
    example = (
        torch.zeros(sizes[-1], dtype=torch.long, device=device),
        torch.zeros(sizes[-1], dtype=torch.long, device=device),
        torch.full((sizes[-1],), cache.scratch_slot, dtype=torch.long, device=device),
    )
    _sync(device)
    reserved = torch.cuda.memory_reserved(device)
    t0 = time.perf_counter()
    runner.capture(*example)
    _sync(device)
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


def _time_graph(
    step: DecodeStep,
    cache: KVCache,
    inputs: list,
    results: list[BatchResult],
    sizes: list[int],
    device: torch.device,
    cfg: DecodeBenchConfig,
    report: DecodeBenchReport,
    log: Callable[[str], None],
) -> None:
    runner, report.capture_seconds, report.graph_mib = _capture(step, cache, sizes, device, report)
    stats = runner.stats
    log(
        f"captured {len(sizes)} sizes in {report.capture_seconds:.2f} s, {report.graph_mib:.0f} MiB"
    )
    for args, result in zip(inputs, results, strict=True):
        # Same inputs, same cache position: the replay must reproduce the eager logits.
        want = step(*args).float()
        got = runner(*args).float()
        result.graph_max_abs_diff = (got - want).abs().max().item()
        result.graph_ms = time_per_call_ms(
            lambda a=args: runner(*a), device, cfg.steps, cfg.repeats
        )
        log(f"batch {result.batch_size}: graph {result.graph_ms:.3f} ms/step")
    report.runner_stats = stats.table()
    report.runner_stats_detail = stats.as_dict()
    runner.release()


def format_report(report: DecodeBenchReport) -> str:
    """The per-batch table plus capture and bandwidth lines, for people."""
    from graphtune.reporting import render_table

    compile_cols = any(r.compile_ms is not None or r.compile_note for r in report.results)
    tuned_cols = report.tuning_seconds is not None
    tuned_graph = any(r.tuned_graph_ms is not None for r in report.results)
    columns = [
        "batch",
        "eager ms",
        "graph ms",
        "GPU-busy ms",
        "speed-up",
        "graph/busy",
        "tokens/s",
        "floor ms",
    ]
    if compile_cols:
        columns.append("compile ms")
    if tuned_cols:
        columns += [
            "tuned graph ms" if tuned_graph else "tuned eager ms",
            "tuned busy ms",
            "tuned/untuned",
            "tuned/floor",
        ]
    rows = []
    for r in report.results:
        row: list[Any] = [
            r.batch_size,
            r.eager_ms,
            r.graph_ms,
            r.busy_ms,
            r.speedup,
            r.graph_over_busy,
            round(r.tokens_per_s) if r.tokens_per_s else None,
            r.floor_ms,
        ]
        if compile_cols:
            row.append(r.compile_ms)
        if tuned_cols:
            row += [
                r.tuned_graph_ms if tuned_graph else r.tuned_eager_ms,
                r.tuned_busy_ms,
                r.tuned_over_untuned,
                r.tuned_over_floor,
            ]
        rows.append(row)
    cfg = report.config
    params = report.model["parameters"]
    size = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.2f} M"
    title = (
        f"decode step: {report.model['name']} ({size} params), context {cfg['context']}, "
        f"{cfg['dtype']}, {cfg['device']}"
    )
    lines = [render_table(title, columns, rows)]
    if report.capture_seconds is not None:
        lines.append(
            f"capture: {report.capture_seconds:.2f} s for {len(report.results)} sizes, "
            f"graph memory {report.graph_mib:.1f} MiB"
        )
    if report.copy_bandwidth_gbps:
        lines.append(
            f"device copy bandwidth (read+write): {report.copy_bandwidth_gbps:.0f} GB/s; "
            "floor = (weights + KV read) / bandwidth"
        )
    first = report.results[0] if report.results else None
    if first is not None and first.top_kernels:
        rows = [[k["name"][:70], k["calls"], k["us"], 100 * k["share"]] for k in first.top_kernels]
        launches = first.kernels_per_step
        kernels = f", {launches:.0f} device activities" if launches else ""
        lines.append(
            render_table(
                f"where the GPU time goes at batch {first.batch_size} "
                f"(profiler, per step{kernels})",
                ["kernel", "calls", "us", "% busy"],
                rows,
            )
        )
    if tuned_cols:
        fallbacks = report.tuning_fallbacks or {}
        lines.append(
            f"tuning: {report.tuning_profiles} (op, bucket) profiles tuned in "
            f"{report.tuning_seconds:.1f} s ({report.tuning_compile_seconds:.1f} s compiling); "
            + (f"untuned shapes fell back: {fallbacks}" if fallbacks else "no fallbacks")
        )
        diffs = [r.tuned_max_abs_diff for r in report.results if r.tuned_max_abs_diff is not None]
        if diffs:
            lines.append(f"tuned vs untuned step logits: max abs diff {max(diffs):.3g}")
    if first is not None and first.tuned_top_kernels:
        rows = [
            [k["name"][:70], k["calls"], k["us"], 100 * k["share"]] for k in first.tuned_top_kernels
        ]
        launches = first.tuned_kernels_per_step
        kernels = f", {launches:.0f} device activities" if launches else ""
        lines.append(
            render_table(
                f"tuned step: where the GPU time goes at batch {first.batch_size} "
                f"(profiler, per step{kernels})",
                ["kernel", "calls", "us", "% busy"],
                rows,
            )
        )
    for r in report.results:
        if r.compile_note:
            lines.append(f"torch.compile batch {r.batch_size}: {r.compile_note}")
    lines.extend(report.notes)
    return "\n".join(lines)


def plot_report(report: DecodeBenchReport, path: str) -> None:
    """Saves ms/step vs batch size per runner, with the GPU-busy line and the bytes floor.

    Raises:
        ConfigError: matplotlib is not installed (the message says how to get it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(
            "--plot needs matplotlib: pip install 'graphtune[plot]' (or drop --plot)"
        ) from exc
    sizes = [r.batch_size for r in report.results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [
        ("eager", "eager_ms", "o-"),
        ("graph runner", "graph_ms", "s-"),
        ("torch.compile reduce-overhead", "compile_ms", "^-"),
        ("tuned graph runner", "tuned_graph_ms", "D-"),
        ("GPU-busy (profiler)", "busy_ms", "k--"),
        ("bytes floor", "floor_ms", "k:"),
    ]
    for label, attr, style in series:
        points = [
            (s, getattr(r, attr))
            for s, r in zip(sizes, report.results, strict=True)
            if getattr(r, attr) is not None
        ]
        if points:
            ax.plot(*zip(*points, strict=True), style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per decode step")
    gpu = report.provenance.get("gpu_name") or report.config["device"]
    ax.set_title(f"{report.model['name']} decode step on {gpu}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
