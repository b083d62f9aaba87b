"""The noise-aware pick: the band (pure functions), the tie rule, adaptive rounds and history.

Tuner tests use a fake timer whose relative jitter cycles per candidate over a fixed pattern, so
every candidate's k-th measurement carries the same factor: medians are exactly the costs, the
noise (MAD) is exactly known, and every outcome below is deterministic.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from graphtune.autotuner import (
    FALLBACK_TACTIC,
    AutoTuner,
    CandidateRecord,
    DynamicTensorSpec,
    ProfileRecord,
    TunableRunner,
    TuningConfig,
    TuningPolicy,
    autotune,
)
from graphtune.autotuner.selection import (
    MAD_TO_SIGMA,
    SE_OF_MEDIAN,
    TieRule,
    median_standard_error,
    noise_band,
    relative_iqr,
)
from graphtune.autotuner.timing.base import Measurement
from graphtune.errors import ConfigError

ONE_BUCKET = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)
X = [torch.zeros(4, 2)]

# -- pure functions ------------------------------------------------------------------------------


def test_standard_error_of_identical_or_single_samples_is_zero() -> None:
    assert median_standard_error([5.0] * 6) == 0.0
    assert median_standard_error([5.0]) == 0.0
    assert median_standard_error([]) == 0.0


def test_standard_error_is_robust_mad_over_sqrt_n() -> None:
    samples = [1.0, 2.0, 3.0, 4.0, 5.0]  # median 3, MAD 1
    want = SE_OF_MEDIAN * MAD_TO_SIGMA * 1.0 / math.sqrt(5)
    assert median_standard_error(samples) == pytest.approx(want)
    # One wild outlier barely moves it (the MAD ignores how far the outlier is).
    assert median_standard_error([1.0, 2.0, 3.0, 4.0, 500.0]) == pytest.approx(want)


def test_band_is_zero_without_noise_and_grows_with_it() -> None:
    assert noise_band([100.0] * 6, [103.0] * 6, z=2.0, cap=0.05) == 0.0
    assert noise_band([100.0], [103.0], z=2.0, cap=0.05) == 0.0  # agreed single times
    tight = noise_band([99.9, 100.0, 100.1] * 2, [102.9, 103.0, 103.1] * 2, z=2.0, cap=0.05)
    loose = noise_band([99.0, 100.0, 101.0] * 2, [102.0, 103.0, 104.0] * 2, z=2.0, cap=0.05)
    assert 0.0 < tight < loose
    assert loose == pytest.approx(10 * tight)  # linear in the spread
    se = SE_OF_MEDIAN * MAD_TO_SIGMA * 1.0 / math.sqrt(6)
    assert loose == pytest.approx(2.0 * math.hypot(se, se) / 100.0)
    assert noise_band([99.0, 100.0, 101.0] * 2, [102.0, 103.0, 104.0] * 2, z=4.0, cap=1.0) == (
        pytest.approx(2 * loose)
    )


def test_band_is_capped() -> None:
    wild = [50.0, 100.0, 150.0] * 2
    assert noise_band(wild, wild, z=2.0, cap=0.05) == 0.05
    assert noise_band(wild, wild, z=2.0, cap=0.2) == 0.2


def test_relative_iqr_matches_measurement_spread() -> None:
    for samples in ([1.0], [1.0, 1.2], [1.0, 1.1, 1.3], [0.9, 1.0, 1.0, 1.1, 1.4, 1.0]):
        want = Measurement.from_samples(samples, calls_per_sample=1, timer="t").spread
        assert relative_iqr(samples) == pytest.approx(want)


def test_rule_with_single_samples_is_the_floor_only() -> None:
    rule = TieRule(floor=0.005)
    picked = rule.select([[100.0], [99.6], [97.0]])
    # 97 is fastest; 99.6 is 2.7% slower (not tied), 100 is 3.1% slower: 97 wins alone.
    assert (picked.fastest, picked.winner, picked.tied) == (2, 2, (False, False, True))
    assert picked.undecided == () and picked.tie_band == 0.005
    picked = rule.select([[100.0], [99.6], [120.0]])
    # 100 is 0.4% slower than 99.6: under the floor, tied, and the earlier-listed wins.
    assert (picked.fastest, picked.winner, picked.tied) == (1, 0, (True, True, False))


def test_rule_ties_inside_the_noise_and_marks_it_undecided() -> None:
    rule = TieRule(floor=0.005, z=2.0, cap=0.05)
    fallback = [95.0, 100.0, 105.0] * 2  # 5% jitter
    faster = [92.15, 97.0, 101.85] * 2  # 3.1% faster, same jitter
    picked = rule.select([fallback, faster])
    assert (picked.fastest, picked.winner, picked.tied) == (1, 0, (True, True))
    assert picked.undecided == (0,) and picked.tie_band == 0.05  # the cap
    tight = rule.select([[99.9, 100.0, 100.1] * 2, [96.9, 97.0, 97.1] * 2])
    assert (tight.winner, tight.tied, tight.undecided) == (1, (False, True), ())


def test_rule_skips_failed_candidates_and_breaks_equal_medians_by_order() -> None:
    rule = TieRule(floor=0.0)
    assert rule.select([[], [50.0], [50.0]]).winner == 1
    picked = rule.select([[], []])
    assert (picked.fastest, picked.winner, picked.tied) == (None, None, (False, False))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tie_tolerance": 1.5}, "tie_tolerance"),
        ({"tie_tolerance": -0.1}, "tie_tolerance"),
        ({"max_tie_tolerance": 1.0}, "max_tie_tolerance"),
        ({"noise_z": 0}, "noise_z"),
        ({"noise_z": float("nan")}, "noise_z"),
        ({"noise_z": True}, "noise_z"),
        ({"max_extra_rounds": -1}, "max_extra_rounds"),
        ({"max_extra_rounds": 1.5}, "max_extra_rounds"),
        ({"tie_floor_us": -0.01}, "tie_floor_us"),
        ({"tie_floor_us": float("inf")}, "tie_floor_us"),
        ({"tie_floor_us": True}, "tie_floor_us"),
        ({"input_sets": 0}, "input_sets"),
        ({"input_sets": 2.0}, "input_sets"),
    ],
)
def test_policy_knobs_are_validated(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TuningPolicy(**kwargs)


def test_defaults() -> None:
    tuner = AutoTuner(show_progress=False)
    policy = tuner.policy
    assert policy == TuningPolicy() and tuner.history == []
    assert (policy.tie_tolerance, policy.noise_z, policy.max_tie_tolerance) == (0.005, 2.0, 0.05)
    assert policy.max_extra_rounds == 6 and policy.rounds == 3 and policy.remeasure_top == 3
    assert policy.tie_floor_us == 0.03 and policy.input_sets == 1
    with pytest.raises(ConfigError, match="policy"):
        AutoTuner(policy={"rounds": 1})  # type: ignore[arg-type]


def test_absolute_floor_ties_nanosecond_gaps_on_microsecond_kernels() -> None:
    # 1.700 vs 1.720 us: a 1.2% gap, above the 0.5% relative floor, but only 20 ns.
    samples = [[1.720] * 6, [1.700] * 6]
    assert TieRule(0.005, 2.0, 0.05).select(samples).winner == 1
    chosen = TieRule(0.005, 2.0, 0.05, floor_us=0.03).select(samples)
    assert chosen.winner == 0 and chosen.tied == (True, True)
    assert chosen.tie_band == pytest.approx(0.03 / 1.700) and chosen.undecided == ()
    # At 100 us the same 30 ns is 0.03%: the relative floor decides.
    assert TieRule(0.005, 2.0, 0.05, floor_us=0.03).select([[101.0] * 3, [100.0] * 3]).winner == 1


# -- the tuner with a fake timer -----------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now_us = 0.0
        self.log: list[tuple[str, Any]] = []


class CostRunner(TunableRunner):
    """Each call advances the clock by the tactic's cost; ``fail`` tactics raise."""

    def __init__(self, name: str, costs: dict, clock: Clock, fail: frozenset = frozenset()):
        self.name, self.costs, self.clock, self.fail = name, costs, clock, fail

    def get_valid_tactics(self, inputs: list, profile: Any) -> list:
        return list(self.costs)

    def forward(self, inputs: list, tactic: Any = FALLBACK_TACTIC) -> Any:
        if tactic in self.fail:
            raise RuntimeError(f"{self.name} tactic {tactic} does not run here")
        self.clock.now_us += self.costs[tactic]
        self.clock.log.append((self.name, tactic))
        return inputs[0]

    def cache_key_extras(self) -> tuple:
        return (self.name,)


class JitterTimer:
    """The clock's per-call time times ``1 + pattern[k % len(pattern)]`` for a candidate's k-th
    measurement; counts measurements per candidate and logs their order."""

    name = "fake"

    def __init__(self, clock: Clock, pattern: tuple[float, ...]) -> None:
        self.clock, self.pattern = clock, pattern
        self.counts: Counter = Counter()
        self.order: list[tuple[str, Any]] = []

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        start = self.clock.now_us
        fn(0)
        per_call = self.clock.now_us - start
        who = self.clock.log[-1]
        k = self.counts[who]
        self.counts[who] += 1
        self.order.append(who)
        value = per_call * (1.0 + self.pattern[k % len(self.pattern)])
        return Measurement.from_samples([value], calls_per_sample=1, timer=self.name)


def jitter(e: float) -> tuple[float, ...]:
    # Any 3k samples: median 0, MAD e (also for 3k+1 and 3k+2 samples): se = 1.86 e / sqrt(n).
    return (e, -e, 0.0)


def tune(
    costs_a: dict,
    costs_b: dict,
    e: float,
    fail_b: frozenset = frozenset(),
    config: TuningConfig = ONE_BUCKET,
    **kwargs: Any,
):
    clock = Clock()
    timer = JitterTimer(clock, jitter(e))
    runners = [CostRunner("a", costs_a, clock), CostRunner("b", costs_b, clock, fail_b)]
    tuner = AutoTuner(timer=timer, show_progress=False, policy=TuningPolicy(**kwargs))
    with autotune(None, tuner):
        runner, tactic = tuner.choose_one("op", runners, config, X)
    return (runner.name, tactic), tuner, timer


@pytest.mark.parametrize("cost", [97.0, 98.5])
def test_a_measurably_faster_tactic_beats_the_fallback(cost: float) -> None:
    # 3% and 1.5% faster with 0.1% jitter: far outside the noise, above the 0.5% floor. (The
    # old fixed 2% tolerance gave the 1.5% case to the fallback.)
    pick, tuner, timer = tune({-1: 100.0}, {0: cost}, e=0.001)
    assert pick == ("b", 0)
    assert tuner.stats.extra_rounds == 0
    assert timer.counts == {("a", -1): 6, ("b", 0): 6}  # 3 rounds + 3 re-measured, no more


def test_the_floor_still_ties_small_gaps() -> None:
    pick, _, _ = tune({-1: 100.0}, {0: 98.5}, e=0.001, tie_tolerance=0.02)
    assert pick == ("a", -1)  # tie_tolerance=0.02 keeps the old 2% behaviour
    pick, _, _ = tune({-1: 100.0}, {0: 99.8}, e=0.001)
    assert pick == ("a", -1)  # 0.2% faster: under the default 0.5% floor


def test_a_gap_inside_the_noise_is_a_tie_and_the_fallback_wins() -> None:
    # 5% jitter: the band (10.9% at 6 samples, 7.7% at 12) stays above the 5% cap, so the 3.1%
    # gap stays undecided through every extra round and the tie goes to the lower index.
    pick, tuner, timer = tune({-1: 100.0}, {0: 97.0}, e=0.05)
    assert pick == ("a", -1)
    assert tuner.stats.extra_rounds == 6
    assert timer.counts == {("a", -1): 12, ("b", 0): 12}
    record = tuner.history[-1]
    assert record.winner_index == 0 and record.tie_band == 0.05
    assert [c.tied for c in record.candidates] == [True, True]
    # Without extra rounds the decision is the same, on fewer samples.
    pick, tuner, timer = tune({-1: 100.0}, {0: 97.0}, e=0.05, max_extra_rounds=0)
    assert pick == ("a", -1) and tuner.stats.extra_rounds == 0
    assert timer.counts == {("a", -1): 6, ("b", 0): 6}


def test_adaptive_rounds_measure_only_the_fastest_and_the_undecided() -> None:
    # b0 (97) is fastest. a-1 (100) is 3.09% slower: with 1.7% jitter its band is 3.70% at 6
    # samples, 3.43% at 7, 3.21% at 8 and 3.02% at 9, so it is undecided for exactly 3 extra
    # rounds. b2 (0.2% slower than b0) is under the floor: tied at once, never re-measured.
    # a0 and b1 are far away: more than the race margin (15%) behind after the first round.
    pick, tuner, timer = tune({-1: 100.0, 0: 130.0}, {0: 97.0, 1: 120.0, 2: 97.2}, e=0.017)
    assert pick == ("b", 0)
    assert tuner.stats.extra_rounds == 3 and tuner.stats.raced_out == 2
    assert timer.counts == {
        ("a", -1): 9,
        ("b", 0): 9,  # 3 rounds + 3 re-measured (top 3) + 3 extra
        ("b", 2): 6,  # top 3, tied by the floor: no extra rounds
        ("a", 0): 1,
        ("b", 1): 1,  # out of the race after the first round
    }
    # The extra rounds are interleaved: fastest and undecided, round-robin, in tie-break order.
    assert timer.order[-6:] == [("a", -1), ("b", 0)] * 3
    record = tuner.history[-1]
    assert [(c.runner_index, c.tactic, c.tied) for c in record.candidates] == [
        (0, -1, False),
        (0, 0, False),
        (1, 0, True),
        (1, 1, False),
        (1, 2, True),
    ]
    assert record.winner_index == 2


def test_history_records_what_was_measured() -> None:
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 4, 16)),), warmup=0, repeat=1)
    pick, tuner, _ = tune(
        {-1: 100.0}, {0: 97.0, 1: 50.0}, e=0.001, fail_b=frozenset({1}), config=config
    )
    assert pick == ("b", 0)
    assert len(tuner.history) == 3 and all(isinstance(r, ProfileRecord) for r in tuner.history)
    assert [r.profile for r in tuner.history] == ["1x2", "4x2", "16x2"]
    record = tuner.history[-1]
    assert record.op == "op" and record.winner_index == 1 and record.tie_band == 0.005
    fallback, winner, broken = record.candidates
    assert isinstance(winner, CandidateRecord)
    assert fallback == CandidateRecord(
        runner='CostRunner["a"]',
        runner_index=0,
        tactic=-1,
        median_us=100.0,
        spread=pytest.approx(0.002),
        samples=6,
        failed=None,
        tied=False,
    )
    assert (winner.runner, winner.runner_index, winner.tactic) == ('CostRunner["b"]', 1, 0)
    assert winner.median_us == pytest.approx(97.0) and winner.samples == 6 and winner.tied
    assert broken.failed == "RuntimeError" and broken.median_us == math.inf
    assert not broken.tied and broken.samples == 0
    # The record agrees with the cache entry.
    entry = next(e for k, e in tuner.cache.items() if k.shapes[0] == (16, 2))
    assert entry.time_us == pytest.approx(winner.median_us)
    assert entry.fallback_us == pytest.approx(fallback.median_us)


def test_history_when_every_candidate_fails() -> None:
    clock = Clock()
    runner = CostRunner("a", {-1: 1.0, 0: 2.0}, clock, fail=frozenset({-1, 0}))
    tuner = AutoTuner(timer=JitterTimer(clock, (0.0,)), show_progress=False)
    with autotune(None, tuner):
        assert tuner.choose_one("op", [runner], ONE_BUCKET, X) == (runner, -1)
    record = tuner.history[-1]
    assert record.winner_index is None
    assert [c.failed for c in record.candidates] == ["RuntimeError", "RuntimeError"]


def test_cache_hits_add_no_history() -> None:
    _, tuner, _ = tune({-1: 100.0}, {0: 97.0}, e=0.001)
    runners = [CostRunner("a", {-1: 100.0}, Clock()), CostRunner("b", {0: 97.0}, Clock())]
    with autotune(None, tuner):
        tuner.choose_one("op", runners, ONE_BUCKET, X)
    assert len(tuner.history) == 1 and tuner.stats.hits == 1


def test_the_context_helpers_live_in_context_only() -> None:
    import graphtune.autotuner.tuner as tuner_module
    from graphtune.autotuner import autotune as exported
    from graphtune.autotuner.context import autotune

    assert exported is autotune
    assert not hasattr(tuner_module, "autotune") and not hasattr(tuner_module, "get_tuner")


# -- input sets -----------------------------------------------------------------------------------


class SetRunner(TunableRunner):
    """Costs 10 us, logs which synthetic input set (by its first value) each call ran on."""

    def __init__(self, name: str, clock: Clock) -> None:
        self.name, self.clock, self.seen = name, clock, []

    def get_valid_tactics(self, inputs: list, profile: Any) -> list:
        return [FALLBACK_TACTIC]

    def forward(self, inputs: list, tactic: Any = FALLBACK_TACTIC) -> Any:
        self.clock.now_us += 10.0
        self.clock.log.append((self.name, tactic))
        self.seen.append(float(inputs[0].flatten()[0]))
        return inputs[0]

    def cache_key_extras(self) -> tuple:
        return (self.name,)


def _tune_sets(config: TuningConfig, **kwargs: Any) -> tuple[list[SetRunner], AutoTuner]:
    clock = Clock()
    runners = [SetRunner("a", clock), SetRunner("b", clock)]
    tuner = AutoTuner(
        timer=JitterTimer(clock, (0.0,)), show_progress=False, policy=TuningPolicy(**kwargs)
    )
    with autotune(None, tuner):
        tuner.choose_one("op", runners, config, [torch.randn(4, 2)])
    return runners, tuner


def test_input_sets_give_each_measurement_round_its_own_set() -> None:
    runners, tuner = _tune_sets(ONE_BUCKET, input_sets=3)
    first, second = runners
    # JitterTimer makes one call per measurement: 3 rounds + 3 re-measured (top 3) = 6 each.
    assert len(first.seen) == len(second.seen) == 6
    sets = list(dict.fromkeys(first.seen))
    assert len(sets) == 3  # three distinct synthetic sets, in order 0, 1, 2, 0, 1, 2
    assert first.seen == sets * 2 and second.seen == first.seen  # paired: same set per round
    # One set by default: every measurement on the same inputs.
    runners, _ = _tune_sets(ONE_BUCKET)
    assert len(set(runners[0].seen)) == 1


def test_input_sets_stop_at_the_byte_budget(monkeypatch) -> None:
    import graphtune.autotuner.tuning as tuning_module

    monkeypatch.setattr(tuning_module, "INPUT_SET_BYTES", 2 * 4 * 2 * 4)  # two [4, 2] float sets
    runners, _ = _tune_sets(ONE_BUCKET, input_sets=3)
    assert len(set(runners[0].seen)) == 2


def test_cold_l2_rotates_copies_inside_every_measurement_and_ignores_input_sets() -> None:
    from dataclasses import replace

    cold = replace(ONE_BUCKET, cold_l2=True)
    runners, _ = _tune_sets(cold, input_sets=3)
    # Call i of a measurement runs copy i: this timer makes one call (i = 0) per measurement, so
    # every measurement starts at copy 0 instead of moving to set k % 3 at its k-th sample.
    assert len(runners[0].seen) == 6 and len(set(runners[0].seen)) == 1
