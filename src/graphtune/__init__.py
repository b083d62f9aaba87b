"""graphtune: a CUDA graph runner and a graph-replay autotuner for LLM inference.

Importing graphtune has no side effects: no CUDA context, no files, no logging configuration. The
public names below are imported on first use (PEP 562), so ``import graphtune.graphs`` does not
load the autotuner and ``import graphtune`` alone does not import torch.

Autotuner: :class:`TunableRunner`, :class:`TuningConfig`, :class:`DynamicTensorSpec`,
:class:`ConstraintSpec`, :class:`AutoTuner`, :class:`TuningPolicy`, :func:`get_tuner`,
:func:`autotune`. Graph runner: :class:`CUDAGraphRunner`, :class:`EagerRunner`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from graphtune._version import __version__
from graphtune.errors import GraphtuneError

if TYPE_CHECKING:
    from graphtune.autotuner import (
        FALLBACK_TACTIC,
        AutoTuner,
        ConstraintSpec,
        DynamicTensorSpec,
        TunableRunner,
        TuningConfig,
        TuningPolicy,
        autotune,
        get_tuner,
        last_power_of_two,
        next_power_of_two,
        power_of_two_buckets,
    )
    from graphtune.graphs import CUDAGraphRunner, EagerRunner, FallbackReason

#: Where each lazily imported public name lives.
_LAZY = {
    **dict.fromkeys(
        (
            "FALLBACK_TACTIC",
            "AutoTuner",
            "ConstraintSpec",
            "DynamicTensorSpec",
            "TunableRunner",
            "TuningConfig",
            "TuningPolicy",
            "autotune",
            "get_tuner",
            "last_power_of_two",
            "next_power_of_two",
            "power_of_two_buckets",
        ),
        "graphtune.autotuner",
    ),
    **dict.fromkeys(("CUDAGraphRunner", "EagerRunner", "FallbackReason"), "graphtune.graphs"),
}

__all__ = [
    "FALLBACK_TACTIC",
    "AutoTuner",
    "CUDAGraphRunner",
    "ConstraintSpec",
    "DynamicTensorSpec",
    "EagerRunner",
    "FallbackReason",
    "GraphtuneError",
    "TunableRunner",
    "TuningConfig",
    "TuningPolicy",
    "__version__",
    "autotune",
    "get_tuner",
    "last_power_of_two",
    "next_power_of_two",
    "power_of_two_buckets",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'graphtune' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
