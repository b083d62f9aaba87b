"""What a TensorRT-LLM or triton.autotune user expects of the tuner (issue 14), one test each.

Fake runners advance a virtual clock by their tactic's cost and a fake timer reads it, so every
pick below is deterministic (docs/design.md, principle 2).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch

from graphtune.autotuner import (
    AutoTuner,
    DynamicTensorSpec,
    IdentityError,
    TunableRunner,
    TuningConfig,
    TuningPolicy,
    autotune,
    runner_id,
)
from graphtune.autotuner.timing.base import Measurement
from graphtune.errors import ConfigError, TuningError

ONE = TuningPolicy(rounds=1, remeasure_top=0, max_extra_rounds=0)


class Clock:
    def __init__(self) -> None:
        self.now_us = 0.0
        self.calls: list[tuple[str, Any]] = []


class ClockTimer:
    """Per-call time = clock advance of one call; counts its measurements."""

    name = "fake"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.measurements = 0

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        self.measurements += 1
        start = self.clock.now_us
        fn(0)
        value = self.clock.now_us - start
        return Measurement.from_samples([value], calls_per_sample=1, timer=self.name)


class TrtStyleRunner(TunableRunner):
    """Written as TensorRT-LLM writes runners: keyword-only ``tactic`` and ``**kwargs``."""

    def __init__(self, block_size: int, clock: Clock) -> None:
        self.block_size = block_size
        self._clock = clock  # private: not part of the identity

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, 0, 1]

    def forward(self, inputs: list, *, tactic: int = -1, **kwargs: Any) -> Any:
        # The fast tactic depends on the configuration: 0 for small blocks, 1 for big ones.
        fast = 0 if self.block_size < 200 else 1
        self._clock.now_us += 1.0 if tactic == fast else 5.0
        self._clock.calls.append((f"b{self.block_size}", tactic))
        return inputs[0]


def tuner_for(clock: Clock, **kwargs: Any) -> AutoTuner:
    return AutoTuner(ClockTimer(clock), policy=ONE, show_progress=False, **kwargs)


CONFIG = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)
X = [torch.zeros(4, 2)]


# 1 -------------------------------------------------------------------------------------------


def test_runner_configuration_is_part_of_the_cache_key(tmp_path) -> None:
    clock = Clock()
    small, big = TrtStyleRunner(128, clock), TrtStyleRunner(256, clock)
    assert runner_id(small) != runner_id(big)
    assert runner_id(small).endswith('TrtStyleRunner[{"block_size":128}]')
    path = tmp_path / "cache.json"
    tuner = tuner_for(clock)
    with autotune(path, tuner):
        assert tuner.choose_one("op", [small], CONFIG, X) == (small, 0)
        assert tuner.choose_one("op", [big], CONFIG, X) == (big, 1)  # not small's pick
    fresh = tuner_for(Clock())
    with autotune(path, fresh, tune=False):
        assert fresh.choose_one("op", [TrtStyleRunner(256, clock)], CONFIG, X)[1] == 1
        assert fresh.choose_one("op", [TrtStyleRunner(128, clock)], CONFIG, X)[1] == 0
    assert fresh.stats.hits == 2 and fresh.stats.misses == 0


class HoldsAnObject(TunableRunner):
    def __init__(self) -> None:
        self.weights = object()


class ExplicitKey(HoldsAnObject):
    def cache_key_extras(self) -> tuple:
        return ("v2",)


class Excluding(HoldsAnObject):
    identity_excludes = frozenset({"weights"})


def test_an_attribute_without_a_stable_value_names_itself() -> None:
    with pytest.raises(IdentityError, match="attribute 'weights' of HoldsAnObject is a object"):
        runner_id(HoldsAnObject())
    assert runner_id(ExplicitKey()).endswith('ExplicitKey["v2"]')
    assert runner_id(Excluding()).endswith(".Excluding")
    tuner = AutoTuner(show_progress=False)
    with pytest.raises(ConfigError, match="weights"):  # a choose_one error, not a silent key
        tuner.choose_one("op", [HoldsAnObject()], CONFIG, X)


# 2 -------------------------------------------------------------------------------------------


class TupleRunner(TunableRunner):
    def __init__(self, clock: Clock) -> None:
        self._clock = clock

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [(64, 2), (128, 4.5), {"tile": (16, 16), 3: "int key"}]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        self._clock.now_us += 1.0 if tactic == (128, 4.5) else 3.0
        return inputs[0]


def test_tuple_tactics_come_back_as_tuples_after_a_reload(tmp_path) -> None:
    path = tmp_path / "cache.json"
    clock = Clock()
    tuner = tuner_for(clock)
    with autotune(path, tuner):
        _, tactic = tuner.choose_one("op", [TupleRunner(clock)], CONFIG, X)
    assert tactic == (128, 4.5)
    restarted = tuner_for(Clock())
    with autotune(path, restarted, tune=False):
        _, again = restarted.choose_one("op", [TupleRunner(clock)], CONFIG, X)
    assert type(again) is tuple and again == (128, 4.5) and type(again[1]) is float
    assert {again: "usable as a dict key"}[(128, 4.5)]
    assert '{"__tuple__": [128, 4.5]}' in json.dumps(json.loads(path.read_text()))


# 3 -------------------------------------------------------------------------------------------


class ScaleRunner(TunableRunner):
    """Tactic 0 is twice as fast as the fallback at any size."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, 0]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        self._clock.now_us += 2.0 if tactic == -1 else 1.0
        self._clock.calls.append((str(inputs[0].shape[0]), tactic))
        return inputs[0]


def test_a_bucket_mapper_returning_zero_is_a_miss_that_runs_the_fallback() -> None:
    spec = DynamicTensorSpec(0, 0, (1, 2, 4, 8), map_to_bucket=lambda x: int(x * 0.25))
    config = TuningConfig(dynamic_specs=(spec,), warmup=0, repeat=1)
    clock = Clock()
    runner = ScaleRunner(clock)
    tuner = tuner_for(clock)
    with autotune(None, tuner):
        assert tuner.choose_one("op", [runner], config, [torch.zeros(3, 2)]) == (runner, -1)
        assert tuner.stats.fallbacks == {"op": 1} and tuner.stats.misses == 1
        # the other sizes were tuned all the same (buckets 1, 2, 4, 8)
        assert len(tuner.cache) == 4
        assert tuner.choose_one("op", [runner], config, [torch.zeros(8, 2)]) == (runner, 0)
    # at serving time: still a fallback, never a ConfigError
    assert tuner.choose_one("op", [runner], config, [torch.zeros(2, 2)]) == (runner, -1)
    assert tuner.stats.fallbacks == {"op": 2} and len(tuner.misses) == 0  # nothing to tune


def test_a_bucket_too_large_for_the_device_is_not_tuned_and_runs_the_fallback(caplog) -> None:
    # A mapper rounding far up: its bucket's inputs (10**13 rows) cannot exist on any device.
    far = DynamicTensorSpec(0, 0, (1, 2, 4), map_to_bucket=lambda x: 10**13 if x == 3 else x)
    config = TuningConfig(dynamic_specs=(far,), warmup=0, repeat=1)
    clock = Clock()
    runner = ScaleRunner(clock)
    tuner = tuner_for(clock)
    caplog.set_level(logging.WARNING)
    with autotune(None, tuner):
        for _ in range(2):
            assert tuner.choose_one("op", [runner], config, [torch.zeros(3, 2)]) == (runner, -1)
        assert tuner.choose_one("op", [runner], config, [torch.zeros(4, 2)]) == (runner, 0)
    assert len(tuner.cache) == 3  # buckets 1, 2, 4 tuned all the same; nothing for 10**13
    assert tuner.stats.profiles_failed == 1  # the second call did not try again
    oversized = [r.getMessage() for r in caplog.records if "more than the" in r.getMessage()]
    assert len(oversized) == 1 and "max_value" in oversized[0]


# 4 -------------------------------------------------------------------------------------------


class PerSizeRunner(TunableRunner):
    """Tactic ``n`` is fastest on ``n`` rows, so each bucket has its own pick."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [3, 5, 6]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        self._clock.now_us += 1.0 if tactic == inputs[0].shape[0] else 4.0
        return inputs[0]


def test_listed_buckets_without_a_mapper_map_to_the_listed_buckets() -> None:
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (3, 5, 6)),), warmup=0, repeat=1)
    clock = Clock()
    runner = PerSizeRunner(clock)
    tuner = tuner_for(clock)
    with autotune(None, tuner):
        tuner.choose_one("op", [runner], config, [torch.zeros(5, 2)])
    assert sorted(key.shapes[0][0] for key, _ in tuner.cache.items()) == [3, 5, 6]
    expected = {3: 3, 5: 5, 6: 6, 4: 3, 2: 3, 1: 3, 100: 6}  # live size -> bucket's pick
    for live, tactic in expected.items():
        assert tuner.choose_one("op", [runner], config, [torch.zeros(live, 2)])[1] == tactic
    assert tuner.stats.fallbacks == {}


# 5 -------------------------------------------------------------------------------------------


class MaybeBroken(TunableRunner):
    def __init__(self, clock: Clock, broken: bool) -> None:
        self.broken = broken
        self._clock = clock

    identity_excludes = frozenset({"broken"})  # the fixed runner is the same runner

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, 0]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        if self.broken:
            raise RuntimeError("driver too old")
        self._clock.now_us += 1.0 if tactic == 0 else 2.0
        return inputs[0]


def test_a_profile_where_every_candidate_failed_is_neither_cached_nor_saved(
    tmp_path, caplog
) -> None:
    spec = DynamicTensorSpec(0, 0, (1, 4), map_to_bucket=lambda n: n)  # each size its own bucket
    config = TuningConfig(dynamic_specs=(spec,), warmup=0, repeat=1)
    path = tmp_path / "cache.json"
    clock = Clock()
    broken = MaybeBroken(clock, broken=True)
    tuner = tuner_for(clock)
    with caplog.at_level(logging.WARNING), autotune(path, tuner):
        assert tuner.choose_one("op", [broken], config, [torch.zeros(4, 2)]) == (broken, -1)
        tuner.choose_one("op", [broken], config, [torch.zeros(4, 2)])  # not re-tuned
        # A size of a new bucket tunes that bucket alone, not the failed ones again.
        tuner.choose_one("op", [broken], config, [torch.zeros(6, 2)])
    assert len(tuner.cache) == 0 and tuner.stats.profiles_failed == 3
    assert tuner.stats.tactic_failures == {"RuntimeError": 6}
    said = [r for r in caplog.records if "every (runner, tactic) failed" in r.getMessage()]
    assert len(said) == 1
    assert not path.exists()  # nothing to save, so no empty cache file either
    # A later run with the runner fixed tunes it.
    fixed = MaybeBroken(clock, broken=False)
    again = tuner_for(clock)
    with autotune(path, again):
        assert again.choose_one("op", [fixed], config, [torch.zeros(4, 2)]) == (fixed, 0)
    assert len(json.loads(path.read_text())["entries"]) == 2


# 6 -------------------------------------------------------------------------------------------


class MoeRunner(TunableRunner):
    """TensorRT-LLM's multi-context case: ``gemm_idx`` picks which GEMM, and its tactics."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._seen: list[tuple[str, Any]] = []  # private: state, not configuration

    def get_valid_tactics(self, inputs: list, profile: Any, *, gemm_idx: int, **kw: Any) -> list:
        self._seen.append(("tactics", gemm_idx))
        return [10 * gemm_idx, 10 * gemm_idx + 1]

    def forward(self, inputs: list, *, tactic: int = -1, gemm_idx: int = 0, **kw: Any) -> Any:
        self._seen.append(("forward", gemm_idx))
        fast = 10 * gemm_idx + gemm_idx % 2  # 11 for the first GEMM, 20 for the second
        self._clock.now_us += 1.0 if tactic == fast else 3.0
        return inputs[0]


def test_keyword_arguments_reach_the_runner_and_the_key() -> None:
    clock = Clock()
    runner = MoeRunner(clock)
    tuner = tuner_for(clock)
    with autotune(None, tuner):
        assert tuner.choose_one("moe", [runner], CONFIG, X, gemm_idx=1)[1] == 11
        assert tuner.choose_one("moe", [runner], CONFIG, X, gemm_idx=2)[1] == 20
    assert ("tactics", 1) in runner._seen and ("forward", 2) in runner._seen
    assert sorted(key.kwargs for key, _ in tuner.cache.items()) == [
        '{"gemm_idx":1}',
        '{"gemm_idx":2}',
    ]
    assert tuner.choose_one("moe", [runner], CONFIG, X, gemm_idx=1)[1] == 11  # a hit


class PositionalOnly(TunableRunner):
    """A runner whose forward takes no ``tactic`` keyword."""

    def get_valid_tactics(self, inputs: list, profile: Any) -> list:
        return [0, 1, 2]

    def forward(self, inputs, tactic_index):  # type: ignore[override]
        return inputs[0]


def test_the_same_type_error_from_every_candidate_is_a_signature_error() -> None:
    tuner = AutoTuner(policy=ONE, show_progress=False)
    with pytest.raises(ConfigError, match=r"forward\(self, inputs, \*, tactic=-1, \*\*kwargs\)"):
        with autotune(None, tuner):
            tuner.choose_one("op", [PositionalOnly()], CONFIG, X)
    assert len(tuner.cache) == 0

    class NoKwargs(TunableRunner):  # a ported runner whose pruning takes no keyword arguments
        def get_valid_tactics(self, inputs: list, profile: Any) -> list:
            return [-1, 0]

    with pytest.raises(ConfigError, match=r"get_valid_tactics\(self, inputs, profile, \*\*kw"):
        with autotune(None, tuner):
            tuner.choose_one("op", [NoKwargs()], CONFIG, X, gemm_idx=1)


def test_get_valid_tactics_may_read_the_opt_shapes_as_in_tensorrt_llm() -> None:
    clock, seen = Clock(), []

    class OptShapes(TrtStyleRunner):
        def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
            seen.append(profile.get_opt_shapes())
            return [0, 1] if profile.get_opt_shapes()[0][0] >= 8 else [0]

    tuner, runner = tuner_for(clock), OptShapes(100, clock)  # tactic 0 is the fast one
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4, 8)),), warmup=0, repeat=1)
    with autotune(None, tuner):
        assert tuner.choose_one("op", [runner], config, [torch.zeros(8, 3), 2]) == (runner, 0)
    assert sorted(seen) == [((4, 3), (0,)), ((8, 3), (0,))] and len(tuner.cache) == 2


# 7 -------------------------------------------------------------------------------------------


class Listed(TunableRunner):
    def __init__(self, clock: Clock, tactics: list, costs: dict) -> None:
        self.tactics = tactics
        self._clock, self._costs = clock, costs

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return list(self.tactics)

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        self._clock.now_us += self._costs[tactic]
        self._clock.calls.append(("listed", tactic))
        return inputs[0]


def test_the_fallback_is_timed_only_when_listed_and_a_lone_candidate_is_not_timed() -> None:
    clock = Clock()
    tuner = tuner_for(clock)
    tuner.tuning_mode = True
    # A tie between the (unlisted) fallback and tactic 0 cannot go to the fallback.
    runner = Listed(clock, [0, 1], {-1: 1.0, 0: 1.0, 1: 2.0})
    assert tuner.choose_one("op", [runner], CONFIG, X) == (runner, 0)
    assert ("listed", -1) not in clock.calls
    entry = next(e for _, e in tuner.cache.items())
    assert entry.fallback_us is None and entry.speedup is None
    # One candidate: returned without timing, as TensorRT-LLM and triton.autotune do.
    lone = Listed(clock, [7], {7: 1.0})
    before = tuner.timer.measurements  # type: ignore[union-attr]
    assert tuner.choose_one("lone", [lone], CONFIG, X) == (lone, 7)
    assert tuner.timer.measurements == before  # type: ignore[union-attr]
    assert tuner.stats.untimed_picks == 1
    key = next(k for k, _ in tuner.cache.items() if k.op == "lone")
    assert tuner.cache.get(key).time_us is None  # type: ignore[union-attr]
    assert tuner.history[-1].candidates[0].samples == 0


# features --------------------------------------------------------------------------------------


def test_cache_only_switch_looks_up_and_records_misses(tmp_path, monkeypatch) -> None:
    clock = Clock()
    runner = ScaleRunner(clock)
    tuner = tuner_for(clock)
    misses = tmp_path / "misses.json"
    with autotune(None, tuner, tune=False, misses_path=misses) as active:
        assert not active.tuning_mode
        assert tuner.choose_one("op", [runner], CONFIG, X) == (runner, -1)
    assert clock.calls == [] and len(tuner.cache) == 0
    assert json.loads(misses.read_text())["misses"][0]["op"] == "op"
    monkeypatch.setenv("GRAPHTUNE_CACHE_ONLY", "1")
    with autotune(None, tuner):
        assert not tuner.tuning_mode
        tuner.choose_one("op", [runner], CONFIG, X)
    assert clock.calls == []
    with autotune(None, tuner, tune=True):  # the argument wins over the environment
        assert tuner.choose_one("op", [runner], CONFIG, X) == (runner, 0)


def test_reset_stats_zeroes_the_counters_and_rearms_the_warnings(caplog) -> None:
    clock = Clock()
    runner = ScaleRunner(clock)
    tuner = tuner_for(clock)
    with caplog.at_level(logging.WARNING):
        tuner.choose_one("op", [runner], CONFIG, X)
        tuner.reset_stats()
        assert tuner.stats.fallbacks == {} and tuner.stats.misses == 0
        tuner.choose_one("op", [runner], CONFIG, X)
    assert tuner.stats.fallbacks == {"op": 1}
    assert sum("no tuned pick" in r.getMessage() for r in caplog.records) == 2


class Required(TunableRunner):
    requires_tactic = True

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return []  # pruned everything away


def test_pruning_every_tactic_of_a_runner_that_requires_one_is_an_error() -> None:
    tuner = AutoTuner(policy=ONE, show_progress=False)
    with pytest.raises(TuningError, match="Required.get_valid_tactics returned no tactic"):
        with autotune(None, tuner):
            tuner.choose_one("op", [ScaleRunner(Clock()), Required()], CONFIG, X)


def test_record_calls_lists_every_choose_one_of_the_block() -> None:
    clock = Clock()
    runner = ScaleRunner(clock)
    tuner = tuner_for(clock)
    with tuner.record_calls() as calls:
        tuner.choose_one("a", [runner], CONFIG, X)
        tuner.choose_one("b", [runner], CONFIG, [torch.zeros(2, 2)], flag=True)
    tuner.choose_one("c", [runner], CONFIG, X)
    assert [(c.op, c.inputs[0].shape[0], c.kwargs) for c in calls] == [
        ("a", 4, {}),
        ("b", 2, {"flag": True}),
    ]


def test_a_dry_run_records_without_tuning_counting_or_recording_misses() -> None:
    clock = Clock()
    runner = ScaleRunner(clock)
    tuner = tuner_for(clock)
    with autotune(None, tuner), tuner.record_calls(dry_run=True) as calls:
        assert tuner.choose_one("op", [runner], CONFIG, X) == (runner, -1)  # a miss: fallback
    assert [c.op for c in calls] == ["op"] and clock.calls == [] and len(tuner.cache) == 0
    assert tuner.stats.misses == 0 and tuner.stats.fallbacks == {} and len(tuner.misses) == 0
    with autotune(None, tuner):
        pick = tuner.choose_one("op", [runner], CONFIG, X)  # tunes now
    hits = tuner.stats.hits
    with tuner.record_calls(dry_run=True) as again:
        assert tuner.choose_one("op", [runner], CONFIG, X) == pick  # a hit returns the pick
    assert len(again) == 1 and tuner.stats.hits == hits


def test_tune_call_tunes_exactly_the_bucket_of_the_call() -> None:
    from graphtune.autotuner import OpCall

    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 2, 4, 8)),), warmup=0)
    clock = Clock()
    runner = ScaleRunner(clock)
    tuner = tuner_for(clock)
    call = OpCall("op", (runner,), config, (torch.zeros(5, 2),))
    assert tuner.tune_call(call) == (runner, 0)
    assert [key.shapes[0][0] for key, _ in tuner.cache.items()] == [4]
    assert {rows for rows, _ in clock.calls} == {"4"}
