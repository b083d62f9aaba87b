"""AutoTuner.choose_one driven by a fake clock and timer (principle 2), plus one real-timer test."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch

from graphtune.autotuner import (
    FALLBACK_TACTIC,
    AutoTuner,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
    TuningPolicy,
    autotune,
)
from graphtune.autotuner.calls import OpCall
from graphtune.autotuner.timing.base import Measurement
from graphtune.autotuner.timing.graph import GraphTimer
from graphtune.errors import ConfigError


class FakeClock:
    """Virtual time that fake runners advance by their cost; also logs who ran."""

    def __init__(self) -> None:
        self.now_us = 0.0
        self.log: list[tuple[str, Any]] = []


class FakeRunner(TunableRunner):
    def __init__(self, name: str, costs: dict, clock: FakeClock, fail: set = frozenset()) -> None:
        self.name, self.costs, self.clock, self.fail = name, costs, clock, set(fail)
        self.seen_inputs: set[int] = set()

    def get_valid_tactics(self, inputs: list, profile: Any) -> list:
        return list(self.costs)  # the fallback -1 too, where a runner lists it: then it is timed

    def forward(self, inputs: list, tactic: Any = FALLBACK_TACTIC) -> Any:
        if tactic in self.fail:
            raise RuntimeError(f"{self.name} tactic {tactic} does not support this shape")
        self.seen_inputs.add(inputs[0].data_ptr())
        rows = inputs[0].shape[0]
        self.clock.now_us += self.costs[tactic] * rows
        self.clock.log.append((self.name, tactic))
        return inputs[0]

    def cache_key_extras(self) -> tuple:
        return (self.name,)


class FakeTimer:
    """Reads the fake clock around ``repeat`` calls; optional multiplicative Gaussian noise."""

    name = "fake"

    def __init__(self, clock: FakeClock, noise: float = 0.0, seed: int = 0) -> None:
        self.clock, self.noise, self.rng = clock, noise, random.Random(seed)
        self.order: list[tuple[str, Any]] = []

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        for i in range(max(1, warmup)):
            fn(i)
        samples = []
        for s in range(3):
            start = self.clock.now_us
            for i in range(repeat):
                fn(warmup + s * repeat + i)
            per_call = (self.clock.now_us - start) / repeat
            samples.append(per_call * (1.0 + self.rng.gauss(0.0, self.noise)))
        self.order.append(self.clock.log[-1])
        return Measurement.from_samples(samples, calls_per_sample=repeat, timer=self.name)


CONFIG = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 4, 16)),), warmup=1, repeat=2)


def make(costs_a: dict, costs_b: dict, **tuner_kwargs: Any):
    clock = FakeClock()
    timer = FakeTimer(clock, noise=tuner_kwargs.pop("noise", 0.0), seed=tuner_kwargs.pop("seed", 0))
    runners = [FakeRunner("a", costs_a, clock), FakeRunner("b", costs_b, clock)]
    tuner_kwargs.setdefault("show_progress", False)
    knobs = {k: tuner_kwargs.pop(k) for k in list(tuner_kwargs) if hasattr(TuningPolicy(), k)}
    tuner = AutoTuner(timer=timer, policy=TuningPolicy(**knobs), **tuner_kwargs)
    return tuner, runners, timer


def test_tunes_all_buckets_then_hits() -> None:
    tuner, runners, timer = make({-1: 5.0, 0: 4.0}, {0: 1.0, 1: 3.0})
    tuner.tuning_mode = True
    x = torch.randn(3, 8)
    runner, tactic = tuner.choose_one("op", runners, CONFIG, [x])
    assert (runner, tactic) == (runners[1], 0)
    # the listed buckets 1, 4, 16 (the live 3 maps to the listed 1) -> three profiles, four
    # candidates each
    assert tuner.stats.profiles_tuned == 3 and len(tuner.cache) == 3
    assert tuner.stats.tactics_timed == 12 and tuner.stats.misses == 1
    entry = next(e for _, e in tuner.cache.items())
    assert entry.runner_id.endswith('FakeRunner["b"]') and entry.speedup == pytest.approx(5.0)
    tuner.tuning_mode = False
    calls = len(timer.order)
    for rows in (1, 2, 3, 5, 16, 100):  # each maps to the largest listed bucket not above it
        tuner.choose_one("op", runners, CONFIG, [torch.randn(rows, 8)])
    assert len(timer.order) == calls
    assert tuner.stats.hits == 6 and tuner.stats.fallbacks == {}
    table = tuner.summary_table()
    assert "FakeRunner" in table and "speed-up" in table and "16x8" in table


def test_miss_outside_tuning_mode_falls_back_and_warns_once(caplog) -> None:
    tuner, runners, timer = make({-1: 5.0}, {0: 1.0})
    with caplog.at_level(logging.WARNING, logger="graphtune.autotuner.tuner"):
        for _ in range(3):
            assert tuner.choose_one("op", runners, CONFIG, [torch.randn(4, 2)]) == (runners[0], -1)
        tuner.choose_one("other", runners, CONFIG, [torch.randn(4, 2)])
    assert timer.order == []
    assert tuner.stats.fallbacks == {"op": 3, "other": 1} and tuner.stats.misses == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "autotune()" in warnings[0].getMessage()


def test_never_profiles_while_capturing() -> None:
    capturing = [True]
    clock = FakeClock()
    timer = FakeTimer(clock)
    runners = [FakeRunner("a", {-1: 2.0}, clock), FakeRunner("b", {0: 1.0}, clock)]
    tuner = AutoTuner(timer=timer, is_capturing=lambda: capturing[0], show_progress=False)
    with autotune(tuner=tuner):
        assert tuner.choose_one("op", runners, CONFIG, [torch.randn(4, 2)]) == (runners[0], -1)
        assert timer.order == [] and clock.log == [] and len(tuner.cache) == 0
        capturing[0] = False
        assert tuner.choose_one("op", runners, CONFIG, [torch.randn(4, 2)]) == (runners[1], 0)
        capturing[0] = True  # look-ups still work during capture
        assert tuner.choose_one("op", runners, CONFIG, [torch.randn(4, 2)]) == (runners[1], 0)
    assert tuner.stats.hits == 1 and tuner.stats.fallbacks == {"op": 1}


def test_candidates_are_measured_interleaved() -> None:
    tuner, runners, timer = make(
        {-1: 5.0, 0: 4.0}, {0: 1.0, 1: 3.0}, rounds=3, remeasure_top=2, race_margin=0
    )
    tuner.tuning_mode = True
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)
    tuner.choose_one("op", runners, config, [torch.randn(4, 2)])
    everyone = [("a", -1), ("a", 0), ("b", 0), ("b", 1)]
    assert timer.order[:12] == everyone * 3  # round-robin, not one candidate after another
    assert timer.order[12:] == [("b", 0), ("b", 1)] * 3  # the top two, re-measured interleaved


def test_failing_tactics_are_data(caplog) -> None:
    clock = FakeClock()
    a = FakeRunner("a", {-1: 5.0, 0: 1.0, 1: 2.0}, clock, fail={0})
    b = FakeRunner("b", {0: 0.5}, clock, fail={0})
    tuner = AutoTuner(timer=FakeTimer(clock), show_progress=False)
    with caplog.at_level(logging.WARNING), autotune(tuner=tuner):
        runner, tactic = tuner.choose_one("op", [a, b], CONFIG, [torch.randn(4, 2)])
    assert (runner, tactic) == (a, 1)
    # two failing candidates in each of three profiles (1, 4, 16)
    assert tuner.stats.tactic_failures == {"RuntimeError": 6}
    failures = [r for r in caplog.records if "RuntimeError" in r.getMessage()]
    assert len(failures) == 1  # logged once per (op, reason); the rest are counted


@pytest.mark.parametrize(
    "costs_b, expected",
    [
        ({0: 0.999, 1: 3.0}, ("a", -1)),  # 0.1% faster than the fallback: under the 0.5% floor
        ({0: 0.98, 1: 3.0}, ("b", 0)),  # 2% faster, noise 0.2%: a real win (the old rule tied it)
        ({0: 0.95, 1: 3.0}, ("b", 0)),  # 5% faster: a real win
    ],
)
def test_picks_are_deterministic_under_noise(costs_b: dict, expected: tuple) -> None:
    picks = set()
    for seed in range(40):
        tuner, runners, _ = make({-1: 1.0, 0: 1.01}, costs_b, noise=0.002, seed=seed)
        tuner.tuning_mode = True
        config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)
        runner, tactic = tuner.choose_one("op", runners, config, [torch.randn(4, 2)])
        picks.add((runner.name, tactic))
    assert picks == {expected}


def test_cold_l2_rotates_copies_larger_than_l2(monkeypatch) -> None:
    from graphtune.autotuner.timing import cold_l2

    l2 = 1 << 20  # a fake 1 MiB L2, read through the real cold_l2_copies
    monkeypatch.setattr(cold_l2, "l2_cache_bytes", lambda device: l2)
    clock = FakeClock()
    runner = FakeRunner("a", {-1: 1.0, 0: 2.0}, clock)
    timer = FakeTimer(clock)
    tuner = AutoTuner(
        timer=timer, show_progress=False, policy=TuningPolicy(rounds=1, remeasure_top=0)
    )
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (64,)),), cold_l2=True, repeat=2)
    x = torch.randn(64, 1024)  # 256 KiB per input set
    with autotune(tuner=tuner):
        tuner.choose_one("op", [runner], config, [x])
    assert len(timer.order) == 2  # a single measurement of each of the two tactics...
    assert len(runner.seen_inputs) * x.numel() * 4 > l2  # ...walked copies totalling more than L2


class SizingTimer(GraphTimer):
    """A graph timer as the tuner sees it (it sizes its samples), timing on the fake clock;
    records the ``repeat`` of every session it opens."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.fake = FakeTimer(clock)
        self.repeats: list[int] = []

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        self.repeats.append(repeat)
        return self.fake.measure(fn, warmup=warmup, repeat=repeat)

    def open(self, fn, *, warmup: int, repeat: int, hint_us: float | None = None) -> Any:
        timer = self

        class Session:
            def measure(self) -> Measurement:
                return timer.measure(fn, warmup=warmup, repeat=repeat)

            def close(self) -> None:
                pass

        return Session()


class RecordingTimer(FakeTimer):
    """A timer that does not size its samples; records every ``repeat`` asked for."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.repeats: list[int] = []

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        self.repeats.append(repeat)
        return super().measure(fn, warmup=warmup, repeat=repeat)


@pytest.mark.parametrize(
    ("timer_kind", "cold", "repeat", "expected"),
    [
        ("sizing", True, None, 2),  # the copies: the graph timer adds its own min_calls
        ("sizing", False, None, 1),
        ("fixed", True, None, 10),
        ("fixed", False, None, 10),
        ("sizing", False, 7, 7),  # a number the config gives is kept
        ("sizing", True, 1, 2),  # ...and raised to the copies
        ("fixed", True, 1, 2),
    ],
)
def test_sample_calls_follow_the_timer_and_the_copies(
    monkeypatch, timer_kind, cold, repeat, expected
) -> None:
    from graphtune.autotuner.timing import cold_l2

    # 2 copies of a 256 KiB set overflow this 128 KiB L2 twice: the copies alone are 2 calls.
    # With repeat=None a sizing timer gets the copies (or 1) and the others 10.
    monkeypatch.setattr(cold_l2, "l2_cache_bytes", lambda device: 128 << 10)
    clock = FakeClock()
    runner = FakeRunner("a", {-1: 1.0, 0: 2.0}, clock)
    timer = SizingTimer(clock) if timer_kind == "sizing" else RecordingTimer(clock)
    tuner = AutoTuner(timer=timer, show_progress=False, policy=TuningPolicy(rounds=1))
    spec = DynamicTensorSpec(0, 0, (64,))
    config = TuningConfig(dynamic_specs=(spec,), cold_l2=cold, repeat=repeat)
    with autotune(tuner=tuner):
        tuner.choose_one("op", [runner], config, [torch.randn(64, 1024)])
    assert timer.repeats and set(timer.repeats) == {expected}


def test_autotune_context_loads_and_saves(tmp_path) -> None:
    path = tmp_path / "cache.json"
    tuner, runners, timer = make({-1: 5.0}, {0: 1.0})
    with autotune(cache_path=path, tuner=tuner) as active:
        assert active is tuner and tuner.tuning_mode
        tuner.choose_one("op", runners, CONFIG, [torch.randn(4, 2)])
    assert not tuner.tuning_mode and path.exists()
    fresh, runners2, timer2 = make({-1: 5.0}, {0: 1.0})
    with autotune(cache_path=path, tuner=fresh):
        runner, tactic = fresh.choose_one("op", runners2, CONFIG, [torch.randn(4, 2)])
    assert (runner, tactic) == (runners2[1], 0) and timer2.order == [] and fresh.stats.hits == 1


def test_autotune_uses_env_default_path(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GRAPHTUNE_CACHE", str(tmp_path / "env.json"))
    tuner, runners, _ = make({-1: 5.0}, {0: 1.0})
    with autotune(tuner=tuner):
        tuner.choose_one("op", runners, CONFIG, [torch.randn(4, 2)])
    assert (tmp_path / "env.json").exists()


def test_choose_one_and_tuner_argument_errors() -> None:
    tuner = AutoTuner(show_progress=False)
    with pytest.raises(ConfigError, match="no runners"):
        tuner.choose_one("op", [], CONFIG, [torch.randn(2)])
    with pytest.raises(ConfigError, match="TuningConfig"):
        tuner.choose_one("op", [TunableRunner()], {"timing": "auto"}, [torch.randn(2)])
    with pytest.raises(ConfigError, match="rounds"):
        AutoTuner(policy=TuningPolicy(rounds=0))
    with pytest.raises(ConfigError, match="tie_tolerance"):
        AutoTuner(policy=TuningPolicy(tie_tolerance=1.5))
    with pytest.raises(ConfigError, match="measure"):
        AutoTuner(timer=object())  # type: ignore[arg-type]


class MatmulRunner(TunableRunner):
    """Fast: one matmul."""

    def forward(self, inputs, tactic=-1):
        return inputs[0] @ inputs[1]


class SlowMatmulRunner(TunableRunner):
    """Genuinely slower: the same matmul recomputed 8 or 16 times (tactic -1: 8)."""

    def get_valid_tactics(self, inputs, profile):
        return [-1, 16]

    def forward(self, inputs, tactic=-1):
        a, b = inputs
        for _ in range(8 if tactic == -1 else tactic):
            out = a @ b
        return out


@pytest.fixture
def one_thread():
    # Other processes may share this machine's cores; multi-threaded matmuls then stall on
    # thread barriers at random, which would make the "faster" runner slow by accident.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_wallclock_timer_picks_the_genuinely_faster_runner(one_thread) -> None:
    # timing="auto" on CPU tensors resolves the real WallClockTimer through resolve_timer.
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (64,)),), warmup=2, repeat=5)
    tuner = AutoTuner(show_progress=False, policy=TuningPolicy(rounds=2))
    runners = [SlowMatmulRunner(), MatmulRunner()]
    inputs = [torch.randn(64, 64), torch.randn(64, 64)]
    with autotune(tuner=tuner):
        runner, _ = tuner.choose_one("mm", runners, config, inputs)
    assert isinstance(runner, MatmulRunner)
    key, entry = tuner.cache.items()[0]
    assert key.timing == "wallclock" and entry.speedup is not None and entry.speedup > 2


def test_progress_bar_and_default_tuner() -> None:
    from graphtune.autotuner import get_tuner

    assert get_tuner() is get_tuner()
    tuner, runners, _ = make({-1: 5.0}, {0: 1.0}, show_progress=True)
    assert tuner.summary_table() == ""
    with autotune(tuner=tuner):  # the rich bar runs (to stderr) without disturbing tuning
        assert tuner.choose_one("op", runners, CONFIG, [torch.randn(4, 2)]) == (runners[1], 0)
    assert tuner.stats.tuning_seconds > 0


def test_hits_are_memoised_until_the_cache_changes(monkeypatch) -> None:
    import graphtune.autotuner.resolved as resolved_module

    tuner, runners, _ = make({-1: 5.0, 0: 4.0}, {0: 1.0, 1: 3.0})
    tuner.tuning_mode = True
    x = torch.randn(4, 8)
    assert tuner.choose_one("op", runners, CONFIG, [x]) == (runners[1], 0)
    tuner.tuning_mode = False
    slow_path = []
    real = resolved_module.profile_for
    monkeypatch.setattr(resolved_module, "profile_for", lambda *a: slow_path.append(1) or real(*a))
    for _ in range(5):  # same signature: one slow look-up, then memo hits
        assert tuner.choose_one("op", runners, CONFIG, [torch.randn(4, 8)]) == (runners[1], 0)
    assert len(slow_path) == 1 and tuner.stats.hits == 5
    # Another shape in the same bucket is another signature (one more slow look-up).
    tuner.choose_one("op", runners, CONFIG, [torch.randn(3, 8)])
    assert len(slow_path) == 2
    # A changed entry is seen at once: the memo is keyed on the cache's version.
    key, entry = next((k, e) for k, e in tuner.cache.items() if k.shapes == ((4, 8),))
    tuner.cache.put(key, type(entry)(entry.runner_id.replace('"b"', '"a"'), 0, 0, 4.0, 5.0))
    assert tuner.choose_one("op", runners, CONFIG, [x]) == (runners[0], 0)
    # A new cache object never answers from the old one's memo.
    tuner.cache = type(tuner.cache)()
    assert tuner.choose_one("op", runners, CONFIG, [x]) == (runners[0], FALLBACK_TACTIC)


def test_a_pick_put_between_a_look_up_and_its_memo_is_not_hidden_by_the_memo() -> None:
    from graphtune.autotuner import CacheEntry, TuningCache

    class RacyCache(TuningCache):  # another thread puts a new pick right after each get
        def get(self, key: Any) -> Any:
            found = super().get(key)
            if found is not None and found.runner_index == 0:
                self.put(key, CacheEntry(key.runners[1], 1, 1, None, None))
            return found

    tuner, runners, _ = make({0: 1.0}, {1: 1.0}, cache=RacyCache())
    x = torch.randn(4, 8)
    tuner.pin(OpCall("op", tuple(runners), CONFIG, (x,)), 0, 0)
    assert tuner.choose_one("op", runners, CONFIG, [x]) == (runners[0], 0)  # the raced look-up
    assert tuner.choose_one("op", runners, CONFIG, [x]) == (runners[1], 1)  # then the new pick


def test_equal_configs_share_memo_hits_and_a_config_hashes_once(monkeypatch) -> None:
    import pickle

    import graphtune.autotuner.resolved as resolved_module

    tuner, runners, _ = make({-1: 5.0, 0: 4.0}, {0: 1.0, 1: 3.0})
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0),))
    tuner.tuning_mode = True
    assert tuner.choose_one("op", runners, config, [torch.randn(4, 8)]) == (runners[1], 0)
    tuner.tuning_mode = False
    slow_path = []
    real = resolved_module.profile_for
    monkeypatch.setattr(resolved_module, "profile_for", lambda *a: slow_path.append(1) or real(*a))
    tuner.choose_one("op", runners, config, [torch.randn(4, 8)])
    assert slow_path == [1]  # one slow look-up fills the memo
    # A config built again for every call (as some ops do) hits the same memo entry.
    for _ in range(3):
        twin = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0),))
        assert tuner.choose_one("op", runners, twin, [torch.randn(4, 8)]) == (runners[1], 0)
    assert slow_path == [1]
    # The hash is computed once and is never pickled (string hashes differ between processes).
    assert hash(config) == hash(twin) and "_hash" in vars(config)
    copy = pickle.loads(pickle.dumps(config))
    assert "_hash" not in vars(copy) and copy == config and hash(copy) == hash(config)


class _UnhashableRunner(TunableRunner):
    __hash__ = None  # type: ignore[assignment]  (as a dataclass(eq=True) runner would be)

    def forward(self, inputs, tactic=FALLBACK_TACTIC, **kwargs):
        return inputs[0]


def test_an_unhashable_runner_is_looked_up_the_slow_way() -> None:
    tuner = AutoTuner(show_progress=False)
    runner = _UnhashableRunner()
    for _ in range(3):  # no memo for it, and no error
        assert tuner.choose_one("op", [runner], CONFIG, [torch.randn(4, 8)]) == (
            runner,
            FALLBACK_TACTIC,
        )


def test_missing_profiles_counts_each_key_once_over_repeated_calls() -> None:
    tuner, runners, _ = make({-1: 5.0, 0: 4.0}, {0: 1.0})
    layer = [OpCall("op", runners, CONFIG, [torch.randn(3, 8)]) for _ in range(16)]
    wider = OpCall("op", runners, CONFIG, [torch.randn(3, 12)])  # other shapes: other keys
    other_op = OpCall("op2", runners, CONFIG, [torch.randn(3, 8)])
    assert tuner.missing_profiles(layer) == 3  # buckets 1, 4, 16, however many layers
    assert tuner.missing_profiles([*layer, wider, other_op]) == 9
    tuner.tuning_mode = True
    tuner.choose_one("op", runners, CONFIG, [torch.randn(3, 8)])
    assert tuner.missing_profiles([*layer, wider, other_op]) == 6


def test_memo_keys_tell_devices_and_layouts_apart_and_skip_iterators() -> None:
    from graphtune.autotuner.resolved import memo_key

    runners = [object()]
    cpu, meta = torch.empty(3, 8), torch.empty(3, 8, device="meta")

    def key(inputs: Any, of: Any = runners) -> Any:
        return memo_key("op", of, CONFIG, inputs, {})

    assert key([cpu]) == key([torch.empty(3, 8)])
    assert len({key([cpu]), key([meta]), key([cpu, None]), key([cpu.double()]), key([cpu, 1])}) == 5
    assert key([cpu], iter(runners)) is None and key(iter([cpu])) is None
    assert key([cpu, object()]) is None  # not a tensor, None or a scalar: no memo
    # 1, 1.0 and True are equal in Python, but their cache keys differ: so do their memo keys.
    assert len({key([cpu, 1]), key([cpu, 1.0]), key([cpu, True])}) == 3
    kwargs = [memo_key("op", runners, CONFIG, [cpu], {"flag": v}) for v in (1, 1.0, True)]
    assert len(set(kwargs)) == 3
    assert memo_key("op", runners, CONFIG, [cpu], {"shape": (1, 2)}) is None  # the slow path
    # A look-up with runners given as a generator still works, through the slow path.
    tuner, fakes, _ = make({-1: 5.0, 0: 4.0}, {0: 1.0})
    tuner.tuning_mode = True
    x = torch.randn(3, 8)
    assert tuner.choose_one("op", (r for r in fakes), CONFIG, [x]) == (fakes[1], 0)
    assert tuner.choose_one("op", tuple(fakes), CONFIG, (x,)) == (fakes[1], 0)
