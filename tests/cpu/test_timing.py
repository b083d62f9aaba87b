"""CPU tests of the timers, timer resolution and cold-L2 sizing (fast; no GPU needed)."""

from __future__ import annotations

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


def test_the_timed_device_is_the_first_tensor_off_the_cpu():
    from graphtune.autotuner.resolved import device_of

    # Host-side lengths first, the work on another device ("meta" stands in for CUDA here): the
    # timer must follow the work, or a host clock times device work without waiting for it.
    lengths, work = torch.tensor([3, 5]), torch.empty(8, 16, device="meta")
    assert device_of([lengths, 2, work]) == torch.device("meta")
    assert device_of([lengths, None]) == torch.device("cpu")
    assert device_of([1.0]) == torch.device("cpu")


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


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: GraphTimer(min_replay_us=NAN), "min_replay_us"),
        (lambda: GraphTimer(min_replay_us=INF), "min_replay_us"),
        (lambda: GraphTimer(min_replay_us="100"), "min_replay_us"),
        (lambda: GraphTimer(min_piece_us=INF), "min_piece_us"),
        (lambda: GraphTimer(min_calls=2.5), "min_calls"),
        (lambda: GraphTimer(min_calls=True), "min_calls"),
        (lambda: GraphTimer(max_repeat=10.5), "max_repeat"),
        (lambda: GraphTimer(max_repeat=None), "max_repeat"),
        (lambda: EventTimer(margin=NAN), "margin"),
        (lambda: EventTimer(margin="2"), "margin"),
        (lambda: EventTimer(floor_us=NAN), "floor_us"),
        (lambda: EventTimer(max_delay_us=INF), "max_delay_us"),
        (lambda: EventTimer(max_retries=1.5), "max_retries"),
        (lambda: cold_l2_copies(MIB, "cpu", l2_bytes=MIB, factor="2"), "factor"),
        (lambda: cold_l2_copies(MIB, "cpu", l2_bytes=MIB, factor=NAN), "factor"),
        (lambda: cold_l2_copies(MIB, "cpu", l2_bytes=MIB, min_copies=2.5), "min_copies"),
        (lambda: cold_l2_copies(MIB, "cpu", l2_bytes=NAN), "l2_bytes"),
        # ints too large for a float: float() raised a bare OverflowError
        (lambda: GraphTimer(min_replay_us=10**400), "min_replay_us"),
        (lambda: GraphTimer(min_piece_us=-(10**400)), "min_piece_us"),
        (lambda: EventTimer(max_delay_us=10**400), "max_delay_us"),
        (lambda: cold_l2_copies(MIB, "cpu", l2_bytes=MIB, factor=10**400), "factor"),
        (lambda: cold_l2_copies(MIB, "cpu", l2_bytes=10**400), "l2_bytes"),
        (
            lambda: cold_l2_copies(MIB, "cpu", l2_bytes=MIB, max_total_bytes=10**400),
            "max_total_bytes",
        ),
        # an int past 4300 digits: its repr in the message raised ValueError
        (lambda: EventTimer(max_retries=-(10**5000)), "max_retries"),
    ],
)
def test_numeric_arguments_refused_in_one_line(make, name):
    # Non-finite µs values and non-int counts used to pass and fail later (after real captures)
    # with a bare TypeError/ValueError/OverflowError.
    with pytest.raises(ConfigError, match=f"{name} must be an? (integer|finite number)") as info:
        make()
    assert "\n" not in str(info.value) and "pass " in str(info.value)
    assert len(str(info.value)) < 200, "a huge int is given by its digit count, not printed"


def test_numeric_arguments_accept_ints_for_floats():
    assert GraphTimer(min_replay_us=100, min_piece_us=50).min_piece_us == 50
    assert EventTimer(margin=2, floor_us=0, max_retries=0).margin == 2
    assert cold_l2_copies(MIB, "cpu", l2_bytes=MIB, factor=3) == 3


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
