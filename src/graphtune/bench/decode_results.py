"""What ``graphtune bench decode`` measures and what it found: configuration and results."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from graphtune.errors import ConfigError


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
            :class:`graphtune.ops.OpContext`); ``None``: when the weights exceed the L2
            (:func:`graphtune.engine.step.weights_stream_from_memory`).
        tp: Tensor-parallel degree (``run_decode_bench`` then needs a matching ``parallel``
            context; every rank runs the same benchmark and times its own shard). With ``tune``
            the ranks tune with the ``agree`` strategy and the report says whether every rank
            holds the same picks.
        compare_hf: Also run transformers' implementation of the model on the same weight
            tensors (:mod:`graphtune.bench.decode_hf`): its eager step at every batch size, with
            a logits check against the engine's untuned step on transformers' cache, and the
            static cache + ``torch.compile(mode="reduce-overhead")`` recipe where
            ``hf_compile`` says; skipped with a note without transformers.
        hf_compile: With ``compare_hf``, whether to time the compiled recipe too (CUDA only):
            ``None`` (default) compiles dense models and times mixture-of-experts models
            eagerly only; ``True`` / ``False`` force it.
        compare_unfused: With ``tune``, also time the tuned step with its stages unfused
            (``DecodeStep(fused=False)``: the step as tuned before the fused ops), timed like
            the tuned step.
        layers: Run a preset with only its first ``layers`` layers (quick runs; the model name
            and a note say so).
        refine_in_step: With ``tune``, race each pick against its nearest rivals in the whole
            step after tuning (``tune_step(refine=True)``,
            :mod:`graphtune.engine.step_refine`); single-process steps only.
        tune_lead_in: Experimental, off by default. With ``tune``, the tuner's graph timer
            times each call right after a small PDL kernel and takes that kernel's own time off
            (``GraphTimer(lead_in=...)``: a chain of a candidate after itself overlaps under PDL
            unlike the step, :mod:`graphtune.autotuner.timing.lead_in`); needs PDL.
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
    tune_cold_l2: bool | None = None
    tp: int = 1
    compare_hf: bool = False
    compare_unfused: bool = False
    hf_compile: bool | None = None
    layers: int | None = None
    refine_in_step: bool = False
    tune_lead_in: bool = False

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"tp must be >= 1, got {self.tp}")
        if self.refine_in_step and (not self.tune or self.tp > 1):
            raise ConfigError(
                "--refine-in-step refines a tuned single-process step: add --tune, and drop it "
                "with --tp > 1"
            )
        for flag, on in (
            ("--compare-compile", self.compare_compile),
            ("--compare-hf", self.compare_hf),
        ):
            if self.tp > 1 and on:
                raise ConfigError(
                    f"{flag} is not supported with --tp > 1; drop it to time the "
                    "tensor-parallel step"
                )
        for flag, given in (
            ("--tuning-cache", self.tuning_cache is not None),
            ("--compare-unfused", self.compare_unfused),
            ("--tune-l2 cold / hot", self.tune_cold_l2 is not None),
            ("--tune-lead-in", self.tune_lead_in),
        ):
            if given and not self.tune:
                raise ConfigError(f"{flag} applies to the tuned step only: add --tune, or drop it")
        if self.hf_compile is not None and not self.compare_hf:
            raise ConfigError(
                "--hf-compile / --no-hf-compile choose how transformers runs; add --compare-hf"
            )
        if self.compare_hf and self.context < 1:
            raise ConfigError("--compare-hf prefills transformers' cache: use --context >= 1")
        if self.layers is not None and self.layers < 1:
            raise ConfigError(f"layers must be >= 1 (or None for all), got {self.layers}")
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
    # Device time by kernel family (graphtune.bench.kernel_families) of one step.
    kernel_families: dict[str, dict[str, Any]] = field(default_factory=dict)
    tuned_kernel_families: dict[str, dict[str, Any]] = field(default_factory=dict)
    # With ``compare_unfused``: the tuned step with its stages unfused, timed as the tuned step.
    tuned_unfused_ms: float | None = None
    tuned_unfused_kernels_per_step: float | None = None
    # The weights one step reads (the floor's weight part); for an MoE model the distinct
    # experts its routing selected per MoE layer, and their expectation under uniform routing.
    weight_bytes_read: int | None = None
    experts_hit: list[int] | None = None
    experts_hit_uniform: float | None = None
    # With ``compare_hf``: transformers on the same weights. ``hf_ms`` is the static cache +
    # torch.compile(mode="reduce-overhead") recipe, ``hf_eager_ms`` its eager forward; the check
    # is one decode step of both on transformers' cache; ``speedup_over_hf`` is the faster
    # transformers step over the engine's fastest (untuned or tuned, graph or eager).
    hf_ms: float | None = None
    hf_eager_ms: float | None = None
    hf_note: str | None = None
    hf_busy_ms: float | None = None
    hf_kernels_per_step: float | None = None
    hf_kernel_families: dict[str, dict[str, Any]] = field(default_factory=dict)
    hf_max_abs_diff: float | None = None
    hf_argmax_agreement: float | None = None
    speedup_over_hf: float | None = None
    # Per timed column (``"eager_ms"``...): the fastest of the repeats (``min_ms``), their
    # relative spread (``spread``, see graphtune.bench.decode_spread) and how many (``repeats``).
    repeat_spread: dict[str, dict[str, Any]] = field(default_factory=dict)


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
    tuning_compile_seconds_by_op: dict[str, float] | None = None
    tuning_profiles: int | None = None
    tuning_fallbacks: dict[str, int] | None = None
    tuning_picks: list[list[Any]] | None = None
    #: ``graphtune.engine.tuning.FusionCheck`` of each bucket compared, as dicts.
    tuning_fusion_checks: list[dict[str, Any]] | None = None
    #: ``graphtune.engine.step_refine.StepRefinement`` of each profile raced, as dicts.
    tuning_refinements: list[dict[str, Any]] | None = None
    tuning_rank_agreement: float | None = None
    #: Whether the GEMMs were timed with cold-L2 rotation (``tune_cold_l2`` resolved).
    tuning_cold_l2: bool | None = None
    tuned_capture_seconds: float | None = None

    def derive(self) -> None:
        """Fills the ratios (speed-up, graph/busy, tokens/s, tuned/untuned, tuned/floor, over
        transformers) from the measured times; a batch size not measured yet keeps ``None``."""
        for r in self.results:
            best = r.graph_ms or r.eager_ms
            if r.graph_ms and r.eager_ms:
                r.speedup = r.eager_ms / r.graph_ms
            if r.graph_ms and r.busy_ms:
                r.graph_over_busy = r.graph_ms / r.busy_ms
            if best:
                r.tokens_per_s = r.batch_size / (best * 1e-3)
            if r.tuned_graph_ms and r.graph_ms:
                r.tuned_over_untuned = r.tuned_graph_ms / r.graph_ms
            elif r.tuned_eager_ms and r.eager_ms:
                r.tuned_over_untuned = r.tuned_eager_ms / r.eager_ms
            if r.tuned_graph_ms and r.floor_ms:
                r.tuned_over_floor = r.tuned_graph_ms / r.floor_ms
            # The engine's fastest step, tuned or not (a tuned step can lose to the untuned graph
            # at some batch size); torch.compile and the unfused step are comparisons, not the
            # engine's own steps.
            steps = (r.graph_ms, r.eager_ms, r.tuned_graph_ms, r.tuned_eager_ms)
            ours = min((t for t in steps if t), default=None)
            hf = min((t for t in (r.hf_ms, r.hf_eager_ms) if t), default=None)
            if hf and ours:
                r.speedup_over_hf = hf / ours

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        out = asdict(self)
        out["results"] = [asdict(r) for r in self.results]
        return out
