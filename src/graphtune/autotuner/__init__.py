"""The autotuner: pick the fastest (runner, tactic) per op and shape bucket, cache it on disk.

Public names: :class:`TunableRunner`, :data:`FALLBACK_TACTIC`, :class:`TuningConfig`,
:class:`DynamicTensorSpec`, :class:`ConstraintSpec`, the bucket helpers, :class:`AutoTuner`,
:func:`get_tuner`, :func:`autotune` and :class:`DistributedTuning` (rank-consistent tuning over a
process group, see ``docs/distributed.md``). Timers live in :mod:`graphtune.autotuner.timing`; the
tuner resolves one per call from ``TuningConfig.timing`` unless one is passed to ``AutoTuner``.
"""

from graphtune.autotuner.cache import CacheEntry, CacheKey, TuningCache
from graphtune.autotuner.config import (
    ConstraintSpec,
    DynamicTensorSpec,
    TuningConfig,
    last_power_of_two,
    next_power_of_two,
    power_of_two_buckets,
)
from graphtune.autotuner.distributed import DistributedTuning
from graphtune.autotuner.isolation import Isolation
from graphtune.autotuner.profiles import Profile
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.autotuner.tuner import AutoTuner, TunerStats, autotune, get_tuner

__all__ = [
    "FALLBACK_TACTIC",
    "AutoTuner",
    "CacheEntry",
    "CacheKey",
    "ConstraintSpec",
    "DistributedTuning",
    "DynamicTensorSpec",
    "Isolation",
    "Profile",
    "TunableRunner",
    "TunerStats",
    "TuningCache",
    "TuningConfig",
    "autotune",
    "get_tuner",
    "last_power_of_two",
    "next_power_of_two",
    "power_of_two_buckets",
]
