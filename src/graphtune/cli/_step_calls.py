"""The one place the tuner's CLI commands reach into the engine: run one decode step.

``graphtune check-tactics`` and ``benchmarks/tuning_time.py`` need the op calls of a real decode
step (so they check and tune exactly what the step looks up, with no hand-kept op list). They get
them by running one step of the reference engine with a tuner and recording its ``choose_one``
calls (``AutoTuner.record_calls``). :func:`run_decode_step` is that step; it is the only function
here that knows the engine's construction API.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from graphtune.autotuner import AutoTuner, OpCall
from graphtune.errors import ConfigError


def model_config(spec: str) -> Any:
    """A preset name, or a Hugging Face folder with ``config.json`` (read for its shapes)."""
    from graphtune.engine.config import from_hf_config, get_preset

    path = Path(spec).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"{path} has no config.json; pass a Hugging Face model folder.")
        return from_hf_config(json.loads(config_file.read_text()), name=path.name)
    return get_preset(spec)


def resolve_device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``--device`` / ``--dtype`` values (``auto``: CUDA and bfloat16 when available) resolved
    by the engine's own helpers."""
    from graphtune.engine.devices import resolve_device, resolve_dtype

    resolved = resolve_device(device)
    return resolved, resolve_dtype(dtype, resolved)


def run_decode_step(
    model: str,
    batch: int,
    tuner: AutoTuner,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_seq_len: int = 256,
    max_batch: int | None = None,
) -> None:
    """Runs one eager decode step of ``model`` (random weights) at ``batch`` rows with ``tuner``.

    Every row sits at position ``max_seq_len // 2`` in its own cache slot. The step's ops ask
    ``tuner`` for their picks (its tuning mode decides whether a miss tunes).

    Args:
        model: Preset name or Hugging Face folder (see :func:`model_config`).
        batch: Rows of the step.
        tuner: The tuner the step's ops ask.
        device: Where to run.
        dtype: Weight and activation dtype.
        max_seq_len: KV cache length (part of decode attention's tuning key).
        max_batch: KV cache slots (the ops' ``max_m``); default ``batch``.
    """
    from graphtune.engine.kv_cache import KVCache
    from graphtune.engine.model import random_model
    from graphtune.engine.step import DecodeStep

    config = model_config(model)
    slots = max_batch or batch
    weights = random_model(config, device=device, dtype=dtype)
    cache = KVCache(config, slots, max_seq_len, device=device, dtype=dtype)
    step = DecodeStep(weights, cache, contiguous_slots=True, tuner=tuner)
    tokens = torch.zeros(batch, dtype=torch.long, device=device)
    positions = torch.full((batch,), max_seq_len // 2, dtype=torch.long, device=device)
    with torch.inference_mode():
        step(tokens, positions, torch.arange(batch, dtype=torch.long, device=device))


def decode_step_calls(
    model: str, batch: int, *, device: torch.device, dtype: torch.dtype, max_seq_len: int = 256
) -> list[OpCall]:
    """The op calls of one decode step, in call order (an untuned tuner: nothing is timed)."""
    tuner = AutoTuner(show_progress=False)
    with tuner.record_calls() as calls:
        run_decode_step(model, batch, tuner, device=device, dtype=dtype, max_seq_len=max_seq_len)
    return calls


def tune_decode_step(
    model: str,
    max_batch: int,
    tuner: AutoTuner,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_seq_len: int = 2048,
) -> None:
    """Tunes every op of the decode step for batch buckets up to ``max_batch`` by running it.

    Call it inside ``autotune(cache, tuner)``: one step at ``max_batch`` rows makes every op's
    first miss tune all its buckets up to ``max_batch`` (the step's ``max_m``), so the keys tuned
    are the keys the step looks up. Before that, the op calls of one untuned step are recorded
    and ``tuner.prepare`` compiles the Triton tactics of all of them at once.
    """
    recorder = AutoTuner(show_progress=False, cache=tuner.cache)
    with recorder.record_calls() as calls:
        run_decode_step(
            model,
            max_batch,
            recorder,
            device=device,
            dtype=dtype,
            max_seq_len=max_seq_len,
            max_batch=max_batch,
        )
    tuner.prepare(calls)
    run_decode_step(
        model,
        max_batch,
        tuner,
        device=device,
        dtype=dtype,
        max_seq_len=max_seq_len,
        max_batch=max_batch,
    )
