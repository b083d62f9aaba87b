"""The autotuner: pick the fastest (runner, tactic) per op and shape bucket, cache it on disk.

Public names: :class:`TunableRunner`, :data:`FALLBACK_TACTIC`, :class:`TuningConfig`,
:class:`DynamicTensorSpec`, :class:`ConstraintSpec`, the bucket helpers, :class:`AutoTuner` and
its :class:`TuningPolicy` and :class:`TunerStats`, :func:`get_tuner`, :func:`autotune`,
:class:`DistributedTuning` (rank-consistent tuning over a process group, see
``docs/distributed.md``), :class:`ProfileRecord` / :class:`CandidateRecord` (what
``AutoTuner.history`` records per tuned profile), :class:`OpCall` / :class:`CallRecord` /
:class:`MissLog` (recorded calls and missed shapes) and :func:`check_tactics` (the tactic
consistency check). Timers live in :mod:`graphtune.autotuner.timing`; the tuner resolves one per
call from ``TuningConfig.timing`` unless one is passed to ``AutoTuner``. ``docs/autotuner.md`` is
the guide, including what to change when porting a TensorRT-LLM or ``triton.autotune`` user.
"""

from graphtune.autotuner.cache import TuningCache
from graphtune.autotuner.calls import CallRecord, MissLog, OpCall, load_misses
from graphtune.autotuner.config import (
    ConstraintSpec,
    DynamicTensorSpec,
    TuningConfig,
    last_power_of_two,
    next_power_of_two,
    power_of_two_buckets,
)
from graphtune.autotuner.consistency import ConsistencyReport, TacticCheck, check_tactics
from graphtune.autotuner.context import autotune, get_tuner
from graphtune.autotuner.distributed import DistributedTuning
from graphtune.autotuner.entries import CacheEntry, CacheKey
from graphtune.autotuner.identity import runner_id
from graphtune.autotuner.isolation import Isolation
from graphtune.autotuner.policy import TuningPolicy
from graphtune.autotuner.profiles import Profile
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.autotuner.selection import CandidateRecord, ProfileRecord
from graphtune.autotuner.stats import TunerStats
from graphtune.autotuner.tuner import AutoTuner
from graphtune.autotuner.values import IdentityError

__all__ = [
    "FALLBACK_TACTIC",
    "AutoTuner",
    "CacheEntry",
    "CacheKey",
    "CallRecord",
    "CandidateRecord",
    "ConsistencyReport",
    "ConstraintSpec",
    "DistributedTuning",
    "DynamicTensorSpec",
    "IdentityError",
    "Isolation",
    "MissLog",
    "OpCall",
    "Profile",
    "ProfileRecord",
    "TacticCheck",
    "TunableRunner",
    "TunerStats",
    "TuningCache",
    "TuningConfig",
    "TuningPolicy",
    "autotune",
    "check_tactics",
    "get_tuner",
    "last_power_of_two",
    "load_misses",
    "next_power_of_two",
    "power_of_two_buckets",
    "runner_id",
]
