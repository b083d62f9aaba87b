"""The GEMV path's down kernel tuned on its own: a second look-up after the fused-MoE op's pick.

:class:`~graphtune.ops.moe.gemv.TritonMoeGemvRunner`'s tactic ``{"bn", "bk", "warps"}`` is the
gate/up kernel's tile, and the down kernel's tile follows from it (``gemv.down_tile``). The two
kernels want different tiles: the down kernel reads all of a token's experts side by side over a
short reduction (the expert width), the gate/up kernel one expert's rows over the hidden size.
Their times add up, so the pair is tuned in two stages, as TensorRT-LLM tunes a MoE's two GEMMs
one after the other: the fused-MoE op's tactic is the gate/up tile (timed with the implied down
tile), and :data:`OP_NAME`, an op of its own on the same inputs and buckets, tunes the down tile:
:class:`TritonMoeGemvDownRunner` times every tile of :func:`down_tiles` after one fixed gate/up
tile (the first GEMV tactic), so only the down kernel's time differs between its candidates.
:func:`graphtune.ops.moe.op.fused_moe` asks for it when its pick is the GEMV runner and runs
the pick with that down tile; a miss keeps the implied one.

The candidates (a pruned one is never timed): only buckets with ``T * k <= MAX_PAIRS``; every
``features`` in 1..8 (at most the hidden size's next power of two), ``bk`` in 128..512 (at most
the expert width's), ``warps`` in 2..8 whose chunk (all ``top_k`` slots, padded to a power of
two, times ``features`` rows of ``bk``) gives each thread 16 to 64 bytes: one to four 16-byte
loads (fewer leave the loads too narrow, more spill registers).
"""

from __future__ import annotations

import functools
from typing import Any

from graphtune.autotuner import FALLBACK_TACTIC
from graphtune.autotuner.config import TuningConfig, next_power_of_two
from graphtune.autotuner.runner import TunableRunner
from graphtune.errors import ConfigError
from graphtune.ops.moe.gemv import (
    MAX_PAIRS,
    TritonMoeGemvRunner,
    down_tile,
    gemv_shape,
    moe_gemv_tactics,
)

OP_NAME = "graphtune.fused_moe.gemv_down"
FEATURE_CHOICES = (1, 2, 4, 8)
BK_CHOICES = (128, 256, 512)
WARP_CHOICES = (2, 4, 8)
THREAD_BYTES = (16, 64)
"""Bounds of the bytes of one chunk of the down tile each thread loads."""


def down_tiles(
    tokens: int, top_k: int, hidden: int, inter: int, *, itemsize: int
) -> list[dict[str, int]]:
    """Down tiles worth timing for one bucket of ``tokens`` (the module's rules)."""
    if tokens * top_k > MAX_PAIRS or tokens < 1 or top_k < 1:
        return []
    slots = down_tile(top_k, 1)[0]
    found: list[dict[str, int]] = []
    low, high = THREAD_BYTES
    for warps in WARP_CHOICES:
        for feature_base in FEATURE_CHOICES:
            for bk_base in BK_CHOICES:
                tile = {
                    "features": min(feature_base, next_power_of_two(hidden)),
                    "bk": min(bk_base, next_power_of_two(inter)),
                    "warps": warps,
                }
                per_thread = slots * tile["features"] * tile["bk"] * itemsize / (32 * warps)
                if low <= per_thread <= high and tile not in found:
                    found.append(tile)
    return found


class TritonMoeGemvDownRunner(TritonMoeGemvRunner):
    """The GEMV path with one fixed gate/up tile (the first of
    :func:`~graphtune.ops.moe.gemv.moe_gemv_tactics`) and the down tile as the tactic (a
    :data:`~graphtune.ops.moe.gemv.DOWN_KEYS` dict); tactic ``-1`` is the torch fallback (never
    timed: not a candidate)."""

    def get_valid_tactics(self, inputs: list[Any], profile: Any, **kwargs: Any) -> list[Any]:
        """The tiles of :func:`down_tiles`; for a bucket without any (too many pairs, or no
        Triton) only the fallback, which the tuner then keeps without timing: the op's pick
        there is another runner, and a failed profile would be tuned again on every run."""
        return super().get_valid_tactics(inputs, profile, **kwargs) or [FALLBACK_TACTIC]

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`down_tiles`."""
        return down_tiles(*gemv_shape(inputs), itemsize=inputs[0].element_size())

    def launch(
        self,
        inputs: list[Any],
        tactic: Any,
        *,
        warmup: bool = False,
        down: dict[str, int] | None = None,
    ) -> Any:
        """The two kernels: the fixed gate/up tile, then ``tactic`` as the down tile."""
        shape = gemv_shape(inputs)
        fixed = moe_gemv_tactics(*shape, itemsize=inputs[0].element_size())
        if not fixed:
            raise ConfigError(
                f"TritonMoeGemvDownRunner: {shape[0]} tokens of top-{shape[1]} routing exceed the "
                f"GEMV path's {MAX_PAIRS} pairs; use the fused-MoE op's other runners."
            )
        return super().launch(inputs, fixed[0], warmup=warmup, down=tactic)


@functools.lru_cache(maxsize=1)
def down_runners() -> tuple[TunableRunner, ...]:
    """The runners of :data:`OP_NAME` (one)."""
    return (TritonMoeGemvDownRunner(),)


def choose_down(tuner: Any, config: TuningConfig, inputs: list[Any]) -> dict[str, int] | None:
    """The tuner's down tile for these inputs, or ``None`` on a miss (the implied tile)."""
    _, tactic = tuner.choose_one(OP_NAME, down_runners(), config, inputs)
    return None if tactic == FALLBACK_TACTIC else tactic
