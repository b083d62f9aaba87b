"""An op call resolved to what its cache keys are made of, and the key of its memoised hit.

:class:`ResolvedCall` is computed once per slow-path look-up (and per tuning run): the runners'
identities, the device, the timing mode, the runners' source digest and the keyword arguments'
text. :func:`memo_key` is what a cache hit of an exact call signature depends on, so that a
decode step's repeated look-ups skip bucketing and key building.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphtune.autotuner.calls import OpCall
from graphtune.autotuner.config import TuningConfig
from graphtune.autotuner.entries import CacheKey
from graphtune.autotuner.profiles import Profile, profile_for
from graphtune.autotuner.runner import TunableRunner


def device_of(inputs: Sequence[Any]) -> torch.device:
    """The device of the first tensor input (the CPU when there is none)."""
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def memo_key(
    op: str,
    runners: list[TunableRunner],
    config: TuningConfig,
    inputs: list[Any],
    kwargs: dict[str, Any],
) -> tuple[Any, ...] | None:
    """What a cache hit depends on, or ``None`` when a part is not hashable (no memo)."""
    parts: list[Any] = [op, config, *runners]
    for x in inputs:
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), x.dtype, x.device.type))
        elif x is None or isinstance(x, (bool, int, float, str)):
            parts.append(x)
        else:
            return None
    if kwargs:
        parts.append(tuple(sorted(kwargs.items())))
    try:
        key = tuple(parts)
        hash(key)
    except TypeError:  # an unhashable config, runner or keyword value: look up the slow way
        return None
    return key


@dataclass(frozen=True)
class ResolvedCall:
    """A call with what its cache keys are made of (computed once per slow-path look-up)."""

    call: OpCall
    ids: tuple[str, ...]
    device: torch.device
    mode: str
    sources: str
    kwargs_text: str

    def key(self, profile: Profile) -> CacheKey:
        """The cache key of one of the call's profiles."""
        return CacheKey(
            self.call.op,
            self.ids,
            profile.shapes,
            profile.dtypes,
            self.mode,
            self.sources,
            self.kwargs_text,
        )

    def live_key(self) -> CacheKey | None:
        """The key the live inputs look up (``None``: a size without a bucket)."""
        profile = profile_for(self.call.config, self.call.inputs)
        return self.key(profile) if profile is not None else None
