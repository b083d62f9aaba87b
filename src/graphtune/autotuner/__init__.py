"""The autotuner: pick the fastest (runner, tactic) per op and shape bucket, cache it on disk.

Public names: :class:`TunableRunner`, :data:`FALLBACK_TACTIC`, :class:`TuningConfig`,
:class:`DynamicTensorSpec`, :class:`ConstraintSpec`, the bucket helpers, :class:`AutoTuner`,
:func:`get_tuner`, :func:`autotune`, :class:`DistributedTuning` (rank-consistent tuning over a
process group, see ``docs/distributed.md``), and :class:`ProfileRecord` / :class:`CandidateRecord`
(what ``AutoTuner.history`` records per tuned profile). Timers live in
:mod:`graphtune.autotuner.timing`; the tuner resolves one per call from ``TuningConfig.timing``
unless one is passed to ``AutoTuner``.
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
from graphtune.autotuner.context import autotune, get_tuner
from graphtune.autotuner.distributed import DistributedTuning
from graphtune.autotuner.isolation import Isolation
from graphtune.autotuner.profiles import Profile
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.autotuner.selection import CandidateRecord, ProfileRecord
from graphtune.autotuner.tuner import AutoTuner, TunerStats

__all__ = [
    "FALLBACK_TACTIC",
    "AutoTuner",
    "CacheEntry",
    "CacheKey",
    "CandidateRecord",
    "ConstraintSpec",
    "DistributedTuning",
    "DynamicTensorSpec",
    "Isolation",
    "Profile",
    "ProfileRecord",
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
