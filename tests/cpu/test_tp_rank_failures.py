"""Tensor-parallel ranks whose setup differs or fails on one rank only: every rank ends with the
same picks or a one-line error, never a hang or a silent split (two gloo ranks per test).

Each test spawns its own pair of ranks with a bounded wait, so a regression (a rank left waiting
in a collective) fails that test within a minute instead of hanging the run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fake_timers import EveryCandidateEqual
from gloo_ranks import run_on_ranks

from graphtune.autotuner import (
    AutoTuner,
    DistributedTuning,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
    TuningPolicy,
    autotune,
)
from graphtune.autotuner.entries import CacheEntry, CacheKey
from graphtune.autotuner.tuning import TuningRun
from graphtune.engine import Engine, load_model
from graphtune.engine.parallel import ParallelContext
from graphtune.errors import ConfigError, DistributedError, TuningError

WORLD = 2
WAIT_S = 60.0  # each case takes a few seconds; only a rank left in a collective waits longer
CONFIG = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 4)),), warmup=0, repeat=1)
# A pick only rank 0's tuner holds (an op the tiny model never looks up: only alignment moves it).
KEY = CacheKey("rank0_only", ("runner",), ((4, 8),), ("float32",), "fake", device="cpu")
ENTRY = CacheEntry("runner", 0, 3, 1.0, 2.0)


def _outcome(fn: Any) -> str:
    try:
        fn()
    except (ConfigError, DistributedError, TuningError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _shard() -> Any:
    return load_model("tiny", seed=3, parallel=ParallelContext.from_group())


def _cache_only_tuner_caches(rank: int) -> list[tuple[str, Any]]:
    tuner = AutoTuner(distributed=DistributedTuning("agree"))
    if rank == 0:
        tuner.cache.put(KEY, ENTRY)
    Engine(_shard(), runner="eager", max_batch_size=1, max_seq_len=32, tuner=tuner)
    return [(key.op, entry.tactic) for key, entry in tuner.cache.items()]


@pytest.mark.slow
def test_a_cache_only_shard_aligns_its_given_tuners_cache_without_a_file(tmp_path) -> None:
    # Without a tuning_cache path the ranks once kept their own caches: rank 1 looked up none of
    # rank 0's picks and ran other kernels for the replicated ops.
    caches = run_on_ranks(_cache_only_tuner_caches, WORLD, tmp_path, timeout=WAIT_S)
    assert caches[0] == caches[1] == [("rank0_only", 3)]


class NoTacticOnRank1(TunableRunner):
    """Declares ``requires_tactic`` but offers no tactic on rank 1: that rank fails while
    planning, before any per-profile collective."""

    requires_tactic = True
    identity_excludes = frozenset({"rank"})

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def get_valid_tactics(self, inputs: list, profile: Any) -> list:
        return [] if self.rank == 1 else [0, 1]

    def forward(self, inputs: list, tactic: Any = -1) -> Any:
        return inputs[0]


def _tune_with_planning_failure(rank: int) -> dict[str, str]:
    out = {}
    for strategy in ("agree", "broadcast", "parallel"):
        tuner = AutoTuner(EveryCandidateEqual())

        def tune(tuner: AutoTuner = tuner, strategy: str = strategy) -> None:
            with autotune(None, tuner, distributed=DistributedTuning(strategy)):
                tuner.choose_one("op", [NoTacticOnRank1(rank)], CONFIG, [torch.zeros(4, 8)])

        out[strategy] = _outcome(tune)
    return out


@pytest.mark.slow
def test_a_rank_failing_while_planning_is_named_by_the_others(tmp_path) -> None:
    # Rank 1 once raised alone and rank 0 waited for it in the candidates' exchange forever.
    outcomes = run_on_ranks(_tune_with_planning_failure, WORLD, tmp_path, timeout=WAIT_S)
    for strategy in ("agree", "broadcast", "parallel"):
        assert outcomes[1][strategy].startswith("TuningError"), outcomes[1][strategy]
        assert "requires_tactic" in outcomes[1][strategy]
        assert outcomes[0][strategy].startswith("DistributedError: op 'op': rank 1 "), outcomes[0]


class TwoTactics(TunableRunner):
    """Offers tactics 0 and 1 on every rank, so each profile is timed through a collective."""

    def get_valid_tactics(self, inputs: list, profile: Any) -> list:
        return [0, 1]

    def forward(self, inputs: list, tactic: Any = -1) -> Any:
        return inputs[0]


def _tune_with_failure_in_profile(rank: int, where: str) -> dict[str, str]:
    """Rank 1 fails in one profile's tuning, after planning went well on every rank:
    ``inputs``: its ``inputs_pre_hook`` raises on the profile's second input set (the first is
    made while planning); ``timing``: measuring raises an error that is not a tactic's."""
    calls = [0]

    def hook(inputs: list) -> list:
        calls[0] += 1
        if rank == 1 and where == "inputs" and calls[0] > 1:
            raise RuntimeError("pre-hook failed on rank 1")
        return inputs

    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("measuring failed on rank 1")

    if rank == 1 and where == "timing":
        TuningRun._time_candidates = boom  # type: ignore[method-assign]  # this process only
    config = TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1, inputs_pre_hook=hook
    )
    out = {}
    for strategy in ("agree", "broadcast", "parallel"):
        calls[0] = 0
        tuner = AutoTuner(EveryCandidateEqual(), policy=TuningPolicy(input_sets=2))

        def tune(tuner: AutoTuner = tuner, strategy: str = strategy) -> None:
            with autotune(None, tuner, distributed=DistributedTuning(strategy)):
                tuner.choose_one("op", [TwoTactics()], config, [torch.zeros(4, 8)])

        try:
            tune()
            out[strategy] = "ok"
        except Exception as exc:
            out[strategy] = f"{type(exc).__name__}: {exc}"
    return out


def _inputs_fail_on_rank1(rank: int) -> dict[str, str]:
    return _tune_with_failure_in_profile(rank, "inputs")


def _timing_fails_on_rank1(rank: int) -> dict[str, str]:
    return _tune_with_failure_in_profile(rank, "timing")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fn", "doing", "error"),
    [
        (
            _inputs_fail_on_rank1,
            "making the input sets of [",
            "RuntimeError: pre-hook failed on rank 1",
        ),
        (_timing_fails_on_rank1, "timing its tactics", "RuntimeError: measuring failed on rank 1"),
    ],
    ids=["inputs", "timing"],
)
def test_a_rank_failing_in_a_profile_is_named_by_the_others(tmp_path, fn, doing, error) -> None:
    # Rank 1 once raised alone after planning (its profile's input sets, or an error from
    # measuring that is not a tactic's) and rank 0 waited for it in the profile's collective.
    outcomes = run_on_ranks(fn, WORLD, tmp_path, timeout=WAIT_S)
    for strategy in ("agree", "broadcast", "parallel"):
        assert outcomes[1][strategy] == error, outcomes[1][strategy]
        mine = outcomes[0][strategy]
        assert mine.startswith("DistributedError: op 'op': rank 1 of the tuning group "), mine
        assert f"failed while {doing}" in mine and f"({error})" in mine, mine


def _engine_with_memory_budget_on_rank0(rank: int) -> dict[str, str]:
    # A dict: run_on_ranks reads a rank's bare string as its traceback.
    build = _outcome(
        lambda: Engine(
            _shard(),
            runner="eager",
            max_batch_size=1,
            max_seq_len=32,
            tune=True,
            tuner=AutoTuner(EveryCandidateEqual(), distributed="agree"),
            gpu_memory_utilization=0.5 if rank == 0 else None,
        )
    )
    return {"build": build}


@pytest.mark.slow
def test_a_memory_budget_on_one_shard_is_refused_before_tuning(tmp_path) -> None:
    # The refusal once came after the ranks' exchange and on rank 0 only: rank 1 went on into
    # the tuning collectives and waited for rank 0 there.
    ranks = run_on_ranks(_engine_with_memory_budget_on_rank0, WORLD, tmp_path, timeout=WAIT_S)
    outcomes = [ranks[rank]["build"] for rank in range(WORLD)]
    assert outcomes[0].startswith("ConfigError: gpu_memory_utilization=0.5"), outcomes[0]
    assert "tensor-parallel shard" in outcomes[0]
    assert outcomes[1].startswith("DistributedError: Engine(...): rank 0 refused"), outcomes[1]
