"""CPU tests of the timers, timer resolution and cold-L2 sizing (fast; no GPU needed)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtune.autotuner import timing
from graphtune.autotuner.timing import (
    EventTimer,
    GraphTimer,
    Measurement,
    Timer,
    WallClockTimer,
    auto_repeat_calls,
    cold_l2_copies,
    delay_us_for_host_time,
    input_set_bytes,
    l2_cache_bytes,
    resolve_timer,
    rotating,
)
from graphtune.autotuner.timing import cold_l2 as cold_l2_module
from graphtune.errors import CaptureError, ConfigError

MIB = 1024 * 1024
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


# --- Measurement -------------------------------------------------------------------------------


def test_measurement_statistics_odd_and_even():
    m = Measurement.from_samples([5.0, 1.0, 3.0], calls_per_sample=4, timer="t")
    assert (m.median_us, m.min_us, m.n, m.calls_per_sample, m.timer) == (3.0, 1.0, 3, 4, "t")
    assert m.spread == pytest.approx((5.0 - 1.0) / 3.0)
    even = Measurement.from_samples([4.0, 1.0, 2.0, 3.0, 100.0, 5.0], calls_per_sample=1, timer="t")
    assert even.median_us == 3.5
    assert even.min_us == 1.0
    assert even.spread > 0


def test_measurement_single_sample_and_empty():
    one = Measurement.from_samples([2.5], calls_per_sample=1, timer="t")
    assert (one.median_us, one.min_us, one.spread, one.n) == (2.5, 2.5, 0.0, 1)
    with pytest.raises(ValueError):
        Measurement.from_samples([], calls_per_sample=1, timer="t")


# --- WallClockTimer ----------------------------------------------------------------------------


class FakeClock:
    """A clock that only moves when the timed function says so."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def test_wallclock_fake_clock_exact_numbers():
    clock = FakeClock()
    seen: list[int] = []
    syncs: list[float] = []

    def fn(i: int) -> None:
        seen.append(i)
        clock.now += (i + 1) * 1e-6  # call i takes (i + 1) µs

    timer = WallClockTimer(samples=3, clock=clock, sync=lambda: syncs.append(clock.now))
    m = timer.measure(fn, warmup=2, repeat=4)
    # Warm-up calls 0, 1; windows are calls 2..5, 6..9, 10..13 (indices keep counting).
    assert seen == list(range(14))
    assert m.n == 3 and m.calls_per_sample == 4 and m.timer == "wallclock"
    assert m.min_us == pytest.approx((3 + 4 + 5 + 6) / 4)
    assert m.median_us == pytest.approx((7 + 8 + 9 + 10) / 4)
    assert m.spread == pytest.approx(((11 + 12 + 13 + 14) / 4 - 4.5) / 8.5)
    assert len(syncs) == 6  # before start and before stop of each window
    assert clock.reads == 6


def test_wallclock_runs_one_warmup_even_when_zero():
    calls: list[int] = []
    WallClockTimer(samples=1).measure(calls.append, warmup=0, repeat=2)
    assert calls == [0, 1, 2]


def test_wallclock_real_clock_separates_slow_from_fast():
    timer = WallClockTimer(samples=3)
    slow = timer.measure(lambda i: time.sleep(0.002), warmup=1, repeat=2)
    fast = timer.measure(lambda i: None, warmup=1, repeat=2)
    assert slow.median_us > 1500
    assert fast.median_us < 200
    assert slow.median_us > 10 * fast.median_us


def test_wallclock_rejects_bad_arguments():
    with pytest.raises(ConfigError):
        WallClockTimer(samples=0)
    timer = WallClockTimer()
    with pytest.raises(ConfigError):
        timer.measure(lambda i: None, warmup=-1, repeat=1)
    with pytest.raises(ConfigError):
        timer.measure(lambda i: None, warmup=1, repeat=0)
    with pytest.raises(ConfigError):
        timer.measure(lambda i: None, warmup=1, repeat=2.5)  # type: ignore[arg-type]


def test_timers_satisfy_protocol():
    for timer in (WallClockTimer(), EventTimer(), GraphTimer()):
        assert isinstance(timer, Timer)
    assert {WallClockTimer.name, EventTimer.name, GraphTimer.name} == {
        "wallclock",
        "events",
        "graph",
    }


def test_only_an_auto_repeat_graph_timer_sizes_its_samples():
    from graphtune.autotuner.isolation import InProcessExecutor, Isolation
    from graphtune.autotuner.worker import SubprocessExecutor

    assert timing.sizes_its_samples(GraphTimer())
    assert not timing.sizes_its_samples(GraphTimer(auto_repeat=False))
    assert not timing.sizes_its_samples(EventTimer())
    assert not timing.sizes_its_samples(WallClockTimer())
    cpu = torch.device("cpu")
    assert InProcessExecutor(GraphTimer(), cpu).sizes_samples
    assert not InProcessExecutor(WallClockTimer(), cpu).sizes_samples
    assert SubprocessExecutor(Isolation("subprocess"), GraphTimer(), "auto", cpu).sizes_samples
    # Without a timer the worker resolves the mode: 'auto' on the CPU is the wall clock, and
    # 'graph' on the CPU cannot be resolved at all (the worker reports that error).
    assert not SubprocessExecutor(Isolation("subprocess"), None, "auto", cpu).sizes_samples
    assert not SubprocessExecutor(Isolation("subprocess"), None, "graph", cpu).sizes_samples


# --- resolve_timer -----------------------------------------------------------------------------


def test_resolve_timer_cpu_choices():
    assert isinstance(resolve_timer("auto", torch.device("cpu")), WallClockTimer)
    assert isinstance(resolve_timer("wallclock", "cpu"), WallClockTimer)
    assert isinstance(resolve_timer("auto", None), WallClockTimer)
    assert resolve_timer("wallclock", "cpu").sync is None


@pytest.mark.parametrize("mode", ["graph", "events"])
def test_resolve_timer_cuda_modes_on_cpu_inputs_raise(mode):
    with pytest.raises(ConfigError, match="wallclock"):
        resolve_timer(mode, torch.device("cpu"))


@pytest.mark.parametrize("mode", ["fastest", "", "GRAPH", None, 3])
def test_resolve_timer_unknown_mode(mode):
    with pytest.raises(ConfigError, match="unknown timing mode"):
        resolve_timer(mode, torch.device("cpu"))


@needs_no_cuda
@pytest.mark.parametrize("mode", ["auto", "graph", "events", "wallclock"])
def test_resolve_timer_cuda_device_without_cuda(mode):
    with pytest.raises(ConfigError, match="is_available"):
        resolve_timer(mode, torch.device("cuda"))


def test_resolve_timer_cuda_choices(monkeypatch):
    # Constructing timers touches no CUDA API, so the CUDA branch is checkable on CPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda", 0)
    assert isinstance(resolve_timer("auto", cuda), GraphTimer)
    assert isinstance(resolve_timer("graph", "cuda:0"), GraphTimer)
    assert isinstance(resolve_timer("events", cuda), EventTimer)
    wall = resolve_timer("wallclock", cuda)
    assert isinstance(wall, WallClockTimer) and wall.sync is not None
    assert resolve_timer("graph", cuda).device == cuda


# --- GPU timers without CUDA -------------------------------------------------------------------


@needs_no_cuda
@pytest.mark.parametrize("timer", [GraphTimer(), EventTimer(), EventTimer(delay=False)])
def test_gpu_timers_raise_clearly_without_cuda(timer):
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        timer.measure(lambda i: None, warmup=1, repeat=1)


@pytest.mark.parametrize("cls", [GraphTimer, EventTimer])
def test_gpu_timers_reject_cpu_device(cls):
    with pytest.raises(ConfigError, match="wallclock"):
        cls(device="cpu").measure(lambda i: None, warmup=1, repeat=1)


def test_gpu_timer_constructor_validation():
    with pytest.raises(ConfigError):
        GraphTimer(replays=0)
    with pytest.raises(ConfigError):
        GraphTimer(probe_replays=0)
    with pytest.raises(ConfigError):
        GraphTimer(min_replay_us=0)
    with pytest.raises(ConfigError):
        GraphTimer(min_piece_us=0)
    with pytest.raises(ConfigError):
        GraphTimer(min_calls=0)
    with pytest.raises(ConfigError):
        GraphTimer(capture_error_mode="loose")
    with pytest.raises(ConfigError):
        EventTimer(samples=0)
    with pytest.raises(ConfigError):
        EventTimer(margin=0.5)


def test_capture_error_is_a_runtime_error():
    # The tuner catches failing tactics as exceptions; CaptureError keeps RuntimeError semantics.
    assert issubclass(CaptureError, RuntimeError)


# --- sizing helpers ----------------------------------------------------------------------------


def test_delay_sizing():
    assert delay_us_for_host_time(0.0) == 20.0
    assert delay_us_for_host_time(100.0) == pytest.approx(170.0)
    assert delay_us_for_host_time(100.0, margin=2.0, floor_us=0.0) == 200.0
    assert delay_us_for_host_time(1e9, cap_us=5_000.0) == 5_000.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            delay_us_for_host_time(bad)
    with pytest.raises(ValueError):
        delay_us_for_host_time(1.0, margin=0.9)


@given(host_us=st.floats(min_value=0, max_value=1e5, allow_nan=False))
def test_delay_always_covers_host_time_below_cap(host_us):
    assert delay_us_for_host_time(host_us, cap_us=1e9) > host_us


def test_auto_repeat_calls():
    # 10 calls of 1 µs -> 10 µs replay: scale to 100 µs with 10% headroom.
    assert auto_repeat_calls(10, 10.0, min_replay_us=100.0, max_repeat=1024) == 110
    assert auto_repeat_calls(10, 150.0, min_replay_us=100.0, max_repeat=1024) == 10
    assert auto_repeat_calls(10, 0.5, min_replay_us=100.0, max_repeat=64) == 64
    assert auto_repeat_calls(2048, 1.0, min_replay_us=100.0, max_repeat=1024) == 2048


@given(
    calls=st.integers(min_value=1, max_value=512),
    per_call_us=st.floats(min_value=0.01, max_value=5_000),
)
def test_auto_repeat_reaches_target_or_cap(calls, per_call_us):
    wanted = auto_repeat_calls(calls, calls * per_call_us, min_replay_us=100.0, max_repeat=1024)
    assert wanted >= calls
    assert wanted == 1024 or wanted * per_call_us >= 100.0 - 1e-6


# --- cold L2 -----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    bytes_per_set=st.integers(min_value=8 * 1024, max_value=8 * 1024**3),
    l2=st.integers(min_value=256 * 1024, max_value=256 * MIB),
)
def test_cold_l2_copies_exceed_l2(bytes_per_set, l2):
    if math.ceil(2 * l2 / bytes_per_set) > cold_l2_module.DEFAULT_MAX_COPIES:
        return  # tiny sets hit the documented cap; tested separately
    copies = cold_l2_copies(bytes_per_set, "cpu", l2_bytes=l2, max_total_bytes=1 << 62)
    assert copies >= 2
    assert copies * bytes_per_set > l2
    assert copies * bytes_per_set >= 2 * l2
    # Between two uses of one copy, the other copies touch at least one L2 size.
    assert (copies - 1) * bytes_per_set >= l2
    # And it is the smallest such count (no waste beyond the factor).
    assert copies == 2 or (copies - 1) * bytes_per_set < 2 * l2


def test_cold_l2_copies_examples():
    h200_l2 = 60 * MIB
    assert cold_l2_copies(32 * MIB, "cpu", l2_bytes=h200_l2) == 4
    assert cold_l2_copies(1024 * MIB, "cpu", l2_bytes=h200_l2, max_total_bytes=1 << 40) == 2
    assert cold_l2_copies(1 * MIB, "cpu", l2_bytes=h200_l2) == 120


def test_cold_l2_copies_cap_warns(caplog):
    with caplog.at_level(logging.WARNING):
        copies = cold_l2_copies(1000, "cpu", l2_bytes=50 * MIB, max_copies=256)
    assert copies == 256
    assert "capping at 256 copies" in caplog.text


def test_cold_l2_copies_memory_limit():
    with pytest.raises(ConfigError, match="turn cold_l2 off"):
        cold_l2_copies(3 * 1024**3, "cpu", l2_bytes=50 * MIB, max_total_bytes=4 * 1024**3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bytes_per_input_set": 0},
        {"bytes_per_input_set": -5},
        {"bytes_per_input_set": 1.5},
        {"bytes_per_input_set": 1024, "factor": 1.0},
        {"bytes_per_input_set": 1024, "min_copies": 1},
        {"bytes_per_input_set": 1024, "l2_bytes": 0},
    ],
)
def test_cold_l2_copies_bad_arguments(kwargs):
    with pytest.raises(ConfigError):
        cold_l2_copies(device="cpu", **kwargs)


def test_l2_cache_bytes_cpu_is_sensible():
    size = l2_cache_bytes(torch.device("cpu"))
    assert 256 * 1024 <= size <= 4 * 1024**3


def test_cpu_cache_from_sysfs(tmp_path):
    for name, level, kind, size in [
        ("index0", 1, "Data", "48K"),
        ("index1", 1, "Instruction", "32K"),
        ("index2", 2, "Unified", "2048K"),
        ("index3", 3, "Unified", "105M"),
    ]:
        entry = tmp_path / name
        entry.mkdir()
        (entry / "level").write_text(f"{level}\n")
        (entry / "type").write_text(f"{kind}\n")
        (entry / "size").write_text(f"{size}\n")
    assert cold_l2_module._cpu_cache_bytes(tmp_path) == 105 * MIB
    assert cold_l2_module._cpu_cache_bytes(tmp_path / "missing") == (
        cold_l2_module.CPU_CACHE_FALLBACK_BYTES
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [("32768K", 32 * MIB), ("1M", MIB), ("512", 512), ("", None), ("abcK", None), ("0K", None)],
)
def test_parse_cache_size(text, expected):
    assert cold_l2_module.parse_cache_size(text) == expected


def test_l2_cache_bytes_reads_device_properties(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index: SimpleNamespace(name="Fake H200", L2_cache_size=60 * MIB, total_memory=1),
    )
    assert l2_cache_bytes(torch.device("cuda", 0)) == 60 * MIB
    assert l2_cache_bytes(1) == 60 * MIB


def test_l2_cache_bytes_fallback_without_attribute(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: SimpleNamespace(name="Old torch")
    )
    monkeypatch.setattr(cold_l2_module, "_warned", set())
    with caplog.at_level(logging.WARNING):
        assert l2_cache_bytes("cuda:3") == cold_l2_module.CUDA_L2_FALLBACK_BYTES
    assert "L2_cache_size" in caplog.text


@needs_no_cuda
def test_l2_cache_bytes_cuda_without_cuda():
    with pytest.raises(ConfigError):
        l2_cache_bytes(torch.device("cuda"))


def test_input_set_bytes_and_rotation():
    a = torch.randn(4, 8)  # 128 bytes
    b = torch.randn(16, dtype=torch.float64)  # 128 bytes
    assert input_set_bytes((a, {"b": b, "again": a}, [3, "x"])) == 256
    sets = [(torch.full((2,), float(k)),) for k in range(3)]
    fn = rotating(lambda inputs: inputs[0][0].item(), sets)
    assert [fn(i) for i in range(7)] == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 0.0]
    with pytest.raises(ConfigError):
        rotating(lambda inputs: None, [])


def test_module_exports_contract():
    for name in (
        "Measurement",
        "Timer",
        "GraphTimer",
        "EventTimer",
        "WallClockTimer",
        "resolve_timer",
        "l2_cache_bytes",
        "cold_l2_copies",
    ):
        assert hasattr(timing, name), name


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


def test_replay_plan_replays_a_long_call_alone():
    from graphtune.autotuner.timing.sizing import Step

    plan = _plan()
    assert _drive(plan, per_call_us=800.0) == [Step.CAPTURE, None] and plan.total == 1
    plan = _plan(estimate_us=790.0)  # warm-up already showed a long call: no 3-call capture
    assert plan.calls == 1 and _drive(plan, per_call_us=800.0) == [None]
    plan = _plan(repeat=2, estimate_us=790.0)  # the caller's cold-L2 walk stays whole
    assert plan.calls == 2 and _drive(plan, per_call_us=800.0) == [None]


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
