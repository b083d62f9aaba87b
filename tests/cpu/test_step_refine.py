"""In-step refinement (graphtune.engine.step_refine): rivals, the race, and what is kept.

The step timer is a stand-in for the GPU: it reads the picks the tuner's cache holds for the
step's profiles and adds up a cost per pick, so a rival can be made faster in the step than the
pick, as measured on the H200 (benchmarks/step_truth.py). Everything else is the real code: the
tiny model's step tuned under Triton's interpreter, its recorded calls, the tuner's history, pins.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # see test_ops_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fake_timers import LastIsFastest, last_wins_tuner  # noqa: E402

from graphtune.autotuner import AutoTuner  # noqa: E402
from graphtune.autotuner.selection import CandidateRecord, ProfileRecord  # noqa: E402
from graphtune.autotuner.timing.base import Measurement  # noqa: E402
from graphtune.engine import DecodeStep, KVCache, load_model, tune_step  # noqa: E402
from graphtune.engine.step_refine import (  # noqa: E402
    nearest_rivals,
    profile_record,
    race_in_step,
    refine_in_step,
    whole_step_inputs,
)
from graphtune.errors import ConfigError  # noqa: E402


def _cand(index: int, tactic: object, us: float, failed: str | None = None) -> CandidateRecord:
    return CandidateRecord("R", index, tactic, us, 0.0, 3, failed, False)


def test_nearest_rivals_are_within_the_band_above_the_pick_fastest_first():
    record = ProfileRecord(
        "op",
        "8x8",
        (
            _cand(0, -1, 13.0),
            _cand(1, (1, 2), 10.0),  # the pick
            _cand(1, (2, 2), 12.4),
            _cand(1, (3, 2), 9.0),  # faster alone than the pick (a pin or tie): a rival too
            _cand(2, 7, 12.6),  # outside 25%
            _cand(2, 8, math.inf),
            _cand(2, 9, 10.1, failed="timeout"),
        ),
        1,
        0.0,
    )
    rivals = nearest_rivals(record, (1, (1, 2)), band=0.25, limit=3)
    assert [(c.runner_index, c.tactic) for c in rivals] == [(1, (3, 2)), (1, (2, 2))]
    assert nearest_rivals(record, (1, (1, 2)), band=0.25, limit=1)[0].tactic == (3, 2)
    assert nearest_rivals(record, (1, (1, 2)), band=0.0, limit=3)[0].tactic == (3, 2)
    # A pick that was never measured (pinned) is compared with the fastest candidate (9.0 us).
    assert [c.tactic for c in nearest_rivals(record, (0, 5), band=0.12, limit=5)] == [
        (3, 2),
        (1, 2),
    ]


def test_race_pins_before_each_measurement_and_takes_the_median():
    state = {"pin": None}
    seen: list[str] = []

    class _Timer:
        name = "plain"

        def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
            seen.append(state["pin"])
            us = {"a": 10.0, "b": 8.0}[state["pin"]] + len(seen) * 0.01
            return Measurement.from_samples([us], calls_per_sample=1, timer=self.name)

    pins = [lambda: state.update(pin="a"), lambda: state.update(pin="b")]
    times = race_in_step(_Timer(), lambda _: None, pins, rounds=3)
    assert seen == ["a", "b", "a", "b", "a", "b"]  # interleaved
    assert times == pytest.approx([10.03, 8.04])


def test_race_with_sessions_sets_each_pin_up_once_and_closes_every_session():
    state = {"pin": None}
    opened: list[str] = []
    closed: list[str] = []

    class _Session:
        def __init__(self, pin: str) -> None:
            self.pin = pin

        def measure(self) -> Measurement:
            us = {"a": 5.0, "b": 4.0}[self.pin]
            return Measurement.from_samples([us], calls_per_sample=1, timer="s")

        def close(self) -> None:
            closed.append(self.pin)

        def __enter__(self):
            return self

        def __exit__(self, *exc: object) -> None:
            self.close()

    class _SessionTimer:
        name = "session"

        def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
            raise AssertionError("a session timer is raced through sessions")

        def open(self, fn, *, warmup: int, repeat: int, hint_us=None) -> _Session:
            if state["pin"] == "broken":
                raise RuntimeError("capture failed")
            opened.append(state["pin"])
            return _Session(state["pin"])

    pins = [
        lambda: state.update(pin="a"),
        lambda: state.update(pin="broken"),
        lambda: state.update(pin="b"),
    ]
    times = race_in_step(_SessionTimer(), lambda _: None, pins, rounds=4)
    assert opened == ["a", "b"] and sorted(closed) == ["a", "b"]
    assert times[0] == 5.0 and math.isinf(times[1]) and times[2] == 4.0


class _PickCosts:
    """Step timer: the sum over the given profiles of what their cached picks cost in the step,
    which is their op-alone time unless ``in_step`` says otherwise for (key, runner, tactic)."""

    name = "step-cost"

    def __init__(self, tuner: AutoTuner, calls: list) -> None:
        self.tuner, self.in_step, self.measured = tuner, {}, 0
        self.keys = {}
        for call in calls:
            found = tuner.cached(call)
            if found is not None and found[0] not in self.keys:
                self.keys[found[0]] = profile_record(tuner, call)

    def cost(self, key, runner_index: int, tactic: object) -> float:
        record = self.keys[key]
        if (key, runner_index, repr(tactic)) in self.in_step:
            return self.in_step[(key, runner_index, repr(tactic))]
        if record is None:
            return 1.0
        own = [
            c.median_us
            for c in record.candidates
            if (c.runner_index, c.tactic) == (runner_index, tactic)
        ]
        return own[0] if own else 1.0

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        self.measured += 1
        total = 0.0
        for key in self.keys:
            entry = self.tuner.cache.get(key)
            total += self.cost(key, entry.runner_index, entry.tactic)
        return Measurement.from_samples([total], calls_per_sample=1, timer=self.name)


def _tuned_step(batch: int = 2) -> tuple[DecodeStep, AutoTuner]:
    model = load_model("tiny")
    tuner = last_wins_tuner()
    step = DecodeStep(model, KVCache(model.config, batch, 32), tuner=tuner)
    tune_step(step, check_fused=False)
    return step, tuner


def _calls(step: DecodeStep, tuner: AutoTuner, batch: int) -> list:
    with torch.no_grad(), tuner.record_calls(dry_run=True) as calls:
        step.decode(step.ops, *whole_step_inputs(step, batch))
    return calls


def test_a_rival_faster_in_the_step_replaces_the_pick_and_others_stay(tmp_path, unpruned):
    step, tuner = _tuned_step()
    calls = _calls(step, tuner, 1)
    timer = _PickCosts(tuner, calls)
    raced_keys = []
    for key, record in timer.keys.items():
        entry = tuner.cache.get(key)
        if record is not None and nearest_rivals(
            record, (entry.runner_index, entry.tactic), band=0.25, limit=3
        ):
            raced_keys.append((key, record, entry))
    assert len(raced_keys) >= 2, "the tiny step should offer profiles with near rivals"
    (win_key, win_record, win_entry), (near_key, near_record, near_entry) = raced_keys[:2]
    pick_of = {k: (e.runner_index, e.tactic) for k, _, e in raced_keys}
    # In the step, the second-nearest rival of the first profile is much faster than its pick;
    # the nearest rival of the second profile is faster too, but by less than the margin.
    winner = nearest_rivals(win_record, pick_of[win_key], band=0.25, limit=3)[-1]
    timer.in_step[(win_key, winner.runner_index, repr(winner.tactic))] = 0.0
    almost = nearest_rivals(near_record, pick_of[near_key], band=0.25, limit=3)[0]
    pick_cost = timer.cost(near_key, *pick_of[near_key])
    timer.in_step[(near_key, almost.runner_index, repr(almost.tactic))] = pick_cost - 1e-6
    lines: list[str] = []

    results = refine_in_step(step, timer, buckets=(1,), log=lines.append)

    assert tuner.tuning_mode is False and len(lines) == 1
    assert len(results) == len(raced_keys) and all(r.batch == 1 for r in results)
    won = tuner.cache.get(win_key)
    assert (won.runner_index, won.tactic) == (winner.runner_index, winner.tactic)
    assert [r.switched for r in results] == [True] + [False] * (len(results) - 1)
    assert results[0].kept_us < results[0].pick_us and str(winner.tactic) in results[0].kept
    for key, _, entry in raced_keys[1:]:
        assert tuner.cache.get(key) == entry  # restored, unchanged
    # The kept rival is a cache entry like any pick: saved and loaded back.
    path = tmp_path / "picks.json"
    tuner.cache.save(path)
    fresh = AutoTuner(show_progress=False)
    fresh.cache.load(path)
    loaded = fresh.cache.get(win_key)
    assert (loaded.runner_index, loaded.tactic) == (winner.runner_index, winner.tactic)


def _lazy_step_timer(tuner: AutoTuner, step: DecodeStep) -> _PickCosts:
    """A :class:`_PickCosts` that reads the step's profiles at its first measurement (they
    exist only once tuning has run)."""

    class _Lazy(_PickCosts):
        def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
            if not self.keys:
                self.__init__(tuner, _calls(step, tuner, 1))
            return super().measure(fn, warmup=warmup, repeat=repeat)

    return _Lazy(tuner, [])


def test_tune_step_refines_only_when_asked_and_reports_it():
    model = load_model("tiny")
    tuner = last_wins_tuner()
    step = DecodeStep(model, KVCache(model.config, 1, 32), tuner=tuner)
    timer = _lazy_step_timer(tuner, step)
    report = tune_step(step, step_timer=timer, check_fused=False)
    assert report.refinements == [] and timer.measured == 0  # not asked: nothing timed

    tuner = last_wins_tuner()
    step = DecodeStep(model, KVCache(model.config, 1, 32), tuner=tuner)
    timer = _lazy_step_timer(tuner, step)
    report = tune_step(step, step_timer=timer, check_fused=False, refine=True)
    assert report.refinements and timer.measured > 0
    # Every rival costs its op-alone time, which is above the pick's: nothing switches.
    assert not any(r.switched for r in report.refinements)
    assert f"in-step refinement: 0 of {len(report.refinements)} picks replaced" in report.summary()


def test_tune_step_says_when_it_cannot_refine(caplog):
    model = load_model("tiny")
    step = DecodeStep(model, KVCache(model.config, 1, 32), tuner=last_wins_tuner())
    with caplog.at_level("WARNING", logger="graphtune.engine.tuning"):
        report = tune_step(step, check_fused=False, refine=True)  # the CPU: no step timer
    assert report.refinements == []
    assert any("skipped the in-step refinement" in r.getMessage() for r in caplog.records)


def test_refinement_rejects_bad_settings_and_steps_it_cannot_race():
    step, _ = _tuned_step(batch=1)
    with pytest.raises(ConfigError, match="rivals >= 1"):
        refine_in_step(step, LastIsFastest(), rivals=0)
    for bad in (dict(rivals=1.5), dict(rounds=2.0), dict(band=float("nan")), dict(margin=-1.0)):
        with pytest.raises(ConfigError, match="refine_in_step"):  # a slice's TypeError before
            refine_in_step(step, LastIsFastest(), **bad)
    # An int beyond a float's range raised OverflowError in math.isfinite.
    with pytest.raises(ConfigError, match="refine_in_step") as caught:
        refine_in_step(step, LastIsFastest(), band=10**400)
    assert len(str(caught.value)) < 300
    with pytest.raises(ConfigError, match="outside 1..1"):
        refine_in_step(step, LastIsFastest(), buckets=(2,))
    model = load_model("tiny")
    untuned = DecodeStep(model, KVCache(model.config, 1, 32))
    with pytest.raises(ConfigError, match="built with a tuner"):
        refine_in_step(untuned, LastIsFastest())


def test_whole_step_inputs_put_rows_in_their_own_slots_at_the_last_position():
    step, _ = _tuned_step(batch=2)
    tokens, positions, slots = whole_step_inputs(step, 2)
    assert slots.tolist() == [0, 1] and positions.tolist() == [31, 31]
    assert tokens.tolist() == [0, 0]
