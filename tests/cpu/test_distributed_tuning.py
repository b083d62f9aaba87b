"""Distributed tuning strategies over gloo with two real processes and fake timers (principle 2).

One spawn of two ranks runs every scenario (a few seconds in all); the tests assert on what each
rank reported. Timings are rank-dependent fake costs, so every outcome is deterministic.
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import socket
import traceback
from typing import Any

import pytest
import torch
from fake_timers import Clock, ClockTimer

from graphtune.autotuner import (
    AutoTuner,
    DistributedTuning,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
    autotune,
)
from graphtune.autotuner.distributed import STRATEGIES
from graphtune.autotuner.timing.base import Measurement
from graphtune.autotuner.tuning import TuningRun
from graphtune.errors import ConfigError, DistributedError, TuningError

WORLD = 2
BUCKETS = (1, 4, 16)
CONFIG = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, BUCKETS),), warmup=0, repeat=1)
COLLECTIVE = ("broadcast", "parallel", "agree")

# Per-call cost of each tactic on each rank (rank-dependent: rank 0 likes 1, rank 1 likes 2).
# Max over ranks (agree): -1:10, 0:5, 1:6, 2:4 -> tactic 2 on both ranks.
SPLIT_COSTS = ({-1: 10.0, 0: 5.0, 1: 3.0, 2: 4.0}, {-1: 10.0, 0: 5.0, 1: 6.0, 2: 2.0})
# Same costs on both ranks; tactic 2 is fastest but raises on rank 1 only.
FAIL_COSTS = {-1: 10.0, 0: 5.0, 1: 3.0, 2: 1.0}
# Tactic 0 is 3% faster than the fallback on both ranks, but rank 0's timer jitters by 5% (alone
# it calls that a tie: the fallback) and rank 1's by 0.1% (alone: a win).
NOISY_COSTS = {-1: 100.0, 0: 97.0}
NOISE = (0.05, 0.001)


class RankRunner(TunableRunner):
    """Costs per tactic; ``fail`` tactics raise; logs (rows, tactic) of every call.

    Its attributes are test instruments that differ between ranks, not configuration: they are
    left out of its identity, so every rank offers the same runner."""

    identity_excludes = frozenset({"costs", "clock", "fail", "log"})

    def __init__(self, costs: dict, clock: Clock, fail: frozenset = frozenset()) -> None:
        self.costs, self.clock, self.fail = costs, clock, fail
        self.log: list[tuple[int, int]] = []

    def get_valid_tactics(self, inputs: list, profile: Any) -> list:
        return list(self.costs)

    def forward(self, inputs: list, tactic: Any = -1) -> Any:
        if tactic in self.fail:
            raise RuntimeError(f"tactic {tactic} does not run on this rank")
        self.log.append((int(inputs[0].shape[0]), tactic))
        self.clock.now_us += self.costs[tactic]
        return inputs[0]


class JitterTimer(ClockTimer):
    """ClockTimer times ``1 + pattern[k % 3]`` on a tactic's k-th measurement (the per-call cost
    identifies the tactic): every median is exactly the cost, the noise (MAD) exactly ``e``."""

    def __init__(self, clock: Clock, e: float) -> None:
        super().__init__(clock)
        self.pattern, self.counts = (e, -e, 0.0), {}

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        per_call = super().measure(fn, warmup=warmup, repeat=repeat).median_us
        k = self.counts[per_call] = self.counts.get(per_call, -1) + 1
        value = per_call * (1.0 + self.pattern[k % 3])
        return Measurement.from_samples([value], calls_per_sample=repeat, timer=self.name)


def _tune_noisy(rank: int, strategy: str, group: Any) -> dict:
    clock = Clock()
    tuner = AutoTuner(JitterTimer(clock, NOISE[rank]))
    with autotune(None, tuner, distributed=DistributedTuning(strategy, group)):
        tuner.choose_one("op", [RankRunner(NOISY_COSTS, clock)], CONFIG, [torch.zeros(4, 8)])
    return {
        "picks": {str(key.shapes[0][0]): entry.tactic for key, entry in tuner.cache.items()},
        "extra_rounds": tuner.stats.extra_rounds,
        "history": [
            (
                r.winner_index,
                r.tie_band,
                [(c.tactic, c.median_us, c.samples, c.tied) for c in r.candidates],
            )
            for r in tuner.history
        ],
    }


def _tune(rank: int, strategy: str, costs: dict, fail: frozenset, path: str, group: Any) -> dict:
    clock = Clock()
    runner = RankRunner(costs, clock, fail)
    tuner = AutoTuner(ClockTimer(clock))
    setting = DistributedTuning(strategy, group)
    with autotune(path, tuner, distributed=setting):
        tuner.choose_one("op", [runner], CONFIG, [torch.zeros(4, 8)])
    picks = {str(key.shapes[0][0]): entry.tactic for key, entry in tuner.cache.items()}
    with open(path, encoding="utf-8") as handle:
        doc = json.load(handle)
    return {
        "picks": picks,
        "timed": sorted(set(runner.log)),
        "tuned_by": [item["value"].get("tuned_by") for item in doc["entries"]],
        "failures": dict(tuner.stats.tactic_failures),
    }


def _look_up_after_caches_differ(rank: int, case: str, tmp: str) -> dict:
    """Rank 0's cache file holds picks it tuned alone; rank 1's holds none (``missing``) or its
    own, other picks (``differs``). Then both look up every bucket under ``agree``."""
    path = f"{tmp}/align-{case}-{rank}.json"
    if rank == 0 or case == "differs":
        clock = Clock()
        alone = AutoTuner(ClockTimer(clock))
        with autotune(path, alone, distributed="independent"):
            for rows in BUCKETS:
                alone.choose_one(
                    "op", [RankRunner(SPLIT_COSTS[rank], clock)], CONFIG, [torch.zeros(rows, 8)]
                )
    clock = Clock()
    runner = RankRunner(SPLIT_COSTS[rank], clock)
    tuner = AutoTuner(ClockTimer(clock))
    with autotune(path, tuner, distributed="agree"):
        picks = [
            tuner.choose_one("op", [runner], CONFIG, [torch.zeros(rows, 8)])[1] for rows in BUCKETS
        ]
    return {"picks": picks, "timed": sorted(set(runner.log))}


def _worker(rank: int, init: str, tmp: str, results) -> None:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
        try:
            group = dist.new_group([0, 1])
            for strategy in STRATEGIES:
                out[f"split/{strategy}"] = _tune(
                    rank,
                    strategy,
                    SPLIT_COSTS[rank],
                    frozenset(),
                    f"{tmp}/split-{strategy}-{rank}.json",
                    None,
                )
                fail = frozenset({2}) if rank == 1 else frozenset()
                out[f"fail/{strategy}"] = _tune(
                    rank, strategy, FAIL_COSTS, fail, f"{tmp}/fail-{strategy}-{rank}.json", group
                )
                out[f"noisy/{strategy}"] = _tune_noisy(rank, strategy, group)
            for case in ("missing", "differs"):
                out[f"align/{case}"] = _look_up_after_caches_differ(rank, case, tmp)
            # Ranks tuning different shapes: every rank raises instead of hanging.
            try:
                clock = Clock()
                tuner = AutoTuner(ClockTimer(clock), distributed="agree")
                config = TuningConfig(
                    dynamic_specs=(DynamicTensorSpec(0, 0, (1, 2 + rank)),), warmup=0, repeat=1
                )
                with autotune(None, tuner):
                    tuner.choose_one(
                        "op", [RankRunner(FAIL_COSTS, clock)], config, [torch.zeros(1, 8)]
                    )
                out["mismatch"] = "no error"
            except DistributedError as exc:
                out["mismatch"] = str(exc)
            # A rank that must stop (e.g. a tactic corrupted its CUDA context) still joins the
            # collective, then every rank raises.
            tuner = AutoTuner(ClockTimer(Clock()), distributed="agree")
            if rank == 1:  # this process is rank 1 only: patching the class touches no other

                def stop(*args: Any) -> None:
                    raise TuningError("context corrupted (simulated)")

                TuningRun._time_candidates = stop  # type: ignore[method-assign]
            try:
                with autotune(None, tuner):
                    tuner.choose_one(
                        "op", [RankRunner(FAIL_COSTS, Clock())], CONFIG, [torch.zeros(4, 8)]
                    )
                out["abort"] = "no error"
            except (TuningError, DistributedError) as exc:
                out["abort"] = f"{type(exc).__name__}: {exc}"
            dist.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, out, None))
    except BaseException:  # report it to the parent, which fails the test with the traceback
        results.put((rank, out, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dist")
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, init, str(tmp), results)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    got: dict[int, dict] = {}
    try:
        for _ in range(WORLD):
            rank, out, error = results.get(timeout=90)
            assert error is None, f"rank {rank} failed:\n{error}"
            got[rank] = out
    except queue.Empty:
        pytest.fail("a rank hung (no result within 90 s): a collective was not reached by all")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert [proc.exitcode for proc in procs] == [0] * WORLD
    return [got[r] for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", COLLECTIVE)
@pytest.mark.parametrize("scenario", ["split", "fail"])
def test_collective_strategies_pick_the_same_on_every_rank(ranks, strategy, scenario) -> None:
    a, b = (r[f"{scenario}/{strategy}"] for r in ranks)
    assert len(a["picks"]) == len(BUCKETS)
    assert a["picks"] == b["picks"]


@pytest.mark.slow
def test_each_strategy_picks_what_its_rule_says(ranks) -> None:
    rank0, rank1 = ranks
    every = {str(b): t for b in BUCKETS for t in [None]}
    # agree reduces with max: rank 1's slow tactic 1 loses to tactic 2.
    assert rank0["split/agree"]["picks"] == {k: 2 for k in every}
    # broadcast: rank 0's own pick.
    assert rank0["split/broadcast"]["picks"] == {k: 1 for k in every}
    # A tactic raising on rank 1 only: agree never picks it; broadcast (rank 0 timed) does.
    assert rank0["fail/agree"]["picks"] == {k: 1 for k in every}
    assert rank0["fail/broadcast"]["picks"] == {k: 2 for k in every}
    assert rank1["fail/agree"]["failures"] == {"RuntimeError": len(BUCKETS)}
    assert rank1["fail/broadcast"]["timed"] == []  # the other ranks time nothing


@pytest.mark.slow
@pytest.mark.parametrize("strategy", COLLECTIVE)
def test_noise_aware_pick_uses_only_agreed_times(ranks, strategy) -> None:
    # The ranks' own noise differs (5% vs 0.1%), but the pick sees one agreed time per candidate:
    # no noise band (only the 0.5% floor), no adaptive rounds, the same records on both ranks.
    a, b = (r[f"noisy/{strategy}"] for r in ranks)
    assert a["picks"] == b["picks"] == {str(bucket): 0 for bucket in BUCKETS}
    assert a["extra_rounds"] == b["extra_rounds"] == 0
    assert a["history"] == b["history"]
    assert a["history"][0] == (1, 0.005, [(-1, 100.0, 1, False), (0, 97.0, 1, True)])


@pytest.mark.slow
def test_independent_ranks_apply_the_noise_rule_to_their_own_samples(ranks) -> None:
    noisy, tight = (r["noisy/independent"] for r in ranks)
    assert noisy["picks"] == {str(bucket): -1 for bucket in BUCKETS}  # 3% is inside 5% noise
    assert noisy["extra_rounds"] == 6 * len(BUCKETS)  # undecided to the last extra round
    assert tight["picks"] == {str(bucket): 0 for bucket in BUCKETS}
    assert tight["extra_rounds"] == 0


@pytest.mark.slow
def test_independent_ranks_may_pick_differently(ranks) -> None:
    # Documented: without collectives each rank follows its own timer.
    assert ranks[0]["split/independent"]["picks"] == {str(b): 1 for b in BUCKETS}
    assert ranks[1]["split/independent"]["picks"] == {str(b): 2 for b in BUCKETS}
    assert ranks[1]["fail/independent"]["picks"] == {str(b): 1 for b in BUCKETS}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["split", "fail"])
def test_parallel_splits_the_work_without_overlap(ranks, scenario) -> None:
    timed = [set(map(tuple, r[f"{scenario}/parallel"]["timed"])) for r in ranks]
    everything = {(b, t) for b in BUCKETS for t in (-1, 0, 1, 2)}
    if scenario == "fail":  # rank 1's calls of tactic 2 raise before they are logged
        assert not timed[0] & timed[1]
        assert timed[0] | timed[1] | {(b, 2) for b in BUCKETS} == everything
    else:
        assert timed[0] and timed[1] and not timed[0] & timed[1]
        assert timed[0] | timed[1] == everything


@pytest.mark.slow
def test_saved_cache_records_strategy_and_world_size(ranks) -> None:
    for rank in ranks:
        for strategy in STRATEGIES:
            tuned_by = rank[f"split/{strategy}"]["tuned_by"]
            assert tuned_by == [{"strategy": strategy, "world_size": WORLD}] * len(BUCKETS)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "differs"])
def test_ranks_whose_caches_differ_look_up_the_lowest_ranks_picks(ranks, case) -> None:
    # Without aligning the caches, "missing" hangs both ranks (rank 1 alone enters the tuning
    # collectives) and "differs" runs tactic 1 on rank 0 and tactic 2 on rank 1.
    a, b = (r[f"align/{case}"] for r in ranks)
    assert a["picks"] == b["picks"] == [1, 1, 1]  # what rank 0 tuned alone
    assert a["timed"] == b["timed"] == []  # nothing was tuned again


def test_ranks_tuning_different_shapes_all_raise(ranks) -> None:
    for rank in ranks:
        assert "tuning other profiles than rank 0" in rank["mismatch"]


@pytest.mark.slow
def test_a_rank_that_stops_makes_every_rank_stop(ranks) -> None:
    assert ranks[0]["abort"].startswith(
        "DistributedError: op 'op': rank 1 of the tuning group failed while timing its tactics "
        "(TuningError: context corrupted (simulated))"
    ), ranks[0]["abort"]
    assert ranks[1]["abort"] == "TuningError: context corrupted (simulated)"


def test_strategy_is_validated() -> None:
    with pytest.raises(ConfigError, match="independent, broadcast, parallel, agree"):
        DistributedTuning("allreduce")
    with pytest.raises(ConfigError, match="DistributedTuning"):
        AutoTuner(distributed=3)  # type: ignore[arg-type]
    assert AutoTuner(distributed="agree").distributed == DistributedTuning("agree")


def test_collective_strategy_needs_an_initialised_group() -> None:
    assert not torch.distributed.is_initialized()
    tuner = AutoTuner(ClockTimer(Clock()), distributed="agree")
    with pytest.raises(DistributedError, match="init_process_group"), autotune(None, tuner):
        tuner.choose_one("op", [RankRunner(FAIL_COSTS, Clock())], CONFIG, [torch.zeros(4, 8)])
    assert tuner.distributed == DistributedTuning("agree")


def test_independent_without_a_group_records_world_size_one(tmp_path) -> None:
    result = _tune(0, "independent", FAIL_COSTS, frozenset(), str(tmp_path / "c.json"), None)
    assert result["picks"] == {str(b): 2 for b in BUCKETS}
    assert result["tuned_by"] == [{"strategy": "independent", "world_size": 1}] * len(BUCKETS)


def test_tuned_by_survives_save_load_and_verify(tmp_path) -> None:
    from graphtune.autotuner import CacheEntry, CacheKey, persist
    from graphtune.autotuner.maintenance import verify_file

    path = tmp_path / "c.json"
    key = CacheKey("op", ("mod.R",), ((4, 8),), ("float32",), "fake", device="cpu")
    tuned_by = {"strategy": "parallel", "world_size": 2}
    persist.save(path, {key: CacheEntry("mod.R", 0, 3, 1.0, 2.0, tuned_by)})
    persist.save(tmp_path / "plain.json", {key: CacheEntry("mod.R", 0, 3, 1.0, 2.0)})
    assert persist.load(path, strict=True)[key].tuned_by == tuned_by
    assert "tuned_by" not in (tmp_path / "plain.json").read_text()  # old layout kept
    assert verify_file(path).problems == []
