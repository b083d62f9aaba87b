"""The checks of ``Engine(...)``'s own arguments, agreed between tensor-parallel ranks.

On a shard, every rank must build the same engine: its collectives pair up with the other
ranks' only when they run the same step. So the ranks exchange what they were given, and a rank
whose arguments fail their checks still joins that exchange: it raises its own error, and the
other ranks raise :class:`~graphtune.errors.DistributedError` naming it, instead of waiting for
it in their next collective.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from graphtune.autotuner import AutoTuner
from graphtune.engine.build import RUNNERS
from graphtune.engine.devices import as_torch_device
from graphtune.engine.model import DecoderModel
from graphtune.errors import ConfigError, InputError

#: The shortest ``max_seq_len`` an engine takes (a prompt token and one new token).
MIN_SEQ_LEN = 2


def checked_engine_arguments(
    model: DecoderModel,
    *,
    runners: tuple[str, str],
    max_batch_size: Any,
    max_seq_len: Any,
    device: torch.device | str | None,
    tuner: Any,
    agreed: dict[str, Any],
    gpu_memory_utilization: float | None = None,
    tuning_cache: Any = None,
) -> torch.device:
    """Checks ``Engine``'s runner kinds, sizes, device, tuner and memory budget (refused for a
    shard); on a shard, that every rank passes the same ``agreed`` values, weights and tuning
    strategy. Returns the device the engine runs on.

    Raises:
        ConfigError: An argument of this rank breaks its rule.
        DistributedError: Another rank's arguments failed their checks, or differ from rank
            0's (named).
    """
    parallel = model.parallel
    if parallel is not None:
        parallel.check_ready()
    try:
        for name, kind in zip(("runner", "prefill_runner"), runners, strict=True):
            if kind not in RUNNERS:
                raise ConfigError(f"{name} must be one of {RUNNERS}, got {kind!r}")
        for name, value, low in (
            ("max_batch_size", max_batch_size, 1),
            ("max_seq_len", max_seq_len, MIN_SEQ_LEN),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        try:
            model.config.check_positions(max_seq_len, f"max_seq_len={max_seq_len}")
        except InputError as exc:  # the same rule as a request's, but here it is configuration
            raise ConfigError(str(exc)) from None
        target = as_torch_device(device) if device is not None else model.device
        if tuner is not None and not isinstance(tuner, AutoTuner):
            raise ConfigError(
                f"tuner must be a graphtune AutoTuner (or None for the engine's own), got "
                f"{type(tuner).__name__}"
            )
        if tuning_cache is not None and not isinstance(tuning_cache, (str, os.PathLike)):
            raise ConfigError(
                f"tuning_cache must be a file path (str or os.PathLike) or None, got "
                f"{type(tuning_cache).__name__} {tuning_cache!r:.40}"
            )
        if parallel is not None and tuner is not None and not _collective(tuner):
            # Cache-only too: ranks that look up different caches run different kernels.
            raise ConfigError(
                "a tuner on a tensor-parallel shard must be rank-consistent: "
                "AutoTuner(distributed=DistributedTuning('agree', group)) (or 'parallel' / "
                "'broadcast'), or leave tuner=None and the engine uses 'agree'"
            )
        if parallel is not None and gpu_memory_utilization is not None:
            # Refused here, inside the exchange, so a rank that passed it is named by the
            # others instead of leaving them waiting in the tuning collectives.
            raise ConfigError(
                f"gpu_memory_utilization={gpu_memory_utilization!r} is not supported for a "
                "tensor-parallel shard yet (each rank would size its own KV cache and the ranks "
                "must agree); pass max_batch_size instead, on every rank"
            )
    except ConfigError as exc:
        if parallel is not None:
            parallel.check_same_on_ranks("Engine(...)", {}, failure=exc)
        raise
    if parallel is not None:
        parallel.check_same_on_ranks(
            "Engine(...)",
            {
                **agreed,
                "weights": weights_mark(model),
                "all_reduce": parallel.all_reduce_backend,
                "tuner": None if tuner is None else tuner.distributed.strategy,
            },
        )
    return target


def _collective(tuner: Any) -> bool:
    return tuner.distributed is not None and tuner.distributed.collective


def weights_mark(model: DecoderModel) -> tuple[Any, ...]:
    """What tells two ranks' weights apart without reading them whole: a corner of the
    (replicated) embedding, and the checkpoint's sample of every tensor it read (the same
    elements on every rank, whatever its shard: ``extras["weights_mark"]``, set by
    :func:`~graphtune.engine.loading.load_checkpoint`)."""
    return (model.embed[:2, :4].float().tolist(), model.extras.get("weights_mark"))
