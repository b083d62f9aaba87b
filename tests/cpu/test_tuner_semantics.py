"""Semantics of the tuner a review found broken: per-thread ``record_calls``, the hit memo's
runner identity, candidates' timer sessions, inputs nested in containers, timer names and
pins a cache file cannot keep (one test each).

A runner sets the cost of the tactic it ran and a fake timer reads it, so every pick below is
deterministic (docs/design.md, principle 2).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch
from test_autotuner_tuner import CONFIG as BUCKETS
from test_autotuner_tuner import FakeClock, FakeTimer, make

from graphtune.autotuner import (
    AutoTuner,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
    TuningPolicy,
    autotune,
)
from graphtune.autotuner.calls import OpCall
from graphtune.autotuner.runner import FALLBACK_TACTIC
from graphtune.autotuner.timing.base import Measurement
from graphtune.errors import ConfigError

EXACT = TuningPolicy(
    rounds=1,
    remeasure_top=0,
    tie_tolerance=0.0,
    tie_floor_us=0.0,
    race_margin=0.0,
    max_tie_tolerance=0.0,
)
CONFIG = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)


class CostTimer:
    """Runs the candidate once and reports the cost its runner set."""

    name = "fake"

    def __init__(self) -> None:
        self.cost: float | None = None

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        self.cost = None
        fn(0)
        assert self.cost is not None
        return Measurement.from_samples([self.cost], calls_per_sample=1, timer=self.name)


class Priced(TunableRunner):
    """Tactic ``t`` costs ``costs[t]`` (told apart by type too); anything else costs 100."""

    def __init__(self, timer: CostTimer, costs: list[tuple[Any, float]]) -> None:
        self._timer = timer
        self._costs = costs
        self.tactics = [t for t, _ in costs]

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return list(self.tactics)

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        self._timer.cost = 100.0
        for t, cost in self._costs:
            if t == tactic and type(t) is type(tactic):
                self._timer.cost = cost
        return inputs[0]


def make_tuner(timer: CostTimer | None = None) -> tuple[AutoTuner, CostTimer]:
    timer = timer or CostTimer()
    return AutoTuner(timer, policy=EXACT, show_progress=False), timer


# -- record_calls is per thread -------------------------------------------------------------------


def test_another_threads_record_calls_block_neither_records_nor_dry_runs_this_threads_calls() -> (
    None
):
    tuner, timer = make_tuner()
    runner = Priced(timer, [(-1, 5.0), (1, 1.0)])
    inside, done = threading.Event(), threading.Event()
    recorded: list[Any] = []

    def warm_up() -> None:
        with tuner.record_calls(dry_run=True) as calls:
            inside.set()
            done.wait(10)
        recorded.extend(calls)

    thread = threading.Thread(target=warm_up)
    thread.start()
    try:
        assert inside.wait(10)
        # Serving (not tuning): a miss is counted, recorded and answered with the fallback.
        assert tuner.choose_one("served", [runner], CONFIG, [torch.zeros(4, 2)]) == (runner, -1)
        assert tuner.stats.misses == 1 and tuner.stats.fallbacks == {"served": 1}
        assert len(tuner.misses) == 1
        # Tuning: a miss tunes.
        with autotune(None, tuner):
            assert tuner.choose_one("tuned", [runner], CONFIG, [torch.zeros(4, 2)]) == (runner, 1)
    finally:
        done.set()
        thread.join()
    assert recorded == []  # the block's own thread made no calls


def test_overlapping_record_calls_in_two_threads_leave_the_tuner_as_it_was() -> None:
    tuner, timer = make_tuner()
    runner = Priced(timer, [(-1, 5.0), (1, 1.0)])
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with tuner.record_calls(dry_run=True):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def second() -> None:
        a_in.wait(10)
        with tuner.record_calls(dry_run=True):
            b_in.set()
            a_out.wait(10)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with autotune(None, tuner):
        assert tuner.choose_one("op", [runner], CONFIG, [torch.zeros(4, 2)]) == (runner, 1)
    assert len(tuner.cache) == 1 and tuner.stats.misses == 1


def test_record_calls_blocks_nest_within_a_thread() -> None:
    tuner, timer = make_tuner()
    runner = Priced(timer, [(-1, 5.0), (1, 1.0)])
    with tuner.record_calls() as outer:
        tuner.choose_one("a", [runner], CONFIG, [torch.zeros(4, 2)])
        with tuner.record_calls(dry_run=True) as inner:
            tuner.choose_one("b", [runner], CONFIG, [torch.zeros(4, 2)])
        tuner.choose_one("c", [runner], CONFIG, [torch.zeros(4, 2)])
    assert [c.op for c in outer] == ["a", "c"] and [c.op for c in inner] == ["b"]
    assert tuner.stats.fallbacks == {"a": 1, "c": 1}  # the inner dry run counted nothing


# -- the hit memo tells runners apart by identity -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Blocked(TunableRunner):
    """Equal for any ``block`` (``compare=False``), but ``block`` is part of its identity."""

    timer: CostTimer = dataclasses.field(compare=False, repr=False)
    kind: str
    block: int = dataclasses.field(compare=False, default=0)
    identity_excludes = frozenset({"timer"})

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [1, 2]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        self.timer.cost = {64: {1: 1.0, 2: 2.0}, 128: {1: 2.0, 2: 1.0}}[self.block][tactic]
        return inputs[0]


def test_runners_equal_by_eq_but_of_other_identities_do_not_share_a_memoised_hit() -> None:
    tuner, timer = make_tuner()
    small, big = Blocked(timer, "g", 64), Blocked(timer, "g", 128)
    assert small == big and hash(small) == hash(big)
    x = [torch.zeros(4, 2)]
    with autotune(None, tuner):
        assert tuner.choose_one("op", [small], CONFIG, x) == (small, 1)
        assert tuner.choose_one("op", [big], CONFIG, x) == (big, 2)
    for _ in range(2):  # the second round answers from the memo
        runner, tactic = tuner.choose_one("op", [small], CONFIG, x)
        assert runner is small and tactic == 1
        runner, tactic = tuner.choose_one("op", [big], CONFIG, x)
        assert runner is big and tactic == 2


# -- a timer session per candidate ----------------------------------------------------------------


class CostSession:
    def __init__(self, timer: SessionCostTimer, fn) -> None:
        self._timer, self._fn = timer, fn

    def measure(self) -> Measurement:
        return self._timer.measure(self._fn, warmup=0, repeat=1)

    def close(self) -> None:
        pass


class SessionCostTimer(CostTimer):
    """A session timer (as the graph timer is): each candidate's session runs its own call."""

    name = "fakesession"

    def open(self, fn, *, warmup: int, repeat: int, hint_us: float | None = None) -> CostSession:
        return CostSession(self, fn)


def test_tactics_of_alike_texts_are_timed_on_sessions_of_their_own() -> None:
    tuner, timer = make_tuner(SessionCostTimer())
    # (64, 2) and [64, 2] render alike, as a dtype and its name do; the runner tells them apart.
    runner = Priced(timer, [((64, 2), 5.0), ([64, 2], 1.0)])
    with autotune(None, tuner):
        assert tuner.choose_one("op", [runner], CONFIG, [torch.zeros(4, 2)]) == (runner, [64, 2])
    (record,) = tuner.history
    assert [(c.tactic, c.median_us) for c in record.candidates] == [((64, 2), 5.0), ([64, 2], 1.0)]


class _NamedTimer(FakeTimer):
    def __init__(self, name: Any) -> None:
        super().__init__(FakeClock())
        self.name = name


@pytest.mark.parametrize("name", [None, 7, ""])
def test_a_timer_whose_name_is_no_non_empty_str_is_refused(name: Any) -> None:
    # Its picks would be keyed with a 'timing' that is no string: the next load of the shared
    # cache file rejects the whole file for them.
    with pytest.raises(ConfigError):
        AutoTuner(timer=_NamedTimer(name))  # type: ignore[arg-type]
    AutoTuner(timer=_NamedTimer("mine"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "index, tactic, time_us",
    [
        (0, FALLBACK_TACTIC, -5.0),
        (0, FALLBACK_TACTIC, 0.0),
        (0, FALLBACK_TACTIC, float("nan")),
        (0, FALLBACK_TACTIC, float("inf")),
        (0, FALLBACK_TACTIC, True),
        (0, object(), None),
        (0, float("nan"), 1.0),
        (False, FALLBACK_TACTIC, None),
    ],
)
def test_pin_refuses_what_a_cache_file_cannot_keep(index: Any, tactic: Any, time_us: Any) -> None:
    # Such a pick was served from memory, then dropped by the next load (or failed the save).
    tuner, runners, _ = make({-1: 5.0}, {0: 1.0})
    call = OpCall.checked("op", runners, BUCKETS, [torch.randn(4, 2)], {})
    with pytest.raises(ConfigError):
        tuner.pin(call, index, tactic, time_us=time_us)
    assert len(tuner.cache) == 0
    tuner.pin(call, 1, 0, time_us=2.5)
    assert tuner.choose_one("op", runners, BUCKETS, [torch.randn(4, 2)]) == (runners[1], 0)


class TakesAnyKeyword(TunableRunner):
    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, 1]

    def forward(self, inputs: list, *, tactic: Any = FALLBACK_TACTIC, **kwargs: Any) -> Any:
        return inputs[0]


@pytest.mark.parametrize("name", ["tactic", "profile", "inputs"])
def test_a_keyword_argument_of_a_name_graphtune_passes_itself_is_refused_up_front(
    name: str,
) -> None:
    """choose_one(..., tactic=3) failed as every tactic's TypeError (tuning went on, every
    candidate 'failed'); profile=3 blamed the runner's signature. Now one ConfigError names the
    keyword, for check_tactics too."""
    from graphtune.autotuner import check_tactics

    tuner = AutoTuner(show_progress=False)
    tuner.tuning_mode = True
    x = [torch.zeros(4, 2)]
    kwargs = {name: 3}
    with pytest.raises(ConfigError, match=f"keyword argument '{name}' .*rename it"):
        OpCall.checked("op", [TakesAnyKeyword()], TuningConfig(), x, kwargs)
    if name != "inputs":  # choose_one(..., inputs=...) is Python's own TypeError
        with pytest.raises(ConfigError, match=f"keyword argument '{name}' .*rename it"):
            tuner.choose_one("op", [TakesAnyKeyword()], TuningConfig(), x, **kwargs)
        with pytest.raises(ConfigError, match="check_tactics\\('op'\\): keyword argument"):
            check_tactics("op", [TakesAnyKeyword()], TuningConfig(), x, **kwargs)
    assert not tuner.stats.tactic_failures and len(tuner.cache) == 0
