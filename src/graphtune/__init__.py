"""graphtune: a CUDA graph runner and a graph-replay autotuner for LLM inference.

Importing graphtune has no side effects: no CUDA context, no files, no logging configuration.

Autotuner: :class:`TunableRunner`, :class:`TuningConfig`, :class:`DynamicTensorSpec`,
:class:`ConstraintSpec`, :class:`AutoTuner`, :func:`get_tuner`, :func:`autotune`.
Graph runner: :class:`CUDAGraphRunner`, :class:`EagerRunner`.
"""

from graphtune._version import __version__
from graphtune.autotuner import (
    FALLBACK_TACTIC,
    AutoTuner,
    ConstraintSpec,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
    autotune,
    get_tuner,
    last_power_of_two,
    next_power_of_two,
    power_of_two_buckets,
)
from graphtune.errors import GraphtuneError
from graphtune.graphs import CUDAGraphRunner, EagerRunner, FallbackReason

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
    "__version__",
    "autotune",
    "get_tuner",
    "last_power_of_two",
    "next_power_of_two",
    "power_of_two_buckets",
]
