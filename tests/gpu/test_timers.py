"""GPU tests of the timers against CUPTI kernel time (skipped without CUDA by conftest.py)."""

from __future__ import annotations

import pytest
import torch

from graphtune import bench
from graphtune.autotuner.timing import (
    EventTimer,
    GpuDelay,
    GraphTimer,
    WallClockTimer,
    cold_l2_copies,
    input_set_bytes,
    l2_cache_bytes,
    resolve_timer,
    rotating,
)
from graphtune.errors import CaptureError


@pytest.fixture(scope="module")
def common():
    """The measurement toolkit (its CUPTI kernel time is the truth these tests compare with)."""
    return bench


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda", torch.cuda.current_device())


def _gemm(device, m, n, k):
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16) / k**0.5
    return lambda i: torch.mm(a, b)


@pytest.mark.parametrize("timer_cls", [GraphTimer, EventTimer])
def test_large_gemm_matches_cupti(device, common, timer_cls):
    fn = _gemm(device, 4096, 4096, 4096)
    cupti = common.cupti_kernel_time(fn, calls=20, warmup=5).per_call_us
    measured = timer_cls(device=device).measure(fn, warmup=3, repeat=10)
    ratio = measured.median_us / cupti
    assert 0.9 <= ratio <= 1.15, f"{timer_cls.name}: {measured.median_us:.1f} vs {cupti:.1f} us"


@pytest.mark.parametrize("timer_cls", [GraphTimer, EventTimer])
def test_small_gemm_is_not_launch_bound(device, common, timer_cls):
    # 16x4096x4096 (~9 us on an H200): plain event timing reads it about 2x.
    fn = _gemm(device, 16, 4096, 4096)
    cupti = common.cupti_kernel_time(fn, calls=50, warmup=5).per_call_us
    measured = timer_cls(device=device).measure(fn, warmup=3, repeat=10)
    ratio = measured.median_us / cupti
    assert 0.9 <= ratio <= 1.25, f"{timer_cls.name}: {measured.median_us:.2f} vs {cupti:.2f} us"


def test_graph_timer_beats_launch_bound_events_for_tiny_kernel(device):
    x = torch.randn(4, 256, device=device)
    fn = lambda i: torch.nn.functional.layer_norm(x, (256,))  # noqa: E731 - a few-µs kernel
    graph = GraphTimer(device=device).measure(fn, warmup=3, repeat=20)
    naive = EventTimer(delay=False, device=device).measure(fn, warmup=3, repeat=20)
    assert graph.median_us < 0.5 * naive.median_us, (graph, naive)


def test_event_delay_hides_launch_cost_of_tiny_kernels(device):
    x = torch.randn(4, 256, device=device)
    fn = lambda i: torch.nn.functional.layer_norm(x, (256,))  # noqa: E731
    timer = EventTimer(device=device)
    delayed = timer.measure(fn, warmup=3, repeat=20)
    naive = EventTimer(delay=False, device=device).measure(fn, warmup=3, repeat=20)
    assert delayed.median_us < 0.7 * naive.median_us, (delayed, naive, timer.last_info)
    assert timer.last_info["uncovered_kept"] == 0


def test_graph_timer_auto_repeat_lengthens_short_replays(device):
    x = torch.randn(1024, device=device)
    timer = GraphTimer(device=device, min_replay_us=100.0)
    measured = timer.measure(lambda i: x.add(1.0), warmup=2, repeat=2)
    assert timer.last_calls is not None and timer.last_calls > 2
    assert measured.calls_per_sample == timer.last_calls
    # The recaptured replay reaches the target, give or take the probe's noise.
    assert measured.median_us * timer.last_calls >= 50.0
    fixed = GraphTimer(device=device, auto_repeat=False)
    assert fixed.measure(lambda i: x.add(1.0), warmup=2, repeat=2).calls_per_sample == 2


def test_graph_timer_capture_failure_is_clear_and_recoverable(device):
    x = torch.randn(1024, device=device)
    timer = GraphTimer(device=device)
    with pytest.raises(CaptureError, match="synchronize with the host"):
        timer.measure(lambda i: x.sum().item(), warmup=1, repeat=4)
    # The device and the timer still work afterwards.
    assert not torch.cuda.is_current_stream_capturing()
    ok = timer.measure(lambda i: x.mul(2.0), warmup=1, repeat=4)
    assert ok.median_us > 0


def test_graph_timer_releases_graph_memory(device):
    fn = _gemm(device, 1024, 1024, 1024)
    timer = GraphTimer(device=device, replays=3)
    timer.measure(fn, warmup=2, repeat=8)  # first use may allocate cuBLAS workspaces
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(device)
    for _ in range(3):
        timer.measure(fn, warmup=2, repeat=8)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(device) <= baseline + 1024 * 1024


def test_graph_timer_refuses_nested_capture(device):
    x = torch.randn(16, device=device)
    timer = GraphTimer(device=device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add(1.0)
    torch.cuda.synchronize()
    with pytest.raises(CaptureError, match="nested"):
        with torch.cuda.graph(graph, stream=stream):
            timer.measure(lambda i: x.add(1.0), warmup=1, repeat=1)
    graph.reset()


def test_gpu_delay_is_calibrated(device):
    delay = GpuDelay(device)
    rate = delay.cycles_per_us()
    assert 200.0 <= rate <= 5_000.0  # MHz of the SM clock
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    delay.enqueue(50.0)  # lead, so the host's launch of the timed spin is hidden
    start.record()
    delay.enqueue(500.0)
    end.record()
    end.synchronize()
    spent_us = start.elapsed_time(end) * 1000.0
    assert 350.0 <= spent_us <= 900.0


def test_wallclock_with_sync_times_gpu_work(device, common):
    fn = _gemm(device, 4096, 4096, 4096)
    cupti = common.cupti_kernel_time(fn, calls=10, warmup=3).per_call_us
    wall = WallClockTimer(sync=torch.cuda.synchronize).measure(fn, warmup=3, repeat=10)
    assert 0.9 <= wall.median_us / cupti <= 1.5


def test_resolve_timer_on_cuda(device):
    assert isinstance(resolve_timer("auto", device), GraphTimer)
    assert isinstance(resolve_timer("events", device), EventTimer)


def test_cold_l2_rotation_exceeds_l2(device):
    l2 = l2_cache_bytes(device)
    reported = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)
    if reported:
        assert l2 == reported
    for m, n, k in [(16, 4096, 4096), (256, 1024, 1024), (16, 256, 256), (4096, 4096, 4096)]:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        size = input_set_bytes((a, b))
        copies = cold_l2_copies(size, device)
        sets = [(a.clone(), b.clone()) for _ in range(copies)]
        total = sum(input_set_bytes(s) for s in sets)
        assert total > l2, (m, n, k, copies, total, l2)
        assert total >= 2 * l2 or copies == 2
        del sets
    torch.cuda.empty_cache()


def test_cold_l2_rotation_reads_slower_than_hot(device):
    # A read-only reduction over 16 MiB fits in L2 when repeated, and misses it when rotated.
    x = torch.randn(8 * 1024 * 1024, device=device, dtype=torch.bfloat16)
    copies = cold_l2_copies(input_set_bytes(x), device)
    sets = [x.clone() for _ in range(copies)]
    timer = GraphTimer(device=device)
    hot = timer.measure(lambda i: x.sum(), warmup=3, repeat=max(10, copies))
    cold = timer.measure(rotating(lambda t: t.sum(), sets), warmup=3, repeat=max(10, copies))
    assert cold.median_us > 1.05 * hot.median_us, (hot, cold, copies)


def test_repeated_graph_runs_every_copy(device):
    from graphtune.autotuner.timing.repeated import RepeatedGraph, cuda_runtime

    runtime = cuda_runtime()
    assert runtime is not None, "torch's libcudart should be usable on a CUDA machine"
    counter = torch.zeros(1, device=device)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        counter.add_(1.0)
    torch.cuda.synchronize()
    piece = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(stream):
        piece.capture_begin()
        for _ in range(3):
            counter.add_(1.0)
        piece.capture_end()
    repeated = RepeatedGraph(piece, 7, runtime)
    counter.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        repeated.replay()
        repeated.replay()
    torch.cuda.synchronize()
    assert float(counter) == 2 * 7 * 3
    repeated.reset()


@pytest.mark.parametrize("hidden", [256, 4096])
def test_graph_timer_pieces_time_like_direct_capture(device, common, hidden):
    # A short kernel whose long replay is built from repeated pieces: the same per-call time as
    # capturing every call, and both close to CUPTI's kernel time.
    x = torch.randn(4, hidden, device=device)
    fn = lambda i: torch.nn.functional.layer_norm(x, (hidden,))  # noqa: E731
    pieces = GraphTimer(device=device, replays=20)
    direct = GraphTimer(device=device, replays=20, repeat_pieces=False)
    a = [pieces.measure(fn, warmup=3, repeat=3).median_us for _ in range(3)]
    b = [direct.measure(fn, warmup=3, repeat=3).median_us for _ in range(3)]
    assert pieces.last_calls is not None and pieces.last_calls * min(a) >= 50.0
    ratio = sorted(a)[1] / sorted(b)[1]
    assert 0.97 <= ratio <= 1.03, (a, b)


def test_graph_timer_pieces_fall_back_without_runtime(device, monkeypatch):
    from graphtune.autotuner.timing import graph as graph_module

    monkeypatch.setattr(graph_module, "cuda_runtime", lambda: None)
    x = torch.randn(1024, device=device)
    timer = GraphTimer(device=device)
    measured = timer.measure(lambda i: x.add(1.0), warmup=2, repeat=2)
    assert timer.last_calls is not None and timer.last_calls > 2
    assert measured.median_us * timer.last_calls >= 50.0


@pytest.mark.parametrize("hidden", [256, 4096])
def test_a_sessions_first_measurement_from_its_probe_agrees_with_later_ones(device, hidden):
    # The first measurement is the last probe's replays; later ones replay the graph again.
    x = torch.randn(4, hidden, device=device)
    fn = lambda i: torch.nn.functional.layer_norm(x, (hidden,))  # noqa: E731
    timer = GraphTimer(device=device)
    with timer.open(fn, warmup=3, repeat=1) as session:
        first = session.measure()
        later = sorted(session.measure().median_us for _ in range(5))
    assert first.n == timer.probe_replays
    assert abs(first.median_us / later[2] - 1.0) < 0.05, (first, later)


def test_a_guess_sizes_the_first_capture_without_changing_the_time(device, monkeypatch):
    from graphtune.autotuner.timing import graph as graph_module

    captures: list[int] = []
    real = graph_module.capture_calls

    def counting(fn, counter, calls, *args, **kwargs):
        captures.append(calls)
        return real(fn, counter, calls, *args, **kwargs)

    monkeypatch.setattr(graph_module, "capture_calls", counting)
    x = torch.randn(4, 1024, device=device)
    fn = lambda i: torch.nn.functional.layer_norm(x, (1024,))  # noqa: E731
    timer = GraphTimer(device=device)
    plain = [timer.measure(fn, warmup=3, repeat=1).median_us for _ in range(3)]
    unguided = len(captures)
    guess = sorted(plain)[1]
    with timer.open(fn, warmup=3, repeat=1, hint_us=guess) as session:
        guessed = [session.measure(fresh=True).median_us for _ in range(3)]
    assert len(captures) - unguided == 1 and unguided >= 3 * 2  # one capture instead of two
    assert 0.97 <= sorted(guessed)[1] / guess <= 1.03, (plain, guessed)
