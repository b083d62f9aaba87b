"""What ``graphtune demo`` tunes: a small op set, tuned on the best device present.

Two ops, each with several runners and tactics, tuned over a few batch-size buckets:

* ``matmul``: ``torch.matmul`` (the fallback), a row-chunked ``torch.mm`` (tactic = chunk rows)
  and ``torch.einsum``;
* ``softmax``: one runner whose tactics are ``torch.softmax`` (fallback), ``exp(log_softmax)``
  and an explicit max-subtract / exp / normalise.

On CUDA it times with the graph timer in bf16; on CPU with the wall clock in float32, sized to
finish in seconds on a small machine.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from graphtune.autotuner import (
    FALLBACK_TACTIC,
    AutoTuner,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
    autotune,
)


class TorchMatmul(TunableRunner):
    """``a @ b``; only the fallback tactic."""

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC) -> torch.Tensor:
        return torch.matmul(inputs[0], inputs[1])


class ChunkedMatmul(TunableRunner):
    """``a @ b`` computed in row chunks; the tactic is the chunk height."""

    def get_valid_tactics(self, inputs: list[Any], profile: Any) -> list[Any]:
        rows = inputs[0].shape[0]
        return [c for c in (16, 64) if c < rows]  # a chunk as tall as a is plain matmul

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC) -> torch.Tensor:
        a, b = inputs
        if tactic == FALLBACK_TACTIC:
            return a @ b
        out = a.new_empty(a.shape[0], b.shape[1])
        for start in range(0, a.shape[0], tactic):
            torch.mm(a[start : start + tactic], b, out=out[start : start + tactic])
        return out


class EinsumMatmul(TunableRunner):
    """``einsum('mk,kn->mn')``."""

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC) -> torch.Tensor:
        return torch.einsum("mk,kn->mn", inputs[0], inputs[1])


class Softmax(TunableRunner):
    """Row softmax; tactics pick the formulation."""

    def get_valid_tactics(self, inputs: list[Any], profile: Any) -> list[Any]:
        return [FALLBACK_TACTIC, "log_softmax_exp", "explicit"]

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC) -> torch.Tensor:
        x = inputs[0]
        if tactic == "log_softmax_exp":
            return torch.log_softmax(x, dim=-1).exp()
        if tactic == "explicit":
            e = (x - x.amax(dim=-1, keepdim=True)).exp()
            return e / e.sum(dim=-1, keepdim=True)
        return torch.softmax(x, dim=-1)


def _floor_to(buckets: tuple[int, ...]):
    def map_to_bucket(size: int) -> int:
        return max((b for b in buckets if b <= size), default=buckets[0])

    return map_to_bucket


def demo(tuner: AutoTuner, device: torch.device, *, cache_path: Path | None = None) -> str:
    """Runs the demo with ``tuner`` on ``device``; returns the text to show."""
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    max_rows, width = (4096, 4096) if on_cuda else (256, 512)
    buckets = (1, 8, 32, 128, 512, 4096) if on_cuda else (1, 16, 64, 256)
    config = TuningConfig(
        # Each live row count uses the pick of the largest bucket not above it.
        dynamic_specs=(DynamicTensorSpec(0, 0, buckets, map_to_bucket=_floor_to(buckets)),),
        max_value=max_rows,
        warmup=2,
    )
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(width, width, device=device, dtype=dtype, generator=gen)
    mm_runners = [TorchMatmul(), ChunkedMatmul(), EinsumMatmul()]
    sm_runners = [Softmax()]

    def step(rows: int) -> None:
        x = torch.randn(rows, width, device=device, dtype=dtype, generator=gen)
        runner, tactic = tuner.choose_one("matmul", mm_runners, config, [x, weight])
        y = runner.forward([x, weight], tactic=tactic)
        runner, tactic = tuner.choose_one("softmax", sm_runners, config, [y])
        runner.forward([y], tactic=tactic)

    start = time.perf_counter()
    # tune=True: GRAPHTUNE_CACHE_ONLY (meant for serving) must not turn the demo into look-ups.
    with autotune(cache_path=cache_path, tuner=tuner, tune=True):
        step(max_rows)  # the first call of each op tunes every bucket
    tuned_s = time.perf_counter() - start
    stats = tuner.stats
    tuning = replace(
        stats, fallbacks=dict(stats.fallbacks), tactic_failures=dict(stats.tactic_failures)
    )
    for rows in (1, 3, 20, 100, max_rows):  # serving: cache look-ups only
        step(rows)

    mode = tuner.timer.name if tuner.timer is not None else ("graph" if on_cuda else "wallclock")
    lines = [f"graphtune demo on {device} ({dtype}, timer {mode}); tuning took {tuned_s:.1f} s"]
    table = tuner.summary_table()
    if table:
        lines.append(table)
    elif cache_path is not None and tuning.hits and not tuning.fallbacks:
        lines.append(
            f"Every pick came from {cache_path}; `graphtune cache show {cache_path}` lists them."
        )
    else:
        lines.append(
            "No pick was tuned or loaded: every call ran its fallback (the failed tactics "
            "below say why)"
        )
    stats = tuner.stats
    fallbacks = sum(stats.fallbacks.values()) - sum(tuning.fallbacks.values())
    lines.append(
        f"tuning: {tuning.profiles_tuned} profiles tuned, {tuning.measurements} measurements, "
        f"{sum(tuning.tactic_failures.values())} failed tactics"
    )
    lines.append(
        f"serving: {stats.hits - tuning.hits} cache hits, {stats.misses - tuning.misses} "
        f"misses, {fallbacks} fallbacks"
    )
    if cache_path is not None and table:
        lines.append(f"picks saved to {cache_path}")
    return "\n".join(lines)
