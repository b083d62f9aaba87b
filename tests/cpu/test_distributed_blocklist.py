"""The blocklist under distributed tuning: two gloo ranks, fake clock timers (principle 2).

A blocked pick is not served, so ranks whose blocklists differ disagree on which look-ups hit:
one rank tunes alone and waits in a collective the others never join, or (cache-only) the ranks
run different kernels. ``align_cache`` aligns the blocklists, and a tactic one rank blocks while
timing is blocked on every rank. One spawn of two ranks runs every scenario, each in a process
group of its own with a short timeout: a regression fails fast with the gloo timeout on one rank
(the others raise nothing and go on to the next scenario) instead of hanging.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest
import torch
from fake_timers import Clock, ClockTimer
from gloo_ranks import run_on_ranks

from graphtune.autotuner import (
    AutoTuner,
    DistributedTuning,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
    autotune,
)
from graphtune.autotuner.cache import TuningCache
from graphtune.autotuner.distributed import align_cache
from graphtune.autotuner.entries import BlockedTactic
from graphtune.autotuner.isolation import CRASH, TacticFailure

WORLD = 2
BUCKETS = (1, 4, 16)
CONFIG = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, BUCKETS),), warmup=0, repeat=1)
COSTS = {-1: 10.0, 0: 5.0, 1: 3.0, 2: 1.0}  # the same on every rank: tactic 2, then 1
GROUP_TIMEOUT_S = 5.0  # a rank left waiting in a collective raises after this
COLLECTIVE = ("broadcast", "parallel", "agree")


class CostRunner(TunableRunner):
    """Costs per tactic; a ``crash`` tactic fails as a subprocess worker that died timing it.

    ``crash`` is a test instrument that differs between ranks: it is left out of the identity,
    so every rank (and every op) offers the same runner."""

    identity_excludes = frozenset({"clock", "crash"})

    def __init__(self, clock: Clock, crash: frozenset = frozenset()) -> None:
        self.clock, self.crash = clock, crash

    def get_valid_tactics(self, inputs: list, profile: Any) -> list:
        return list(COSTS)

    def forward(self, inputs: list, tactic: Any = -1) -> Any:
        if tactic in self.crash:
            # What the subprocess executor raises for a worker that died: the tuner's failure
            # path (TuningRun._fail) blocklists the tactic, on this rank only.
            raise TacticFailure(CRASH, "the worker died (simulated)", block=True)
        self.clock.now_us += COSTS[tactic]
        return inputs[0]


def _blocklist(tuner: AutoTuner) -> list[Any]:
    return sorted(b.tactic for b in tuner.cache.blocklist())


def _tuned_alone(path: str) -> AutoTuner:
    """A tuner that tuned every bucket of ``op`` alone (picks tactic 2) and saved to ``path``."""
    clock = Clock()
    alone = AutoTuner(ClockTimer(clock))
    with autotune(path, alone, distributed="independent"):
        for rows in BUCKETS:
            alone.choose_one("op", [CostRunner(clock)], CONFIG, [torch.zeros(rows, 8)])
    return alone


def _look_up(rank: int, tmp: str, tune: bool, group: Any) -> dict:
    """Both ranks' cache files hold the same picks (tactic 2, tuned alone), but only rank 0's
    blocklists tactic 2 (a worker crashed there once). Then both look up every bucket under
    ``agree``, tuning (``tune``) or cache-only."""
    path = f"{tmp}/{'tune' if tune else 'serve'}-{rank}.json"
    alone = _tuned_alone(path)
    if rank == 0:
        entry = next(entry for _, entry in alone.cache.items())
        alone.cache.block(BlockedTactic(entry.runner_id, entry.tactic, "crash: simulated"))
        alone.cache.save(path)
    clock = Clock()
    tuner = AutoTuner(ClockTimer(clock))
    setting = DistributedTuning("agree", group)
    with autotune(path, tuner, tune=tune, distributed=setting):
        picks = [
            tuner.choose_one("op", [CostRunner(clock)], CONFIG, [torch.zeros(rows, 8)])[1]
            for rows in BUCKETS
        ]
    return {"picks": picks, "blocklist": _blocklist(tuner)}


def _block_while_tuning(rank: int, strategy: str, group: Any) -> dict:
    """Op ``a`` is tuned (tactic 2); then op ``b``, of the same runner, crashes a worker with
    tactic 2 on the one rank that times it (rank 1; under ``broadcast`` rank 0 times alone, under
    ``parallel`` each item is timed by one rank); then ``a`` is looked up again."""
    clock = Clock()
    tuner = AutoTuner(ClockTimer(clock))
    x = torch.zeros(4, 8)
    crash = frozenset({2}) if rank == 1 or strategy in ("broadcast", "parallel") else frozenset()
    with autotune(None, tuner, distributed=DistributedTuning(strategy, group)):
        first = tuner.choose_one("a", [CostRunner(clock)], CONFIG, [x])[1]
        tuner.choose_one("b", [CostRunner(clock, crash)], CONFIG, [x])
        blocked = _blocklist(tuner)
        again = tuner.choose_one("a", [CostRunner(clock)], CONFIG, [x])[1]
    return {"first": first, "blocklist": blocked, "again": again}


def _align_leaves_equal_entries(rank: int, tmp: str, group: Any) -> dict:
    """Both ranks' files hold the same entries; rank 0's also blocks an unrelated tactic. After
    ``align_cache`` another process re-tunes an entry in each rank's file, then the rank saves."""
    path = f"{tmp}/align-{rank}.json"
    alone = _tuned_alone(path)
    if rank == 0:
        alone.cache.block(BlockedTactic("another-runner", 7, "crash: simulated"))
        alone.cache.save(path)
    cache = TuningCache()
    cache.load(path)
    align_cache(cache, DistributedTuning("agree", group))
    unsaved = cache.unsaved(path)
    other = TuningCache()
    other.load(path)
    key, entry = other.items()[0]
    other.put(key, dataclasses.replace(entry, tactic=0))
    other.save(path)
    cache.save(path)
    final = TuningCache()
    final.load(path)
    return {"unsaved": unsaved, "kept": dict(final.items())[key].tactic}


def _scenarios(rank: int, tmp: str) -> dict:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    cases: list[tuple[str, Any]] = [
        ("tune", lambda group: _look_up(rank, tmp, True, group)),
        ("serve", lambda group: _look_up(rank, tmp, False, group)),
        ("align", lambda group: _align_leaves_equal_entries(rank, tmp, group)),
    ]
    for strategy in (*COLLECTIVE, "independent"):
        cases.append(
            (f"run/{strategy}", lambda group, s=strategy: _block_while_tuning(rank, s, group))
        )
    for name, case in cases:
        # A group per scenario: a rank that times out in one leaves the next one usable.
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        try:
            out[name] = case(group)
        except Exception as exc:  # reported per scenario, so each test names what went wrong
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dist-blocklist")
    got = run_on_ranks(_Bound(str(tmp)), WORLD, tmp, timeout=90)
    return [got[r] for r in range(WORLD)]


class _Bound:
    """``_scenarios`` with the folder bound (picklable for ``spawn``, unlike a lambda)."""

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp

    def __call__(self, rank: int) -> dict:
        return _scenarios(rank, self.tmp)


@pytest.mark.slow
def test_ranks_whose_blocklists_differ_tune_the_same_and_do_not_hang(ranks) -> None:
    # Before alignment rank 0 missed (its pick is blocked) and waited alone in the tuning
    # collectives until the group timed out, while rank 1 served tactic 2.
    a, b = (r["tune"] for r in ranks)
    assert "error" not in a and "error" not in b, (a, b)
    assert a["picks"] == b["picks"] == [1, 1, 1]  # re-tuned without the blocked tactic 2
    assert a["blocklist"] == b["blocklist"] == [2]


@pytest.mark.slow
def test_cache_only_ranks_whose_blocklists_differ_serve_the_same_pick(ranks) -> None:
    # Before alignment rank 0 ran the fallback -1 and rank 1 the blocked tactic 2.
    a, b = (r["serve"] for r in ranks)
    assert "error" not in a and "error" not in b, (a, b)
    assert a["picks"] == b["picks"] == [-1, -1, -1]
    assert a["blocklist"] == b["blocklist"] == [2]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", COLLECTIVE)
def test_a_tactic_blocked_on_one_rank_while_tuning_is_blocked_on_every_rank(
    ranks, strategy
) -> None:
    # Before, only the rank that timed the crash blocked it: the next look-up of "a" hit on the
    # other rank and re-tuned alone on this one, which waited until the group timed out.
    a, b = (r[f"run/{strategy}"] for r in ranks)
    assert "error" not in a and "error" not in b, (a, b)
    assert a["first"] == b["first"] == 2
    assert a["blocklist"] == b["blocklist"] == [2]
    assert a["again"] == b["again"] == 1


@pytest.mark.slow
def test_independent_ranks_keep_their_own_blocklists(ranks) -> None:
    # No collective under "independent": a crash blocks the tactic on its own rank only.
    a, b = (r["run/independent"] for r in ranks)
    assert (a["blocklist"], b["blocklist"]) == ([], [2])
    assert (a["again"], b["again"]) == (2, 1)


@pytest.mark.slow
def test_aligning_blocklists_leaves_equal_entries_to_other_processes(ranks) -> None:
    # Entries were replaced by equal copies from the exchange, counted as this rank's to save,
    # and the save put them back over the other process's re-tuned entry.
    a, b = (r["align"] for r in ranks)
    assert "error" not in a and "error" not in b, (a, b)
    assert (a["unsaved"], b["unsaved"]) == (0, 1)  # rank 1 took the blocked tactic, nothing else
    assert a["kept"] == b["kept"] == 0
