"""The tuner ``graphtune bench decode --tune`` builds, and its experimental ``--tune-lead-in``."""

from __future__ import annotations

from typing import Any

import torch

from graphtune import autotuner
from graphtune.autotuner.timing import GraphTimer
from graphtune.errors import ConfigError
from graphtune.ops.lead_in import pdl_lead_in


def lead_in_for(device: torch.device) -> Any:
    """:func:`graphtune.ops.lead_in.pdl_lead_in` for ``device``.

    Raises:
        ConfigError: PDL cannot work there, so there is no lead-in to time after.
    """
    lead_in = pdl_lead_in(device)
    if lead_in is None:
        raise ConfigError(
            f"--tune-lead-in times each call after a PDL kernel, and PDL cannot work on {device} "
            "(it needs a GPU of compute capability >= 9.0, Triton >= 3.3, GRAPHTUNE_PDL not 0): "
            "drop it"
        )
    return lead_in


def check_lead_in(lead_in: bool, device: torch.device, tuner: Any) -> None:
    """Refuses ``--tune-lead-in`` before anything is timed: without PDL on ``device``, or with a
    caller's ``tuner`` (whose timer it would not set).

    Raises:
        ConfigError: As said.
    """
    if not lead_in:
        return
    if tuner is not None:
        raise ConfigError(
            "tune_lead_in sets the timer of the tuner bench decode builds: pass no tuner, or "
            "give yours GraphTimer(lead_in=graphtune.ops.lead_in.pdl_lead_in(device))"
        )
    lead_in_for(device)


def default_tuner(step: Any, device: torch.device, lead_in: bool = False) -> Any:
    """A new tuner; shards must run the same kernels: every rank times every candidate and the
    slowest rank counts (``agree``). With ``lead_in`` (experimental) its graph timer times each
    call right after a small PDL kernel (:mod:`graphtune.autotuner.timing.lead_in`)."""
    kwargs: dict[str, Any] = {}
    if lead_in:
        kwargs["timer"] = GraphTimer(device=device, lead_in=lead_in_for(device))
    if step.parallel is not None:
        kwargs["distributed"] = autotuner.DistributedTuning("agree", step.parallel.group)
    return autotuner.AutoTuner(**kwargs)
