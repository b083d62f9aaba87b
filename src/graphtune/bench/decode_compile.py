"""``bench decode --compare-compile``: the engine's own step through
``torch.compile(mode="reduce-overhead")``, timed like the other runners.

The note says how long compiling took and whether inductor used CUDA graphs or skipped them (its
``cudagraph_skips`` counter; the step mutates its KV cache, which reduce-overhead commonly
refuses). A compiler failure is recorded in the result, never a crash.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from graphtune.bench.decode_progress import PhaseBar
from graphtune.bench.decode_results import BatchResult, DecodeBenchConfig
from graphtune.bench.decode_spread import timed_ms
from graphtune.bench.timing import sync
from graphtune.engine.step import DecodeStep

logger = logging.getLogger(__name__)


def _compile_skips() -> int | None:
    # The counter inductor bumps when reduce-overhead declines to use CUDA graphs for a graph.
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return int(counters["inductor"].get("cudagraph_skips", 0))


def time_compiled(
    step: DecodeStep,
    inputs: Sequence[tuple[torch.Tensor, ...]],
    cfg: DecodeBenchConfig,
    device: torch.device,
    results: list[BatchResult],
    bar: PhaseBar,
) -> None:
    """Fills ``compile_ms`` and ``compile_note`` of ``results``: ``step`` through
    ``torch.compile(mode="reduce-overhead")`` at each batch size; a compiler failure is a note."""

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
            sync(device)
            compile_s = time.perf_counter() - t0
            result.compile_ms = timed_ms(result, "compile_ms", lambda a=args: call(a), device, cfg)
        except Exception as exc:  # any compiler failure is a result to report, not a crash
            logger.warning("torch.compile failed at batch %d: %s", result.batch_size, exc)
            result.compile_note = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            continue
        finally:
            bar.done()
        after = _compile_skips()
        skipped = before is not None and after is not None and after > before
        result.compile_note = f"compiled in {compile_s:.1f} s; " + (
            "skipped cudagraphs (see TORCH_LOGS=perf_hints)" if skipped else "cudagraphs used"
        )
