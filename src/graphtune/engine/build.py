"""The engine's factories: the decode step for a model and the runner that wraps it.

:class:`~graphtune.engine.Engine` builds its step and runner here, and so does the decode
benchmark (``graphtune.bench``), so what the benchmark times is what the engine serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphtune.engine.collectives import AllReduce
from graphtune.engine.kv_cache import KVCache
from graphtune.engine.model import DecoderModel
from graphtune.engine.parallel import TensorParallelDecodeStep
from graphtune.engine.step import DecodeStep, step_pad_rule
from graphtune.errors import ConfigError
from graphtune.graphs import CUDAGraphRunner, EagerRunner

#: Step runners an Engine can use.
RUNNERS = ("graph", "eager")


def build_step(
    model: DecoderModel,
    cache: KVCache,
    *,
    tuner: Any = None,
    gemm_cold_l2: bool = False,
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
        gemm_cold_l2: Tune the GEMMs with cold-L2 rotation.
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


def build_runner(
    step: DecodeStep,
    kind: str = "graph",
    *,
    capture_sizes: Sequence[int] | None = None,
    lazy: bool = False,
    device: torch.device | None = None,
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

    Raises:
        ConfigError: ``kind`` is not a runner name.
    """
    if kind not in RUNNERS:
        raise ConfigError(f"runner must be one of {RUNNERS}, got {kind!r}")
    if kind == "eager":
        return EagerRunner(step)
    return CUDAGraphRunner(
        step,
        max_batch_size=step.max_batch_size,
        capture_sizes=list(capture_sizes) if capture_sizes is not None else None,
        pad=step_pad_rule(step.cache.scratch_slot),
        lazy=lazy,
        device=device,
    )
