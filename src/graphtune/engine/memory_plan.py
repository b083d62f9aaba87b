"""A KV cache sized to the memory left: the engine's memory plan (``gpu_memory_utilization``).

The engine may use ``fraction x total`` bytes of the device. Before it allocates its KV cache it
profiles what else it will hold (:func:`profile_step_memory`): the decode and prefill steps'
constants and buffers, the peak activations of one eager decode step at the largest batch and of
the largest eager prefill call the engine packs (:func:`largest_prefill_call`: up to
``max_prefill_tokens`` tokens in prompts of the cache's length) and (when longer) of one prompt of
the cache's length, which runs as a call of its own, and the graph pools and static buffers of
capturing every decode and prefill size (the runners' own stats), and what profiling left in use
after freeing everything (:attr:`StepProfile.retained_bytes`). What remains of the budget after the
memory already in use (weights, the CUDA context, other processes) goes to the KV cache: as many
slots of the asked length as fit, up to ``max_batch_size``, plus the scratch slot
(:func:`size_kv_cache`). :class:`MemoryPlan` keeps the numbers and renders them as a table.

Profiling runs the untuned step (a tuned step's kernels may need a little more or less) on a KV
cache of ``max_batch_size`` slots whose layers all view one layer's memory, so profiling itself
needs only ``1 / num_layers`` of that cache. The memory report is passed in
(:mod:`graphtune.engine.memory_report`; its ``CudaMemoryReport`` reads ``torch.cuda``), so CPU
tests drive the sizing with a fake one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from graphtune.engine.build import (
    build_prefill_runner,
    build_prefill_step,
    build_runner,
    build_step,
)
from graphtune.engine.kv_cache import KVCache, kv_bytes_per_token
from graphtune.engine.memory_report import CudaMemoryReport, MemoryReport
from graphtune.engine.model import DecoderModel
from graphtune.engine.prefill import pack_prompts
from graphtune.errors import ConfigError
from graphtune.reporting import render_table

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024
#: Share of the budget the device may be over after start-up before :meth:`MemoryPlan.measured`
#: warns (allocator rounding and per-stream workspaces are not planned, byte for byte).
OVER_BUDGET_TOLERANCE = 0.01


@dataclass(frozen=True)
class StepProfile:
    """What the engine holds besides weights and KV cache, measured on the untuned step.

    Attributes:
        batch: Decode batch profiled (the largest).
        prefill_tokens: Tokens of the largest prefill call profiled (0: none profiled).
        step_bytes: Step constants and buffers (RoPE tables, the prefill attention buffer).
        activation_bytes: Peak bytes above the steps of one eager decode step at ``batch`` or
            the eager prefill calls profiled, whichever is largest.
        graph_bytes: Graph pools plus static buffers of the decode and prefill runners.
        retained_bytes: Device bytes in use after profiling (everything it built freed, the
            allocator's cache emptied) beyond those in use before it: segments the caching
            allocator kept although they hold no tensor, and memory outside the allocator that
            the first kernels took (library workspaces, loaded kernel code). The engine keeps
            paying for both, so the KV cache gets less.
    """

    batch: int
    prefill_tokens: int
    step_bytes: int
    activation_bytes: int
    graph_bytes: int
    retained_bytes: int = 0

    @property
    def planned_bytes(self) -> int:
        """Everything profiled that the KV cache cannot use."""
        return self.step_bytes + self.activation_bytes + self.graph_bytes + self.retained_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """How the engine's share of the device is spent (see the module docstring).

    Attributes:
        fraction: ``gpu_memory_utilization``.
        total_bytes: The device's memory.
        in_use_bytes: In use before the engine allocated anything (total - free): the weights,
            the CUDA context, other processes.
        weights_bytes: The model's weights (part of ``in_use_bytes`` when already on the device).
        profile: The profiled steps, activations and graphs.
        seq_len: KV cache length per slot (the asked ``max_seq_len``).
        slot_bytes: KV bytes of one slot of ``seq_len`` positions.
        slots: Slots the cache got (live requests), besides the scratch slot.
        asked_slots: ``max_batch_size`` asked for.
        measured_in_use_bytes: Device bytes in use after the engine started (None until then).
    """

    fraction: float
    total_bytes: int
    in_use_bytes: int
    weights_bytes: int
    profile: StepProfile
    seq_len: int
    slot_bytes: int
    slots: int
    asked_slots: int
    measured_in_use_bytes: int | None = None

    @property
    def budget_bytes(self) -> int:
        """``fraction x total``: what the engine may use, weights and context included."""
        return int(self.fraction * self.total_bytes)

    @property
    def kv_bytes(self) -> int:
        """The KV cache: ``slots`` plus the scratch slot."""
        return (self.slots + 1) * self.slot_bytes

    @property
    def headroom_bytes(self) -> int:
        """Budget left after everything planned."""
        return self.budget_bytes - self.in_use_bytes - self.profile.planned_bytes - self.kv_bytes

    def measured(self, report: MemoryReport) -> MemoryPlan:
        """This plan with the device bytes in use now (after start-up) from ``report``.

        Logs a warning with the plan's table when more than :data:`OVER_BUDGET_TOLERANCE` of
        the budget is in use beyond it, so an engine never exceeds its budget silently.
        """
        report.settle()
        free, total = report.device_bytes()
        plan = replace(self, measured_in_use_bytes=total - free)
        if plan.over_budget_bytes > OVER_BUDGET_TOLERANCE * plan.budget_bytes:
            logger.warning(
                "memory plan: %.0f MiB in use after start-up, %.0f MiB over the budget of "
                "gpu_memory_utilization=%g. Memory this process held before the engine started "
                "(allocator caches of earlier GPU work that it could not return) is a usual "
                "cause; start the engine in a fresh process or lower gpu_memory_utilization.\n%s",
                plan.measured_in_use_bytes / _MIB,
                plan.over_budget_bytes / _MIB,
                plan.fraction,
                plan.table(),
            )
        return plan

    @property
    def over_budget_bytes(self) -> int:
        """Bytes in use after start-up beyond the budget (0 before :meth:`measured`)."""
        if self.measured_in_use_bytes is None:
            return 0
        return max(0, self.measured_in_use_bytes - self.budget_bytes)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly numbers (bytes)."""
        profile = self.profile
        return {
            "gpu_memory_utilization": self.fraction,
            "total_bytes": self.total_bytes,
            "budget_bytes": self.budget_bytes,
            "in_use_bytes": self.in_use_bytes,
            "weights_bytes": self.weights_bytes,
            "step_bytes": profile.step_bytes,
            "activation_bytes": profile.activation_bytes,
            "graph_bytes": profile.graph_bytes,
            "retained_bytes": profile.retained_bytes,
            "kv_bytes": self.kv_bytes,
            "headroom_bytes": self.headroom_bytes,
            "slots": self.slots,
            "asked_slots": self.asked_slots,
            "seq_len": self.seq_len,
            "slot_bytes": self.slot_bytes,
            "profiled_batch": profile.batch,
            "profiled_prefill_tokens": profile.prefill_tokens,
            "measured_in_use_bytes": self.measured_in_use_bytes,
        }

    def table(self) -> str:
        """The plan for people: one row per part, MiB and share of the budget."""
        profile, budget = self.profile, self.budget_bytes

        def row(name: str, nbytes: int) -> tuple[str, float, str]:
            return (name, nbytes / _MIB, f"{100.0 * nbytes / budget:.1f}" if budget else "-")

        rows = [
            row(f"budget ({self.fraction:g} of {self.total_bytes / 2**30:.1f} GiB)", budget),
            row("  weights", self.weights_bytes),
            row("  other in use at start (CUDA context, other processes)", self._other_bytes),
            row("  step constants and buffers", profile.step_bytes),
            row(
                f"  activations (eager decode at {profile.batch}, prefill of "
                f"{profile.prefill_tokens} tokens)",
                profile.activation_bytes,
            ),
            row("  CUDA graphs (pools and static buffers)", profile.graph_bytes),
            row(
                "  kept after profiling (allocator segments, library memory)",
                profile.retained_bytes,
            ),
            row(
                f"  KV cache ({self.slots} slots + scratch x {self.seq_len} positions, "
                f"{self.asked_slots} asked)",
                self.kv_bytes,
            ),
            row("  headroom", self.headroom_bytes),
        ]
        if self.measured_in_use_bytes is not None:
            rows.append(row("measured in use after start-up", self.measured_in_use_bytes))
        return render_table("memory plan", ["part", "MiB", "% of budget"], rows)

    @property
    def _other_bytes(self) -> int:
        return max(0, self.in_use_bytes - self.weights_bytes)


def size_kv_cache(
    *,
    fraction: float,
    total_bytes: int,
    in_use_bytes: int,
    profile: StepProfile,
    slot_bytes: int,
    asked_slots: int,
    seq_len: int,
) -> int:
    """Slots of ``seq_len`` positions that fit in ``fraction x total`` after everything else,
    up to ``asked_slots`` (the scratch slot is counted on top).

    Raises:
        ConfigError: Not even one slot (and the scratch slot) fits.
    """
    budget = int(fraction * total_bytes)
    other = profile.planned_bytes
    left = budget - in_use_bytes - other
    slots = left // slot_bytes - 1 if slot_bytes > 0 else asked_slots
    if slots < 1:
        raise ConfigError(
            f"gpu_memory_utilization={fraction:g} gives the engine {budget / _MIB:.0f} MiB of "
            f"{total_bytes / _MIB:.0f} MiB; {in_use_bytes / _MIB:.0f} MiB are in use already "
            "(weights, CUDA context, other processes) and the steps, activations, graphs and "
            f"what profiling kept need {other / _MIB:.0f} MiB, which leaves "
            f"{max(left, 0) / _MIB:.0f} MiB for the KV cache, less than one slot of "
            f"max_seq_len={seq_len} plus the scratch slot "
            f"({2 * slot_bytes / _MIB:.1f} MiB); raise gpu_memory_utilization, lower "
            "max_seq_len, or lower max_batch_size and max_prefill_tokens (activations and "
            "graphs grow with them)"
        )
    return min(slots, asked_slots)


def check_fraction(fraction: Any) -> float:
    """``fraction`` as a float in (0, 1].

    Raises:
        ConfigError: It is not a number in (0, 1].
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ConfigError(f"gpu_memory_utilization must be a number in (0, 1], got {fraction!r}")
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(
            f"gpu_memory_utilization must be in (0, 1] (the share of the device's memory the "
            f"engine may use, e.g. 0.9), got {fraction!r}"
        )
    return float(fraction)


def model_bytes(model: DecoderModel) -> int:
    """Bytes of every weight of ``model`` (a tied LM head counted once)."""
    tensors = [model.embed, model.final_norm]
    if model.lm_head is not model.embed:
        tensors.append(model.lm_head)
    for layer in model.layers:
        tensors.extend(layer.tensors().values())
    return sum(t.numel() * t.element_size() for t in tensors)


def _peak(report: MemoryReport, run: Any) -> int:
    """Peak bytes ``run()`` allocated above what was allocated before it."""
    report.settle()
    report.reset_peak()
    before = report.allocated_bytes()
    run()
    report.settle()
    return max(0, report.peak_allocated_bytes() - before)


def _graph_bytes(runner: Any, example: tuple) -> int:
    runner.capture(*example)
    stats = runner.stats
    nbytes = stats.pool_bytes + stats.buffer_bytes
    runner.release()
    return int(nbytes)


@torch.inference_mode()
def profile_step_memory(
    model: DecoderModel,
    *,
    batch: int,
    seq_len: int,
    report: MemoryReport,
    runner: str,
    prefill_runner: str,
    max_prefill_tokens: int,
    capture_sizes: Any = None,
    backend: Any = None,
) -> StepProfile:
    """Measures what the untuned steps hold and allocate at ``batch`` rows and
    ``max_prefill_tokens`` tokens, and what capturing them (runner ``"graph"``) adds; everything
    it built is freed before it returns."""
    report.settle()
    profile = _measure(
        model,
        batch,
        seq_len,
        report,
        runner,
        prefill_runner,
        max_prefill_tokens,
        capture_sizes,
        backend,
    )
    report.settle()
    return profile


def _measure(
    model: DecoderModel,
    batch: int,
    seq_len: int,
    report: MemoryReport,
    runner: str,
    prefill_runner: str,
    max_prefill_tokens: int,
    capture_sizes: Any,
    backend: Any,
) -> StepProfile:
    device = model.device
    cache = KVCache(model.config, batch, seq_len, device, model.dtype, shared_layers=True)
    before = report.allocated_bytes()
    step = build_step(model, cache)
    prefill_step = build_prefill_step(step, max_prefill_tokens)
    step_bytes = max(0, report.allocated_bytes() - before)
    activations = _peak(report, lambda: step(*step.example_inputs(batch)))
    # The largest call plan_chunks can pack, all in the scratch slot; and a prompt longer than a
    # call holds, which runs eagerly as a call of its own.
    calls = [largest_prefill_call(seq_len, max_prefill_tokens, batch)]
    calls += [[seq_len]] if seq_len > max_prefill_tokens else []
    prefill_tokens = 0
    for lengths in calls:
        prompts = [[0] * length for length in lengths]
        packed = pack_prompts(prompts, [cache.scratch_slot] * len(prompts))
        prefill_step.set_batch(packed.batch)
        inputs = packed.inputs.to(device)
        activations = max(activations, _peak(report, lambda i=inputs: prefill_step(*i[:4])))
        prefill_tokens = max(prefill_tokens, packed.batch.tokens)
    graphs = 0
    if runner == "graph":
        decode = build_runner(step, "graph", capture_sizes=capture_sizes, backend=backend)
        graphs += _graph_bytes(decode, step.example_inputs(batch))
    if prefill_runner == "graph":
        prefill = build_prefill_runner(prefill_step, "graph", backend=backend)
        graphs += _graph_bytes(prefill, prefill_step.example_inputs(max_prefill_tokens))
    return StepProfile(batch, prefill_tokens, step_bytes, activations, graphs)


def largest_prefill_call(seq_len: int, max_tokens: int, max_prompts: int) -> list[int]:
    """Prompt lengths of the largest call :func:`~graphtune.engine.prefill.plan_chunks` packs:
    up to ``max_tokens`` tokens in at most ``max_prompts`` prompts of at most ``seq_len`` each.

    The prompts are as long as a slot holds (the last one takes what is left), since a longer
    prompt's attention needs more memory than two shorter ones of the same tokens.
    """
    length = min(seq_len, max_tokens)
    full, rest = divmod(max_tokens, length)
    lengths = [length] * full + ([rest] if rest else [])
    return lengths[: max(1, max_prompts)]


def plan_memory(
    model: DecoderModel,
    fraction: float,
    report: MemoryReport | None = None,
    *,
    max_batch_size: int,
    seq_len: int,
    runners: tuple[str, str],
    max_prefill_tokens: int,
    capture_sizes: Any = None,
    backend: Any = None,
) -> tuple[MemoryPlan, MemoryReport]:
    """Profiles the steps and sizes the KV cache to ``fraction`` of the device (module docstring).

    Args:
        report: Where device memory is read; default :class:`CudaMemoryReport` of the model's
            device.
        runners: The decode and the prefill runner kinds (``"graph"`` profiles the graphs).

    Returns:
        The plan, and the report it read (for :meth:`MemoryPlan.measured` after start-up).

    Raises:
        ConfigError: ``fraction`` is not in (0, 1], the model is a tensor-parallel shard, there
            is no CUDA device to report on, or not even one slot of ``seq_len`` fits.
    """
    fraction = check_fraction(fraction)
    if model.parallel is not None:
        raise ConfigError(
            "gpu_memory_utilization is not supported for a tensor-parallel shard yet (each rank "
            "would size its own KV cache and the ranks must agree); pass max_batch_size instead"
        )
    if report is None:
        report = CudaMemoryReport(model.device)
    report.settle()
    free, total = report.device_bytes()
    in_use = total - free
    slot_bytes = seq_len * kv_bytes_per_token(model.config, model.dtype.itemsize)
    sizing = dict(
        fraction=fraction,
        total_bytes=total,
        in_use_bytes=in_use,
        slot_bytes=slot_bytes,
        asked_slots=max_batch_size,
        seq_len=seq_len,
    )
    # Refuse before profiling when not one slot fits even with nothing else to hold.
    size_kv_cache(profile=StepProfile(max_batch_size, 0, 0, 0, 0), **sizing)
    profile = profile_step_memory(
        model,
        batch=max_batch_size,
        seq_len=seq_len,
        report=report,
        runner=runners[0],
        prefill_runner=runners[1],
        max_prefill_tokens=max_prefill_tokens,
        capture_sizes=capture_sizes,
        backend=backend,
    )
    # Profiling can leave memory in use although it freed everything (empty segments the caching
    # allocator keeps, as in a process that captured graphs before; library memory of the first
    # kernels). The engine keeps paying for it, so it counts against the KV cache.
    free_after, _ = report.device_bytes()
    profile = replace(profile, retained_bytes=max(0, (total - free_after) - in_use))
    slots = size_kv_cache(profile=profile, **sizing)
    plan = MemoryPlan(
        fraction,
        total,
        in_use,
        model_bytes(model),
        profile,
        seq_len,
        slot_bytes,
        slots,
        max_batch_size,
    )
    logger.info("memory plan:\n%s", plan.table())
    return plan, report
