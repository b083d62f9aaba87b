"""Racing: after the first round, candidates far behind the fastest leave the race (the rule:
``graphtune.autotuner.schedule.race``), with fake runners and a fake clock."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_autotuner_tuner import make

from graphtune.autotuner import (
    AutoTuner,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
    TuningPolicy,
)
from graphtune.autotuner.timing.base import Measurement
from graphtune.errors import ConfigError


def test_candidates_far_behind_after_the_first_round_leave_the_race() -> None:
    # b0 (1.0) is fastest; a0 (1.10) is inside the 15% margin and races on; a-1 (1.2) and
    # b1 (3.0) are measured once, and lose.
    tuner, runners, timer = make({-1: 1.2, 0: 1.1}, {0: 1.0, 1: 3.0}, rounds=3, remeasure_top=0)
    tuner.tuning_mode = True
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)
    assert tuner.choose_one("op", runners, config, [torch.randn(4, 2)]) == (runners[1], 0)
    everyone = [("a", -1), ("a", 0), ("b", 0), ("b", 1)]
    assert timer.order == everyone + [("a", 0), ("b", 0)] * 2
    assert tuner.stats.raced_out == 2 and tuner.stats.measurements == 8
    record = tuner.history[-1]
    assert [c.samples for c in record.candidates] == [1, 3, 3, 1]  # the losers keep their time
    # Re-measuring the fastest three takes the ones still racing only: a-1 keeps one sample.
    tuner, runners, timer = make({-1: 1.2, 0: 1.1}, {0: 1.0, 1: 3.0}, rounds=3, remeasure_top=3)
    tuner.tuning_mode = True
    tuner.choose_one("op", runners, config, [torch.randn(4, 2)])
    assert [c.samples for c in tuner.history[-1].candidates] == [1, 6, 6, 1]
    assert tuner.stats.raced_out == 2


def test_racing_never_drops_a_candidate_the_tie_floor_would_tie() -> None:
    # 0.12 against 0.10 µs (4 rows at 0.03 and 0.025) is 20% behind, but within tie_floor_us
    # (0.03 µs): a tie, so it races on, and the earlier-listed one wins the tie.
    tuner, runners, _ = make({0: 0.03}, {0: 0.025}, rounds=3, remeasure_top=0)
    tuner.tuning_mode = True
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)
    assert tuner.choose_one("op", runners, config, [torch.randn(4, 2)]) == (runners[0], 0)
    assert tuner.stats.raced_out == 0


def test_racing_can_be_turned_off_and_is_validated() -> None:
    tuner, runners, timer = make(
        {-1: 1.2, 0: 1.1}, {0: 1.0, 1: 3.0}, rounds=3, remeasure_top=0, race_margin=0
    )
    tuner.tuning_mode = True
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)
    tuner.choose_one("op", runners, config, [torch.randn(4, 2)])
    assert tuner.stats.raced_out == 0 and tuner.stats.measurements == 12
    with pytest.raises(ConfigError, match="race_margin"):
        TuningPolicy(race_margin=0.01)  # below the 5% noise cap: a dropped one could have tied
    with pytest.raises(ConfigError, match="race_margin"):
        TuningPolicy(race_margin=float("inf"))


class Scripted(TunableRunner):
    """Tactic ``t``'s n-th measurement takes ``script[t][n]`` µs (the last one repeats)."""

    def __init__(self, script: dict[str, list[float]]) -> None:
        self.script, self.seen = script, {t: 0 for t in script}

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return list(self.script)

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        times = self.script[tactic]
        self.seen[tactic] += 1
        return times[min(self.seen[tactic], len(times)) - 1]


class ReportTimer:
    name = "fake"

    def measure(self, fn: Any, *, warmup: int, repeat: int) -> Measurement:
        return Measurement.from_samples([fn(0)], calls_per_sample=1, timer=self.name)


@pytest.mark.parametrize("extra", [0, 6])
def test_a_raced_out_candidate_is_not_tied_in_when_the_leaders_median_rises(extra: int) -> None:
    # B's first sample (100) races A (116, 16% behind) out; B's median then rises to 113, which
    # would tie A's one sample within the 5% noise band and hand A the pick on one sample.
    runner = Scripted({"A": [116.0], "B": [100.0, 113.0, 116.0, 113.0]})
    policy = TuningPolicy(max_extra_rounds=extra)
    tuner = AutoTuner(timer=ReportTimer(), show_progress=False, policy=policy)
    tuner.tuning_mode = True
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)
    assert tuner.choose_one("op", [runner], config, [torch.zeros(4, 2)])[1] == "B"
    assert tuner.stats.raced_out == 1 and runner.seen["A"] == 1
    assert [c.tied for c in tuner.history[-1].candidates] == [False, True]


def race_tuner(script: dict[str, list[float]]) -> tuple[AutoTuner, Scripted, Any]:
    """A tuner with default policy over one ``Scripted`` runner (its tactics in script order)."""
    runner = Scripted(script)
    tuner = AutoTuner(timer=ReportTimer(), show_progress=False)
    tuner.tuning_mode = True
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)
    pick = tuner.choose_one("op", [runner], config, [torch.zeros(4, 2)])[1]
    return tuner, runner, pick


def test_a_raced_out_candidate_is_retimed_and_picked_when_the_leaders_median_rises_past_it() -> (
    None
):
    # B's first sample (100) races A (130, 30% behind) out; B's later samples rise to 200, a
    # median 54% above A's one sample: the race's premise broke. A is timed again to B's sample
    # count (3), interleaved with B, and wins on its median. (Before: B won at 200 µs.)
    tuner, runner, pick = race_tuner({"A": [130.0], "B": [100.0, 200.0]})
    assert pick == "A"
    assert runner.seen == {"A": 3, "B": 5}  # 1 + 2 re-timed; 3 racing + 2 beside A
    assert tuner.stats.measurements == 8
    assert tuner.stats.retimed == 1 and tuner.stats.raced_out == 0
    record = tuner.history[-1]
    assert [c.samples for c in record.candidates] == [3, 5]
    assert [c.median_us for c in record.candidates] == [130.0, 200.0]
    assert record.winner_index == 0


def test_a_retimed_candidate_that_is_really_slower_is_not_picked() -> None:
    # A's first sample (130) was lucky: re-timed, it takes 250, above B's median (200).
    tuner, runner, pick = race_tuner({"A": [130.0, 250.0], "B": [100.0, 200.0]})
    assert pick == "B"
    assert runner.seen == {"A": 3, "B": 5}
    assert tuner.stats.retimed == 1 and tuner.stats.raced_out == 0
    assert [c.samples for c in tuner.history[-1].candidates] == [3, 5]


def test_only_raced_out_candidates_that_beat_the_leaders_median_are_retimed() -> None:
    # B's median rises to 200: A (130) beats it by more than the margin, C (190) beats it too
    # (re-timed with A), D (300) does not: it stays out on one sample.
    script = {"A": [130.0], "C": [190.0], "D": [300.0], "B": [100.0, 200.0]}
    tuner, runner, pick = race_tuner(script)
    assert pick == "A"
    assert runner.seen == {"A": 3, "C": 3, "D": 1, "B": 5}
    assert tuner.stats.retimed == 2 and tuner.stats.raced_out == 1


@pytest.mark.parametrize(
    ("leader", "seen_b"),
    [([100.0], 3), ([100.0, 140.0], 3)],  # steady; risen past A (130) but within the margin
)
def test_no_retiming_while_the_race_holds(leader: list[float], seen_b: int) -> None:
    tuner, runner, pick = race_tuner({"A": [130.0], "B": leader})
    assert pick == "B"
    assert runner.seen == {"A": 1, "B": seen_b}
    assert tuner.stats.measurements == 4  # as before: 2 in the first round, 2 more of B
    assert tuner.stats.retimed == 0 and tuner.stats.raced_out == 1
    assert [c.samples for c in tuner.history[-1].candidates] == [1, 3]


def test_the_summary_table_marks_a_one_sample_fallback_time() -> None:
    # a-1 (1.2 per row, 4 rows) leaves the race with one sample: the table must say so, since
    # the winner's time is a median.
    tuner, runners, _ = make({-1: 1.2, 0: 1.1}, {0: 1.0, 1: 3.0}, rounds=3, remeasure_top=0)
    tuner.tuning_mode = True
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)
    tuner.choose_one("op", runners, config, [torch.randn(4, 2)])
    (row,) = tuner.summary_rows()  # numbers, for JSON
    assert row[4] == pytest.approx(4.8) and row[5] == pytest.approx(1.2)
    (shown,) = tuner.summary_table_rows()
    assert shown[4] == "4.800 (1 sample)" and shown[5] == pytest.approx(1.2)
    assert "(1 sample)" in tuner.summary_table()
    # Racing off: the fallback has its full samples and stays a number.
    tuner, runners, _ = make({-1: 1.2}, {0: 1.0}, rounds=3, remeasure_top=0, race_margin=0)
    tuner.tuning_mode = True
    tuner.choose_one("op", runners, config, [torch.randn(4, 2)])
    assert tuner.summary_rows()[0][4] == pytest.approx(4.8)


def test_raced_out_candidates_are_retimed_when_every_racing_one_fails() -> None:
    # B leads after the first round, then times -1 µs (an invalid time: failed). A was raced
    # out; rather than picking it on its one sample, it gets the full rounds (3).
    tuner, runner, pick = race_tuner({"A": [130.0, 140.0], "B": [100.0, -1.0]})
    assert pick == "A"
    assert runner.seen == {"A": 3, "B": 2}
    assert tuner.stats.retimed == 1 and tuner.stats.raced_out == 0
    assert tuner.stats.tactic_failures == {"invalid time": 1}
    assert [c.samples for c in tuner.history[-1].candidates] == [3, 1]
