"""The engine's factories: the decode step for a model, the prefill step over it, and the runners
that wrap them.

:class:`~graphtune.engine.Engine` builds its steps and runners here, and so do the benchmarks
(``graphtune.bench``), so what a benchmark times is what the engine serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphtune.engine.collectives import AllReduce
from graphtune.engine.kv_cache import KVCache
from graphtune.engine.model import DecoderModel
from graphtune.engine.parallel import TensorParallelDecodeStep
from graphtune.engine.prefill import PrefillStep, prefill_capture_sizes, prefill_pad_rule
from graphtune.engine.step import DecodeStep, step_pad_rule
from graphtune.errors import ConfigError
from graphtune.graphs import CapturePolicy, CUDAGraphRunner, EagerRunner, GraphBackend

#: Step runners an Engine can use.
RUNNERS = ("graph", "eager")


def build_step(
    model: DecoderModel,
    cache: KVCache,
    *,
    tuner: Any = None,
    gemm_cold_l2: bool | None = None,
    reducer: AllReduce | None = None,
    contiguous_slots: bool = True,
    fused: bool = True,
) -> DecodeStep:
    """The decode step for ``model``: :class:`DecodeStep`, or the tensor-parallel step for a
    shard.

    Args:
        model: Weights (a shard when ``model.parallel`` is set).
        cache: The KV cache the step owns (its ``max_batch_size`` bounds the tuned buckets).
        tuner: The tuner whose picks the step runs; ``None``: untuned.
        gemm_cold_l2: Tune the GEMMs with cold-L2 rotation; ``None``: when the weights exceed
            the L2 (see :class:`DecodeStep`).
        reducer: A shard's all-reduce; ``None`` builds the one its context names (collective).
        contiguous_slots: Row ``i`` owns slot ``i`` (the engine's compacted batch).
        fused: A tuned step's stages are the fused ops (``False``: their unfused sequences).

    Raises:
        ConfigError: ``reducer`` given for a model that is not sharded.
    """
    if model.parallel is None:
        if reducer is not None:
            raise ConfigError("build_step: a reducer is only for a tensor-parallel shard")
        return DecodeStep(
            model,
            cache,
            contiguous_slots=contiguous_slots,
            tuner=tuner,
            gemm_cold_l2=gemm_cold_l2,
            fused=fused,
        )
    return TensorParallelDecodeStep(
        model,
        cache,
        contiguous_slots=contiguous_slots,
        tuner=tuner,
        gemm_cold_l2=gemm_cold_l2,
        reducer=reducer,
        fused=fused,
    )


#: Spare pool block of the engine's graph runners (``CapturePolicy.pool_slack_bytes``). A decode
#: step's logits are by far the largest block of its pool; without a spare block, a smaller
#: size's allocator drift can split it, and the next size's logits then need a block of their
#: own (the measured pools: benchmarks/results/README.md). A generic runner's default is 0: for
#: a small step the block would be a large share of its pool.
ENGINE_POOL_SLACK_BYTES = 10 << 20


def engine_capture_policy(**fields: Any) -> CapturePolicy:
    """The :class:`~graphtune.graphs.CapturePolicy` of the engine's runners: the given fields,
    and ``pool_slack_bytes=ENGINE_POOL_SLACK_BYTES`` unless given."""
    return CapturePolicy(**{"pool_slack_bytes": ENGINE_POOL_SLACK_BYTES, **fields})


def build_runner(
    step: DecodeStep,
    kind: str = "graph",
    *,
    capture_sizes: Sequence[int] | None = None,
    lazy: bool = False,
    device: torch.device | None = None,
    policy: CapturePolicy | None = None,
    backend: GraphBackend | None = None,
) -> CUDAGraphRunner | EagerRunner:
    """The runner of ``step``: a ``CUDAGraphRunner`` (padded rows write the scratch slot) or an
    ``EagerRunner``. Nothing is captured yet: call ``runner.capture(*step.example_inputs(
    step.max_batch_size))`` (a lazy runner captures each size on first use).

    Args:
        step: The step to wrap.
        kind: ``"graph"`` or ``"eager"``.
        capture_sizes: Batch sizes to capture; ``None``: the graph runner's default list up to
            ``step.max_batch_size``.
        lazy: Capture each size on first use.
        device: The CUDA device to capture on (default: the inputs').
        policy: The graph runner's :class:`~graphtune.graphs.CapturePolicy` (default:
            :func:`engine_capture_policy`).
        backend: The graph backend (default CUDA; CPU tests pass the simulated one).

    Raises:
        ConfigError: ``kind`` is not a runner name.
    """
    _check_kind(kind)
    if kind == "eager":
        return EagerRunner(step)
    return CUDAGraphRunner(
        step,
        max_batch_size=step.max_batch_size,
        capture_sizes=list(capture_sizes) if capture_sizes is not None else None,
        pad=step_pad_rule(step.cache.scratch_slot),
        lazy=lazy,
        device=device,
        policy=policy if policy is not None else engine_capture_policy(),
        backend=backend,
    )


def build_prefill_step(step: DecodeStep, max_tokens: int) -> PrefillStep:
    """The prefill step over ``step``'s forward, captured for up to ``max_tokens`` tokens a call.

    Raises:
        ConfigError: ``max_tokens`` is not a positive int.
    """
    return PrefillStep(step, max_tokens)


def build_prefill_runner(
    step: PrefillStep,
    kind: str = "graph",
    *,
    capture_sizes: Sequence[int] | None = None,
    lazy: bool = False,
    device: torch.device | None = None,
    policy: CapturePolicy | None = None,
    backend: GraphBackend | None = None,
) -> CUDAGraphRunner | EagerRunner:
    """The runner of a prefill step: a ``CUDAGraphRunner`` keyed by token count (buckets
    :func:`~graphtune.engine.prefill.prefill_capture_sizes` up to ``step.max_tokens``; padded
    tokens write the scratch slot; each layer's attention is a graph break) or an
    ``EagerRunner``. Nothing is captured yet: call ``runner.capture(*step.example_inputs(
    step.max_tokens))``. Arguments as for :func:`build_runner`.

    Raises:
        ConfigError: ``kind`` is not a runner name.
    """
    _check_kind(kind)
    if kind == "eager":
        return EagerRunner(step)
    sizes = prefill_capture_sizes(step.max_tokens) if capture_sizes is None else capture_sizes
    return CUDAGraphRunner(
        step,
        max_batch_size=step.max_tokens,
        capture_sizes=list(sizes),
        pad=prefill_pad_rule(step.step.cache.scratch_slot),
        lazy=lazy,
        device=device,
        policy=policy if policy is not None else engine_capture_policy(),
        backend=backend,
    )


def _check_kind(kind: str) -> None:
    if kind not in RUNNERS:
        raise ConfigError(f"runner must be one of {RUNNERS}, got {kind!r}")
