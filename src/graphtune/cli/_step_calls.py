"""The decode step of the tuner's CLI commands, built by the engine's own factories.

``graphtune tune``, ``graphtune check-tactics`` and ``benchmarks/tuning_time.py`` need the decode
step of a model (random weights of its shapes): they tune it with
:func:`graphtune.engine.tuning.tune_step` or check the op calls it makes
(:func:`graphtune.engine.tuning.record_step_calls`), so they tune and check exactly what the
engine's step looks up, with no hand-kept op list. The step comes from
:func:`graphtune.engine.build.build_step`, as the engine's does.

Checking a call copies its inputs (the KV cache of a layer among them) for the fallback and for
each tactic, on top of the recorded step; :func:`check_calls_fit` refuses a batch whose copies
would not fit in the host's memory, before Linux's out-of-memory killer ends the process with no
message (the KV cache's own check, in :class:`graphtune.engine.kv_cache.KVCache`, does not
count them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphtune.autotuner import AutoTuner, OpCall
from graphtune.autotuner.profiles import input_bytes, nested_tensors
from graphtune.errors import ConfigError


def resolve_device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``--device`` / ``--dtype`` values (``auto``: CUDA and bfloat16 when available) resolved
    by the engine's own helpers."""
    from graphtune.engine.devices import resolve_device, resolve_dtype

    resolved = resolve_device(device)
    return resolved, resolve_dtype(dtype, resolved)


def decode_step(
    model: str,
    max_batch: int,
    tuner: AutoTuner,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_seq_len: int = 2048,
    size_names: tuple[str, str] = ("--max-batch", "--max-seq-len"),
) -> Any:
    """The engine's decode step of ``model`` (random weights) for batches up to ``max_batch``.

    Args:
        model: Preset name or Hugging Face folder (``graphtune.engine.loading.load_config``).
        max_batch: KV cache slots: the largest batch the step's ops are tuned for.
        tuner: The tuner the step's ops ask.
        device: Where to run.
        dtype: Weight and activation dtype.
        max_seq_len: KV cache length (part of decode attention's tuning key), rounded up to a
            multiple of 16 as the Engine rounds its ``max_seq_len``.
        size_names: The command's flags for ``max_batch`` and ``max_seq_len``, for the errors.

    Raises:
        InputError: ``max_seq_len`` is above the model's ``max_position_embeddings``.
        ConfigError: The KV cache does not fit in memory (the message names ``size_names``).
    """
    from graphtune.engine.build import build_step
    from graphtune.engine.kv_cache import KVCache, aligned_seq_len
    from graphtune.engine.loading import load_config
    from graphtune.engine.model import random_model

    config = load_config(model)
    config.check_positions(max_seq_len, f"--max-seq-len {max_seq_len}")
    weights = random_model(config, device=device, dtype=dtype)
    cache = KVCache(
        config, max_batch, aligned_seq_len(max_seq_len), device, dtype, size_names=size_names
    )
    return build_step(weights, cache, tuner=tuner)


def decode_step_calls(
    model: str,
    batch: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_seq_len: int = 256,
    tuner: AutoTuner | None = None,
) -> list[OpCall]:
    """The op calls of one decode step of ``batch`` rows, in call order (nothing is timed).

    The KV cache holds random values and every row sits at position ``max_seq_len // 2`` of its
    own slot, so attention's inputs are not trivial (zeros, or one visible key). ``tuner`` (a
    new one by default) is the step's: a fused op's fallback runs its unfused ops through it.
    """
    from graphtune.engine.tuning import record_step_calls

    step = decode_step(
        model, batch, tuner or AutoTuner(show_progress=False), device=device, dtype=dtype,
        max_seq_len=max_seq_len, size_names=("--batch", "--max-seq-len"),
    )  # fmt: skip
    step.cache.fill_random(0)
    rows = torch.arange(batch, dtype=torch.long, device=device)
    positions = torch.full_like(rows, step.cache.max_seq_len // 2)
    calls = record_step_calls(step, (torch.zeros_like(rows), positions, rows))
    # The recorded calls hold the live cache, which the step has just written: checked on it, a
    # tactic that skipped its K/V write would find the fallback's values there already and pass.
    step.cache.fill_random(1)
    return calls


def tune_decode_step(
    model: str,
    max_batch: int,
    tuner: AutoTuner,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_seq_len: int = 2048,
    size_names: tuple[str, str] = ("--max-batch", "--max-seq-len"),
) -> Any:
    """Tunes the decode step of ``model`` for batch buckets up to ``max_batch`` with
    :func:`graphtune.engine.tuning.tune_step` (call it inside ``autotune(cache, tuner)`` to
    load and save a cache file); returns its ``TuneReport``."""
    from graphtune.engine.tuning import tune_step

    step = decode_step(model, max_batch, tuner, device=device, dtype=dtype, max_seq_len=max_seq_len)
    return tune_step(step)


def check_memory_bytes(call: OpCall) -> int:
    """Bytes that checking ``call`` (:func:`graphtune.autotuner.check_tactics`) holds beyond its
    recorded inputs: an estimate from the inputs' sizes.

    The check keeps the fallback's copy of the inputs while a tactic runs on its own copy and
    writes outputs (counted as one more copy), then widens each (tactic, fallback) pair of
    tensors to float64 and takes their finite elements: four float64 tensors of the largest
    input. The runners' own temporaries are not counted (decode attention's fallback gathers
    K/V per head), so this is what the check needs at least.
    """
    tensors = nested_tensors(list(call.inputs))
    if not tensors:
        return 0
    inputs = sum(t.numel() * t.element_size() for t in tensors)
    widest = max(t.numel() for t in tensors)
    return 3 * inputs + 4 * 8 * widest


def check_calls_fit(
    calls: Sequence[OpCall],
    *,
    batch: int,
    max_seq_len: int,
    device: torch.device,
    available: Callable[[], int | None] | None = None,
) -> None:
    """Refuses to check ``calls`` (one step's, at ``batch`` rows) on the host when the check of
    the heaviest one (:func:`check_memory_bytes`) needs more memory than is available now.

    Args:
        calls: The op calls about to be checked, recorded (so their inputs are allocated).
        batch: The step's batch size (``--batch``), for the message.
        max_seq_len: The KV cache length (``--max-seq-len``), for the message.
        device: Where the calls run; a GPU's out-of-memory error is an exception torch raises,
            so only the host is checked.
        available: Bytes of host memory free now, or ``None`` when unknown (default
            :func:`graphtune.engine.kv_cache.available_host_memory`; tests pass a small one).

    Raises:
        ConfigError: The check would not fit; the message names ``--batch`` and
            ``--max-seq-len``.
    """
    from graphtune.engine import kv_cache

    if device.type != "cpu" or not calls:
        return
    free = (available or kv_cache.available_host_memory)()
    heaviest = max(calls, key=check_memory_bytes)
    need = check_memory_bytes(heaviest)
    if free is None or need <= free:
        return
    inputs = input_bytes(list(heaviest.inputs))
    raise ConfigError(
        f"checking the op calls of the decode step at --batch {batch} (--max-seq-len "
        f"{max_seq_len}) needs at least {need / 2**30:.1f} GiB of host memory (op "
        f"{heaviest.op}: copies of its {inputs / 2**30:.1f} GiB of inputs for the fallback and "
        f"each tactic, compared in float64), and the host has {free / 2**30:.1f} GiB available; "
        "lower --batch or --max-seq-len"
    )
