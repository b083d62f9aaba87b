"""Where tuning time goes and what makes it cheap: timer sessions reused across a candidate's
measurements, the time accounting in ``stats``, and the source digest that invalidates picks."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest
import torch

from graphtune.autotuner import (
    AutoTuner,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
    TuningPolicy,
    autotune,
)
from graphtune.autotuner import identity as identity_module
from graphtune.autotuner.isolation import InProcessExecutor, TacticFailure
from graphtune.autotuner.stats import PHASES
from graphtune.autotuner.timing.base import Measurement, SessionTimer

CONFIG = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 4)),), warmup=0, repeat=1)


class Cost(TunableRunner):
    """Tactic ``t`` costs ``t`` (the fallback 10); a negative cost raises."""

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, 1.0, 2.0, 3.0, -5.0]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        if tactic == -5.0:
            raise RuntimeError("broken tactic")
        return 10.0 if tactic == -1 else float(tactic)


class FakeSession:
    def __init__(self, timer: FakeSessionTimer, fn: Any) -> None:
        self.timer, self.fn, self.closed = timer, fn, False

    def measure(self) -> Measurement:
        assert not self.closed
        value = float(self.fn(0))
        return Measurement.from_samples([value], calls_per_sample=1, timer="fake")

    def close(self) -> None:
        self.closed = True
        self.timer.closed += 1

    def __enter__(self) -> FakeSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FakeSessionTimer:
    """A SessionTimer whose set-up (``open``) is counted: one "capture" per session."""

    name = "fake"

    def __init__(self) -> None:
        self.opened = 0
        self.closed = 0
        self.hints: list[float | None] = []

    def open(
        self, fn: Any, *, warmup: int, repeat: int, hint_us: float | None = None
    ) -> FakeSession:
        fn(0)  # set-up runs the call (a capture would), so a raising tactic fails here
        self.opened += 1
        self.hints.append(hint_us)
        return FakeSession(self, fn)

    def measure(self, fn: Any, *, warmup: int, repeat: int) -> Measurement:
        with self.open(fn, warmup=warmup, repeat=repeat) as session:
            return session.measure()


def test_a_session_timer_is_set_up_once_per_candidate_and_profile() -> None:
    timer = FakeSessionTimer()
    assert isinstance(timer, SessionTimer)
    policy = TuningPolicy(rounds=3, remeasure_top=3, race_margin=0)
    tuner = AutoTuner(timer, policy=policy, show_progress=False)
    with autotune(None, tuner):
        runner, tactic = tuner.choose_one("op", [Cost()], CONFIG, [torch.zeros(4, 2)])
    assert tactic == 1.0
    # 2 profiles x 4 working candidates opened once each (the raising one fails in open);
    # 3 rounds + 3 re-measured = 6 measurements for the top 3, 3 for the fallback.
    assert timer.opened == 2 * 4
    assert tuner.stats.measurements == 2 * (3 * 5 + 3 * 3) - 2 * 2  # failed: measured once
    assert timer.closed == timer.opened, "every session is closed when its profile ends"
    assert tuner.stats.tactic_failures == {"RuntimeError": 2}


def test_sessions_over_the_memory_budget_are_closed_after_each_measurement() -> None:
    timer = FakeSessionTimer()
    held = [0]

    def reserved() -> int:
        held[0] += 100  # every open grows the pool by 100 bytes
        return held[0]

    executor = InProcessExecutor(
        timer, torch.device("cpu"), session_bytes=150, reserved_bytes=reserved
    )
    runner = Cost()
    executor.begin([runner], [[torch.zeros(1)]])
    for _ in range(3):
        for tactic in (1.0, 2.0, 3.0):
            executor.measure(0, runner, tactic, warmup=0, repeat=1)
    # The first session fits (100 <= 150) and is reused; the others are re-opened each time.
    assert timer.opened == 1 + 2 * 3 and executor.session_measurements == 2
    with pytest.raises(TacticFailure):
        executor.measure(0, runner, -5.0, warmup=0, repeat=1)
    executor.end()
    assert timer.closed == timer.opened


def test_a_session_is_sized_from_the_fastest_candidate_of_its_bucket_so_far() -> None:
    timer = FakeSessionTimer()
    executor = InProcessExecutor(timer, torch.device("cpu"))
    runner = Cost()
    executor.begin([runner], [[torch.zeros(1)]])
    for tactic in (2.0, 3.0, 1.0, -1):
        executor.measure(0, runner, tactic, warmup=0, repeat=1)
    assert timer.hints == [None, 2.0, 2.0, 1.0]
    executor.begin([runner], [[torch.zeros(1)]])  # a new bucket starts without a guess
    executor.measure(0, runner, 3.0, warmup=0, repeat=1)
    assert timer.hints[-1] is None


def test_stats_say_where_the_tuning_time_went() -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 0.001
        return now[0]

    tuner = AutoTuner(FakeSessionTimer(), show_progress=False, clock=clock)
    with autotune(None, tuner):
        tuner.choose_one("op", [Cost()], CONFIG, [torch.zeros(4, 2)])
    phases = tuner.stats.phase_seconds
    assert set(phases) == set(PHASES) and all(v > 0 for v in phases.values())
    assert sum(phases.values()) <= tuner.stats.tuning_seconds
    assert all(record.seconds > 0 for record in tuner.history)


RUNNER_SOURCE = """
from graphtune.autotuner import TunableRunner


class SourceRunner(TunableRunner):
    def get_valid_tactics(self, inputs, profile, **kwargs):
        return [-1, 0]

    def forward(self, inputs, *, tactic=-1, **kwargs):
        return 1.0 if tactic == 0 else 2.0  # {version}
"""


def test_a_change_to_a_runner_source_invalidates_its_picks(tmp_path, monkeypatch) -> None:
    module_file = tmp_path / "gt_source_runner.py"
    module_file.write_text(RUNNER_SOURCE.format(version="v1"))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("gt_source_runner")
    cache = tmp_path / "cache.json"

    class ReportTimer:
        name = "report"

        def measure(self, fn: Any, *, warmup: int, repeat: int) -> Measurement:
            return Measurement.from_samples([float(fn(0))], calls_per_sample=1, timer="report")

    tuner = AutoTuner(ReportTimer(), show_progress=False)
    with autotune(cache, tuner):
        assert tuner.choose_one("op", [module.SourceRunner()], CONFIG, [torch.zeros(4, 2)])[1] == 0
    same = AutoTuner(ReportTimer(), show_progress=False)
    with autotune(cache, same, tune=False):
        same.choose_one("op", [module.SourceRunner()], CONFIG, [torch.zeros(4, 2)])
    assert same.stats.hits == 1
    # The kernel is edited; a new process hashes the new source (modelled by clearing the
    # once-per-process digest memo).
    module_file.write_text(RUNNER_SOURCE.format(version="v2"))
    identity_module.module_digest.cache_clear()
    try:
        edited = AutoTuner(ReportTimer(), show_progress=False)
        with autotune(cache, edited, tune=False):
            runner, tactic = edited.choose_one(
                "op", [module.SourceRunner()], CONFIG, [torch.zeros(4, 2)]
            )
        assert tactic == -1 and edited.stats.misses == 1, "the old pick must not be used"
    finally:
        identity_module.module_digest.cache_clear()
        sys.modules.pop("gt_source_runner", None)


def _cell_class(source: str, filename: str) -> type:
    """``SourceRunner`` defined as a notebook cell defines it: no module file, the cell's text in
    ``linecache`` under the cell's name (as IPython registers it)."""
    import linecache

    if not filename.startswith("<string"):  # `python -c` registers nothing
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": "gt_cell_module"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["SourceRunner"]


def test_a_runner_without_a_source_file_is_hashed_by_its_source_text(caplog) -> None:
    one = _cell_class(RUNNER_SOURCE.format(version="v1"), "<ipython-input-1-gt>")
    two = _cell_class(RUNNER_SOURCE.format(version="v2"), "<ipython-input-2-gt>")
    same = _cell_class(RUNNER_SOURCE.format(version="v1"), "<ipython-input-3-gt>")
    digest = identity_module.sources_digest
    assert digest([one()]) != digest([two()]), "an edited cell must not reuse the old picks"
    assert digest([one()]) == digest([same()])
    # No source anywhere: one warning per class that its edits go unnoticed.
    hidden = _cell_class(RUNNER_SOURCE.format(version="v1"), "<string>")
    with caplog.at_level("WARNING", logger="graphtune.autotuner.identity"):
        digest([hidden()])
        digest([hidden()])
    assert caplog.text.count("will not invalidate its cached picks") == 1


class SeesInputs(TunableRunner):
    """Records the storage of each input it runs on."""

    identity_excludes = frozenset({"seen"})

    def __init__(self) -> None:
        self.seen: set[tuple[int, tuple[int, ...], int]] = set()

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, 0]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        self.seen.update((i, tuple(x.shape), x.data_ptr()) for i, x in enumerate(inputs))
        return 1.0


def test_an_input_of_the_same_shape_in_every_bucket_is_synthesized_once() -> None:
    runner = SeesInputs()
    tuner = AutoTuner(FakeSessionTimer(), show_progress=False)
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 2, 4, 8)),), warmup=0)
    with autotune(None, tuner):
        tuner.choose_one("op", [runner], config, [torch.zeros(8, 4), torch.zeros(16, 4)])
    weights = {ptr for i, _, ptr in runner.seen if i == 1}
    activations = {shape for i, shape, _ in runner.seen if i == 0}
    assert len(weights) == 1  # one weight tensor for the four buckets
    assert activations == {(1, 4), (2, 4), (4, 4), (8, 4)}


def test_session_bytes_zero_captures_again_for_every_measurement() -> None:
    timer = FakeSessionTimer()
    policy = TuningPolicy(rounds=3, remeasure_top=0, session_bytes=0)
    tuner = AutoTuner(timer, policy=policy, show_progress=False)
    with autotune(None, tuner):
        tuner.choose_one("op", [Cost()], CONFIG, [torch.zeros(4, 2)])
    # One set-up per measurement, as before sessions (the raising tactic fails inside its set-up,
    # once per bucket).
    assert timer.opened == tuner.stats.measurements - 2
    assert timer.closed == timer.opened


class Ahead(Cost):
    """Records what the tuner prepares, and whether it may start that in the background."""

    def __init__(self, name: str, log: list, background: bool) -> None:
        self.name, self.log, self.background = name, log, background

    def prepare_ahead(self, work: Any) -> bool:
        self.log.append(("ahead", self.name, len(work)))
        return self.background

    def prepare_all(self, work: Any) -> None:
        self.log.append(("up front", self.name, len(work)))

    def cache_key_extras(self) -> tuple:
        return (self.name,)


class NoAheadMethod:
    """A runner of another base class: the protocol's methods, no ``prepare_ahead``."""

    def __init__(self, log: list) -> None:
        self.log = log

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, 1.0]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        return 1.0

    def prepare(self, inputs: list, tactic: Any) -> None:
        pass

    def prepare_all(self, work: Any) -> None:
        self.log.append(("up front", "other", len(work)))

    def cache_key_extras(self) -> tuple:
        return ()


def test_prepare_ahead_hands_calls_off_in_order_and_prepares_the_rest_up_front() -> None:
    log: list = []
    first, second = Ahead("first", log, True), Ahead("second", log, True)
    stays = Ahead("stays", log, False)
    other = NoAheadMethod(log)
    recorder = AutoTuner(show_progress=False)
    x = torch.randn(4, 2)
    with recorder.record_calls() as calls:
        for runner in (second, first, stays, first):  # the last repeats a call: planned once
            recorder.choose_one(f"op-{runner.name}", [runner], CONFIG, [x])
        recorder.choose_one("op-other", [other], CONFIG, [x])
    tuner = AutoTuner(show_progress=False)
    prepared = tuner.prepare(calls, ahead=True)
    # Two buckets per op: each call hands off its two profiles, in the order of the calls;
    # a runner that starts nothing so, or cannot, is prepared up front (after the hand-offs).
    assert log[:3] == [("ahead", "second", 2), ("ahead", "first", 2), ("ahead", "stays", 2)]
    assert sorted(log[3:]) == [("up front", "other", 2), ("up front", "stays", 2)]
    assert prepared == 3 * 2 * 5 + 2 * 2  # every (profile, tactic): 3 Cost ops, the other
    log.clear()
    assert tuner.prepare(calls) > 0 and ("ahead", "first", 2) not in log  # off by default


class NoTactics(Cost):
    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        raise RuntimeError("no tactics here")


def test_prepare_ahead_of_tuning_leaves_the_counting_to_the_tuning_run() -> None:
    """prepare() plans the same profiles as the tuning run: failures and blocklist skips are
    counted once, by the run, as without prepare()."""
    from graphtune.autotuner.entries import BlockedTactic
    from graphtune.autotuner.identity import runner_id

    x = [torch.randn(4, 2)]
    counts = []
    for prepare_first in (False, True):
        runners = [Cost(), NoTactics()]
        tuner = AutoTuner(FakeSessionTimer(), show_progress=False)
        tuner.cache.block(BlockedTactic(runner_id(runners[0]), 3.0, "crash", "op", "op [4x2]"))
        with tuner.record_calls(dry_run=True) as calls:
            tuner.choose_one("op", runners, CONFIG, x)
        if prepare_first:
            tuner.prepare(calls)
        tuner.tuning_mode = True
        tuner.choose_one("op", runners, CONFIG, x)
        counts.append((tuner.stats.tactics_blocked, dict(tuner.stats.tactic_failures)))
    # per bucket (2): tactic 3.0 skipped; NoTactics and tactic -5.0 raise
    assert counts[0] == counts[1] == (2, {"RuntimeError": 4})
