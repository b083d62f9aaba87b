"""CPU tests of ``GraphTimer(lead_in=...)`` (:mod:`graphtune.autotuner.timing.lead_in`).

The timer's CUDA seams (warm-up, capture, timed replays, streams) are fakes on a clock that the
fake lead-in and candidate advance, so what it wraps, measures and subtracts is checked exactly.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch

from graphtune.autotuner.timing import GraphTimer
from graphtune.autotuner.timing import graph as graph_module
from graphtune.autotuner.timing import lead_in as lead_in_module
from graphtune.errors import ConfigError

LEAD_US, CALL_US = 2.0, 5.0


class _Clock:
    """GPU time the fake kernels add; what each warm-up and capture ran."""

    def __init__(self) -> None:
        self.us = 0.0
        self.lead_calls = 0
        self.calls = 0
        self.warm_ups: list[tuple[int, int]] = []  # (lead-in calls, candidate calls)
        self.captures: list[tuple[int, int, int]] = []  # (calls, lead-in calls, candidate calls)

    def lead_in(self) -> None:
        self.us += LEAD_US
        self.lead_calls += 1

    def candidate(self, i: int) -> None:
        self.us += CALL_US
        self.calls += 1

    def ran(self, fn, counter, calls: int) -> tuple[float, int, int]:
        us, lead, cand = self.us, self.lead_calls, self.calls
        for _ in range(calls):
            fn(next(counter))
        return self.us - us, self.lead_calls - lead, self.calls - cand


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    clock = _Clock()

    def warm_up(self, fn, counter, calls, stream):
        clock.warm_ups.append(clock.ran(fn, counter, calls)[1:])
        return None

    def capture(self, fn, counter, calls, stream, device, *, keep=False):
        us, lead, cand = clock.ran(fn, counter, calls)
        clock.captures.append((calls, lead, cand))
        return SimpleNamespace(us=us)

    def replays(self, graph, count, stream, device, **_):
        return [graph.us] * count

    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(graph_module, "require_cuda", lambda who, device: torch.device(device))
    monkeypatch.setattr(graph_module, "cuda_runtime", lambda: None)  # one graph, no pieces
    monkeypatch.setattr(graph_module, "release_graph", lambda graph: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: stream)
    monkeypatch.setattr(GraphTimer, "_side_stream", lambda self, device: stream)
    monkeypatch.setattr(GraphTimer, "_warm_up", warm_up)
    monkeypatch.setattr(GraphTimer, "_capture", capture)
    monkeypatch.setattr(GraphTimer, "_time_replays", replays)
    return clock


def test_the_lead_ins_own_time_is_subtracted_from_every_sample(clock):
    timer = GraphTimer(device="cuda:0", lead_in=clock.lead_in)
    measured = timer.measure(clock.candidate, warmup=3, repeat=1)
    assert measured.median_us == pytest.approx(CALL_US) and measured.min_us == pytest.approx(
        CALL_US
    )
    with timer.open(clock.candidate, warmup=3, repeat=1, hint_us=1.0) as session:
        first, second = session.measure(), session.measure()  # the probe's, then fresh replays
    assert first.median_us == pytest.approx(CALL_US) == second.median_us


def test_the_lead_in_wraps_warm_up_and_captured_calls_and_is_measured_alone_once(clock):
    timer = GraphTimer(device="cuda:0", lead_in=clock.lead_in, min_replay_us=20.0)
    timer.measure(clock.candidate, warmup=3, repeat=1)
    # First the lead-in's own chain (no lead-in added to itself), then the wrapped candidate.
    assert clock.warm_ups == [(3, 0), (3, 3)]
    own = [c for c in clock.captures if c[2] == 0]
    assert own and all(lead == calls for calls, lead, _ in own)
    assert own[-1][0] * LEAD_US >= lead_in_module.MIN_LEAD_IN_REPLAY_US  # a >= 100 us replay
    wrapped = clock.captures[len(own) :]
    assert wrapped and all(lead == cand == calls for calls, lead, cand in wrapped)
    timer.measure(clock.candidate, warmup=3, repeat=1)
    assert [w for w in clock.warm_ups if w[1] == 0] == [(3, 0)]  # cached for the device
    timer.device = "cuda:1"
    timer.measure(clock.candidate, warmup=3, repeat=1)
    assert [w for w in clock.warm_ups if w[1] == 0] == [(3, 0), (3, 0)]  # once per device
    assert timer.lead_in == clock.lead_in and timer.min_replay_us == 20.0  # the copy measured


def test_the_hint_of_a_wrapped_call_includes_the_lead_in(clock, monkeypatch):
    seen = []
    real = graph_module.ReplayPlan

    def plan(*args, **kwargs):
        seen.append(kwargs["hint_us"])
        return real(*args, **kwargs)

    monkeypatch.setattr(graph_module, "ReplayPlan", plan)
    GraphTimer(device="cuda:0", lead_in=clock.lead_in).open(
        clock.candidate, warmup=1, repeat=1, hint_us=4.0
    ).close()
    assert seen == [None, 4.0 + LEAD_US]  # the lead-in's own chain has no hint


def test_without_a_lead_in_nothing_changes(clock):
    timer = GraphTimer(device="cuda:0")
    assert timer.lead_in is None and timer.lead_in_state is None
    measured = timer.measure(clock.candidate, warmup=2, repeat=1)
    assert measured.median_us == pytest.approx(CALL_US) and clock.lead_calls == 0
    assert clock.warm_ups == [(0, 2)]


@pytest.mark.parametrize("bad", [3, "kernel", object()])
def test_a_lead_in_that_is_not_callable_is_refused(bad):
    with pytest.raises(ConfigError, match="lead_in must be a zero-argument callable"):
        GraphTimer(lead_in=bad)


def test_a_sample_at_or_below_the_lead_in_is_clamped_and_logged(caplog):
    timer = GraphTimer(lead_in=lambda: None)
    assert timer.lead_in_state is not None
    timer.lead_in_state._us[0] = 3.0
    with caplog.at_level(logging.DEBUG, logger=lead_in_module.__name__):
        out = lead_in_module.corrected(timer, torch.device("cuda", 0), [5.0, 3.0, 1.0])
    assert out == pytest.approx([2.0, lead_in_module.FLOOR_US, lead_in_module.FLOOR_US])
    assert "2 of 3 samples at or below" in caplog.text


def test_no_pdl_lead_in_off_cuda():
    from graphtune.ops.lead_in import pdl_lead_in

    assert pdl_lead_in(torch.device("cpu")) is None
