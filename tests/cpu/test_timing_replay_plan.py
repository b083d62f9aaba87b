"""CPU tests of the graph timer's replay sizing (``ReplayPlan``, pieces repeated as child
graphs, the probe whose replays become the first measurement) and of the host-lead bound (fast;
no GPU needed)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtune.autotuner.timing import GraphTimer
from graphtune.errors import CaptureError


def test_repeated_pieces_find_the_mapped_cuda_runtime(tmp_path):
    from graphtune.autotuner.timing import repeated

    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /site/nvidia/cu13/lib/libcudart.so.13\n"
        "7f04-7f05 rw-p 00000000 00:00 0\n"
    )
    assert repeated._mapped_cudart(maps) == "/site/nvidia/cu13/lib/libcudart.so.13"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert repeated._mapped_cudart(maps) is None
    assert repeated._mapped_cudart(tmp_path / "missing") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_repeated_pieces_are_off_without_cuda():
    from graphtune.autotuner.timing import repeated

    assert repeated.cuda_runtime() is None


def _drive(plan, per_call_us, fixed_us=1.5, probes=3):
    """Runs ``plan`` against a replay lasting ``fixed_us + calls * per_call_us``; returns steps."""
    steps = []
    for _ in range(probes):
        step = plan.next(fixed_us + plan.total * per_call_us)
        steps.append(step)
        if step is None:
            break
    return steps


def _plan(repeat=1, *, pieces=True, estimate_us=None, max_repeat=1024, hint_us=None):
    from graphtune.autotuner.timing.sizing import ReplayPlan

    return ReplayPlan(
        repeat,
        min_replay_us=100.0,
        max_repeat=max_repeat,
        min_calls=3,
        min_piece_us=25.0,
        pieces=pieces,
        estimate_us=estimate_us,
        hint_us=hint_us,
    )


def test_replay_plan_sizes_its_first_piece_from_a_good_guess():
    from graphtune.autotuner.timing.sizing import Step

    plan = _plan(hint_us=2.0)
    assert 25.0 <= plan.calls * 2.0 < 40.0  # about min_piece_us at the guess
    assert _drive(plan, per_call_us=2.0) == [Step.REPEAT, None]  # no 3-call capture first
    assert plan.total * 2.0 >= 100.0


def test_replay_plan_grows_a_piece_sized_from_a_guess_that_was_too_high():
    from graphtune.autotuner.timing.sizing import Step

    plan = _plan(hint_us=8.0)
    steps = _drive(plan, per_call_us=1.0)
    assert steps == [Step.CAPTURE, Step.REPEAT, None]  # as without a guess
    assert plan.total * 1.0 >= 100.0


def test_replay_plan_guess_is_capped_by_the_warm_up_bound_and_spares_long_calls():
    assert _plan(hint_us=5.0, estimate_us=2.0).calls == _plan(hint_us=2.0).calls  # t <= bound
    assert _plan(hint_us=0.5, estimate_us=500.0).calls == 1  # a long call: replayed alone
    assert _plan(repeat=8, hint_us=0.5).calls % 8 == 0  # whole cold-L2 walks
    assert 100.0 <= _plan(pieces=False, hint_us=2.0).calls * 2.0 < 120.0


@settings(max_examples=200, deadline=None)
@given(guess=st.floats(0.05, 500.0), per_call=st.floats(0.5, 500.0))
def test_replay_plan_with_any_guess_reaches_the_target(guess, per_call):
    # A call inside a graph lasts at least about a microsecond (one kernel); far shorter ones
    # (with or without a guess) can run into max_repeat before the replay reaches its target.
    plan = _plan(hint_us=guess)
    _drive(plan, per_call_us=per_call, probes=3)
    assert plan.total * per_call >= 90.0


def test_replay_plan_repeats_one_short_piece():
    from graphtune.autotuner.timing.sizing import Step

    plan = _plan()
    assert plan.calls == 3  # min_calls while the call's time is unknown
    steps = _drive(plan, per_call_us=2.0)
    assert steps == [Step.CAPTURE, Step.REPEAT, None]  # one longer piece, then its copies
    assert 20.0 <= 1.5 + plan.calls * 2.0 < 40.0 and plan.copies > 1  # about min_piece_us
    assert plan.total * 2.0 >= 100.0


def test_replay_plan_pieces_keep_cold_l2_walks_whole():
    plan = _plan(repeat=8)
    _drive(plan, per_call_us=0.5)
    assert plan.calls % 8 == 0 and plan.copies > 1 and plan.total * 0.5 >= 100.0


@settings(max_examples=300, deadline=None)
@given(
    repeat=st.integers(1, 8),
    per_call=st.floats(0.5, 300.0),
    pieces=st.booleans(),
    max_repeat=st.integers(1, 300),
    hint=st.one_of(st.none(), st.floats(0.1, 300.0)),
)
def test_replay_plan_holds_whole_cold_l2_walks(repeat, per_call, pieces, max_repeat, hint):
    # A count that is not a multiple of the input copies reuses a copy it has just read (hot
    # in L2) at every replay boundary: 2 copies gave 3-call pieces (29% of calls hot).
    plan = _plan(repeat, pieces=pieces, max_repeat=max_repeat, hint_us=hint)
    assert plan.calls % repeat == 0
    _drive(plan, per_call_us=per_call, probes=4)
    assert plan.calls % repeat == 0 and plan.total % repeat == 0
    plan.without_pieces()
    assert plan.calls % repeat == 0


def test_replay_plan_replays_a_long_call_alone():
    from graphtune.autotuner.timing.sizing import Step

    plan = _plan()
    assert _drive(plan, per_call_us=800.0) == [Step.CAPTURE, None] and plan.total == 1
    plan = _plan(estimate_us=790.0)  # warm-up already showed a long call: no 3-call capture
    assert plan.calls == 1 and _drive(plan, per_call_us=800.0) == [None]
    plan = _plan(repeat=2, estimate_us=790.0)  # the caller's cold-L2 walk stays whole
    assert plan.calls == 2 and _drive(plan, per_call_us=800.0) == [None]
    # With no timed estimate, a guess of a long call (a step timed before) does the same ...
    plan = _plan(hint_us=790.0)
    assert plan.calls == 1 and _drive(plan, per_call_us=800.0) == [None]
    # ... and the probe still decides when the guess was wrong: the capture grows.
    plan = _plan(hint_us=790.0)
    _drive(plan, per_call_us=20.0)
    assert plan.total * 20.0 >= 100.0
    # A timed estimate of a short call outranks the guess.
    assert _plan(estimate_us=50.0, hint_us=790.0).calls > 1


def test_replay_plan_keeps_min_calls_below_the_target():
    plan = _plan()
    assert _drive(plan, per_call_us=40.0) == [None] and plan.total == 3
    plan = _plan(estimate_us=250.0)  # a host-bound warm-up overstated a 60 us call
    _drive(plan, per_call_us=60.0)
    assert plan.total >= 3 and plan.total * 60.0 >= 100.0


def test_replay_plan_without_pieces_captures_every_call():
    from graphtune.autotuner.timing.sizing import Step

    plan = _plan(pieces=False)
    steps = _drive(plan, per_call_us=2.0)
    assert set(steps) <= {Step.CAPTURE, None} and plan.copies == 1
    assert plan.total * 2.0 >= 90.0
    plan = _plan()
    _drive(plan, per_call_us=2.0)
    total = plan.total
    assert plan.without_pieces() is Step.CAPTURE
    assert (plan.calls, plan.copies, plan.pieces) == (total, 1, False)


def test_replay_plan_respects_max_repeat():
    plan = _plan(max_repeat=64)
    _drive(plan, per_call_us=0.1, probes=5)
    assert plan.total <= 64


class _FakePiece:
    """A captured graph of ``calls`` calls whose replay lasts ``fixed + calls * per_call`` µs."""

    def __init__(self, calls: int, per_call: float, fixed: float = 1.5) -> None:
        self.calls, self.per_call, self.fixed = calls, per_call, fixed
        self.released = False

    def replay_us(self) -> float:
        return self.fixed + self.calls * self.per_call

    def reset(self) -> None:
        self.released = True


class _FakeRepeated:
    fail = False

    def __init__(self, piece: _FakePiece, copies: int, runtime: object) -> None:
        if _FakeRepeated.fail:
            raise CaptureError("cudaGraphAddChildGraphNode failed")
        self.piece, self.copies = piece, copies

    def replay_us(self) -> float:
        return self.piece.fixed + self.copies * self.piece.calls * self.piece.per_call

    def reset(self, *, keep_piece: bool = False) -> None:
        if not keep_piece:
            self.piece.reset()


def _sized(monkeypatch, per_call: float, *, runtime: object | None = "rt", fail=False, **kw):
    """Runs GraphTimer._capture_sized against fake graphs; returns (graph, calls, captured,
    probe, probes) where ``probes`` lists the replay counts of every probe."""
    from graphtune.autotuner.timing import graph as graph_module

    captured: list[tuple[int, bool]] = []
    probes: list[int] = []
    monkeypatch.setattr(graph_module, "cuda_runtime", lambda: runtime)
    monkeypatch.setattr(graph_module, "RepeatedGraph", _FakeRepeated)
    monkeypatch.setattr(_FakeRepeated, "fail", fail)

    def capture(self, fn, counter, calls, stream, device, *, keep=False):
        captured.append((calls, keep))
        return _FakePiece(calls, per_call)

    def replays(self, graph, count, stream, device, **_):
        probes.append(count)
        return [graph.replay_us() + i for i in range(count)]

    monkeypatch.setattr(GraphTimer, "_capture", capture)
    monkeypatch.setattr(GraphTimer, "_time_replays", replays)
    timer = GraphTimer(**kw)
    graph, plan, probe = timer._capture_sized(lambda i: None, iter(()), 1, None, None)
    return graph, plan.total, captured, probe, probes


def test_graph_timer_builds_a_long_replay_from_copies_of_a_piece(monkeypatch):
    graph, calls, captured, _, _ = _sized(monkeypatch, per_call=2.0)
    assert isinstance(graph, _FakeRepeated)
    assert captured == [(3, True), (graph.piece.calls, True)]  # no call is captured twice
    assert calls == graph.piece.calls * graph.copies and calls * 2.0 >= 100.0


@pytest.mark.parametrize("runtime, fail", [(None, False), ("rt", True)])
def test_graph_timer_captures_every_call_without_pieces(monkeypatch, runtime, fail):
    graph, calls, captured, _, _ = _sized(monkeypatch, per_call=2.0, runtime=runtime, fail=fail)
    assert isinstance(graph, _FakePiece) and graph.calls == calls
    assert calls * 2.0 >= 90.0 and captured[-1] == (calls, False)


def test_the_last_probe_times_the_returned_graph(monkeypatch):
    graph, _, _, probe, probes = _sized(monkeypatch, per_call=2.0, probe_replays=4)
    assert probes == [4, 4, 4]  # each probe times probe_replays replays
    assert probe == [graph.replay_us() + i for i in range(4)]  # of the graph returned


def test_no_probe_is_returned_when_the_last_step_changed_the_graph(monkeypatch):
    from graphtune.autotuner.timing import graph as graph_module

    monkeypatch.setattr(graph_module, "_MAX_RESIZES", 2)  # stops right after building copies
    graph, _, _, probe, probes = _sized(monkeypatch, per_call=2.0)
    assert isinstance(graph, _FakeRepeated) and len(probes) == 2 and probe is None


def _session(monkeypatch, probe_us, calls=4):
    from graphtune.autotuner.timing.graph import GraphSession

    fresh: list[int] = []

    def replays(self, graph, count, stream, device, **_):
        fresh.append(count)
        return [10.0 * calls] * count

    monkeypatch.setattr(GraphTimer, "_time_replays", replays)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    stream = SimpleNamespace(wait_stream=lambda other: None)
    caller = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: caller)
    timer = GraphTimer(replays=7)
    session = GraphSession(timer, object(), calls, stream, "cuda:0", probed=True, probe_us=probe_us)
    return session, fresh


def test_a_sessions_first_measurement_is_its_probe(monkeypatch):
    session, fresh = _session(monkeypatch, [40.0, 44.0, 48.0])
    first = session.measure()
    assert fresh == [] and first.n == 3 and first.median_us == 11.0  # 44 µs over 4 calls
    second = session.measure()
    assert fresh == [7] and second.n == 7 and second.median_us == 10.0  # then replays


def test_a_fresh_measurement_ignores_the_probe(monkeypatch):
    session, fresh = _session(monkeypatch, [40.0, 44.0, 48.0])
    assert session.measure(fresh=True).n == 7 and fresh == [7]
    assert session.measure().n == 7 and fresh == [7, 7]  # the probe is spent either way


def test_host_lead_covers_the_first_replay_when_replays_outlast_their_launch():
    from graphtune.autotuner.timing.delay import host_lead_us

    assert host_lead_us(10, 25.0, None) == 250.0  # unknown replay time: the whole batch
    assert host_lead_us(10, 25.0, 110.0) == 25.0  # the GPU never catches up after the first
    # Replays shorter than their launch: the GPU gains on the host by the difference each time.
    assert host_lead_us(10, 25.0, 20.0) == 250.0 - 9 * 20.0
    assert host_lead_us(1, 25.0, 5.0) == 25.0


@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(1, 50),
    host=st.floats(0.5, 200.0),
    replay=st.floats(0.5, 2000.0),
)
def test_host_lead_keeps_every_replay_queued(count, host, replay):
    from graphtune.autotuner.timing.delay import host_lead_us

    lead = host_lead_us(count, host, replay)
    # Replay k (1-based) is enqueued by k * host and starts on the GPU at lead + (k-1) * replay.
    for k in range(1, count + 1):
        assert lead + (k - 1) * replay >= k * host - 1e-6


@pytest.mark.parametrize(
    "call_us, fixed_us, pieces",
    [
        (6.7, 3.0, [(15, 1)]),  # a few µs a call: one piece, an unbroken chain
        (1.0, 0.0, [(110, 1)]),  # a first probe that is exact: one piece
        (1.0, 3.0, [(55, 2)]),  # the fixed cost of 3 probed calls overstates a 1 µs call
    ],
)
def test_the_default_piece_is_a_whole_replay_as_the_first_probe_estimates_it(
    call_us, fixed_us, pieces
):
    from graphtune.autotuner.timing.sizing import ReplayPlan

    timer = GraphTimer()
    plan = ReplayPlan(
        1,
        min_replay_us=timer.min_replay_us,
        max_repeat=timer.max_repeat,
        min_calls=timer.min_calls,
        min_piece_us=timer.min_piece_us,
        pieces=True,
    )
    for _ in range(3):  # the timer's resize limit
        if plan.next(plan.total * call_us + fixed_us) is None:
            break
    assert [(plan.calls, plan.copies)] == pieces
