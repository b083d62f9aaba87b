"""Serving switches on CPU: freeze(), padding off, CapturePolicy validation; and the simulated
backend's fidelity (replays run the recorded ops, not the step's Python)."""

from __future__ import annotations

import logging

import pytest
import torch

from graphtune.errors import CaptureError, ConfigError, InputError
from graphtune.graphs import (
    CapturePolicy,
    CUDAGraphRunner,
    EagerRunner,
    FallbackReason,
    SimulatedGraphBackend,
)
from graphtune.graphs.policy import GraphState, Route, decide


def double(x):
    return x * 2


def make(**kwargs):
    backend = SimulatedGraphBackend()
    kwargs.setdefault("max_batch_size", 8)
    return CUDAGraphRunner(double, backend=backend, **kwargs), backend


def test_freeze_with_fallback_runs_new_sizes_eagerly_and_keeps_replaying_captured_ones(caplog):
    runner, backend = make(lazy=True)
    runner(torch.ones(3, 2))  # the key's warm-up, eagerly
    runner(torch.ones(3, 2))  # lazy capture of size 4
    runner.freeze()
    assert runner.frozen
    assert torch.equal(runner(torch.ones(7, 2)), torch.full((7, 2), 2.0))  # would capture 8
    assert torch.equal(runner(torch.ones(4, 2)), torch.full((4, 2), 2.0))  # replays 4
    assert runner.stats.fallbacks == {FallbackReason.WARMING_UP: 1, FallbackReason.FROZEN: 1}
    assert runner.stats.replays == 2 and backend.captures == 1
    with caplog.at_level(logging.WARNING, logger="graphtune.graphs"):
        runner.capture(torch.ones(8, 2))
    assert backend.captures == 1 and any("frozen" in r.getMessage() for r in caplog.records)
    runner.unfreeze()
    runner(torch.ones(7, 2))
    assert backend.captures == 2 and runner.captured_keys == [(None, 4), (None, 8)]


def test_freeze_with_raise_refuses_every_capture():
    runner, backend = make(lazy=True, policy=CapturePolicy(when_frozen="raise"))
    runner(torch.ones(1, 2))  # the key's warm-up
    runner(torch.ones(1, 2))  # captures size 1
    runner.freeze()
    with pytest.raises(CaptureError, match=r"a call of batch 5 \(size 8\) would capture"):
        runner(torch.ones(5, 2))
    with pytest.raises(CaptureError, match="freeze"):
        runner.capture(torch.ones(8, 2))
    # Frozen, the captured size still replays, on new values.
    assert torch.equal(runner(torch.full((1, 2), 3.0)), torch.full((1, 2), 6.0))
    assert runner.stats.replays == 2 and backend.captures == 1
    runner.release()  # release works while frozen; the runner stays frozen
    with pytest.raises(CaptureError):
        runner.capture(torch.ones(8, 2))


def test_eager_runner_has_the_same_serving_interface():
    runner = EagerRunner(double)
    runner.freeze()
    assert runner.frozen and torch.equal(runner(torch.ones(2)), torch.full((2,), 2.0))
    runner.unfreeze()
    assert not runner.frozen


def test_padding_off_uses_graphs_only_for_exact_sizes():
    runner, _ = make(capture_sizes=[1, 2, 4, 8], policy=CapturePolicy(padding=False))
    runner.capture(torch.ones(8, 2))
    for n in (1, 3, 4, 5, 8):
        assert torch.equal(runner(torch.ones(n, 2)), torch.full((n, 2), 2.0))
    assert runner.stats.replays == 3 and runner.stats.padded_rows == 13
    assert runner.stats.fallbacks == {FallbackReason.SIZE_NOT_CAPTURED: 2}
    assert runner.padded_inputs(torch.ones(4, 2))[1:] == (4, 4)
    with pytest.raises(InputError, match="padding is off"):
        runner.padded_inputs(torch.ones(3, 2))


def test_padding_off_with_lazy_capture_captures_only_exact_sizes():
    runner, backend = make(lazy=True, policy=CapturePolicy(padding=False))
    runner(torch.ones(3, 2))
    runner(torch.ones(4, 2))  # the key's warm-up
    runner(torch.ones(4, 2))  # captures size 4
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(runner(x), x * 2)  # the graph of 4, replayed on new values
    assert runner.captured_keys == [(None, 4)] and backend.captures == 1
    assert runner.stats.fallbacks == {
        FallbackReason.SIZE_NOT_CAPTURED: 1,
        FallbackReason.WARMING_UP: 1,
    }


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(when_frozen="crash"), "when_frozen"),
        (dict(padding="no"), "padding"),
        (dict(share_output_memory=1), "share_output_memory"),
        (dict(warm_each_size="yes"), "warm_each_size"),
    ],
)
def test_capture_policy_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CapturePolicy(**kwargs)


def test_policy_argument_must_be_a_capture_policy():
    with pytest.raises(ConfigError, match="CapturePolicy"):
        CUDAGraphRunner(double, max_batch_size=4, policy={"padding": False})


def test_new_fallback_reasons_are_their_own_log_text():
    assert str(FallbackReason.FROZEN) == "frozen (capture refused)"
    assert str(FallbackReason.SIZE_NOT_CAPTURED) == "size not captured (padding off)"


BASE = dict(static_reason=None, capturing=False, refused=False, has_plan=True, batch=3)


@pytest.mark.parametrize(
    "changes, expected",
    [
        (dict(lazy=True, frozen=True), FallbackReason.FROZEN),
        (dict(lazy=False, frozen=True), FallbackReason.KEY_NOT_CAPTURED),
        (dict(lazy=True, frozen=True, size_captured=False), FallbackReason.SIZE_NOT_CAPTURED),
        (dict(lazy=True, batch=9, size_captured=False), FallbackReason.BATCH_TOO_LARGE),
        (
            dict(lazy=True, graph_state=GraphState.FAILED, frozen=True),
            FallbackReason.CAPTURE_FAILED,
        ),
        (dict(lazy=True, graph_state=GraphState.CAPTURED, frozen=True), Route.REPLAY),
    ],
)
def test_decide_serving_rules(changes, expected):
    args = {**BASE, "largest_size": 8, "lazy": False, "graph_state": GraphState.MISSING}
    args.update(changes)
    assert decide(**args) == expected


def test_simulated_replay_runs_the_recorded_ops_not_the_python():
    calls = []
    scale = {"value": 2.0}

    def step(x):
        calls.append(x.shape[0])
        return x * scale["value"]  # a Python float is baked into the graph, as on a GPU

    runner = CUDAGraphRunner(step, max_batch_size=2, backend=SimulatedGraphBackend(), warmup=0)
    runner.capture(torch.ones(2, 1))
    captured = list(calls)
    scale["value"] = 5.0
    # New input values: the recorded multiply runs again on them (a replay that re-ran nothing
    # would return the capture's 2.0), with the scale baked in at capture time (not 5.0).
    assert torch.equal(runner(torch.full((2, 1), 3.0)), torch.full((2, 1), 6.0))
    assert calls == captured and runner.stats.replays == 1


def test_simulated_capture_fails_on_a_host_sync_like_cuda():
    def step(x):
        return x * float(x.sum())

    runner = CUDAGraphRunner(step, max_batch_size=2, backend=SimulatedGraphBackend(), warmup=0)
    runner.capture(torch.ones(2, 1))
    assert len(runner.stats.failed_captures) == 2
    assert "host synchronisation" in runner.stats.failed_captures[0].error


def test_warm_each_size_runs_one_eager_call_before_each_smaller_capture():
    seen = []

    def step(x):
        seen.append(x.shape[0])
        return x * 2

    backend = SimulatedGraphBackend()
    policy = CapturePolicy(warm_each_size=True)
    runner = CUDAGraphRunner(step, max_batch_size=8, warmup=2, backend=backend, policy=policy)
    runner.capture(torch.ones(8, 2))
    # Two warm-up calls at 8, its capture; then per smaller size one warm-up call and a capture.
    assert seen == [8, 8, 8, 4, 4, 2, 2, 1, 1]
    assert backend.warmup_runs == 2 + 3 and backend.captures == 4
    warmups = {r.size: r.warmup_seconds for r in runner.stats.records}
    assert all(seconds > 0 for seconds in warmups.values())
    assert runner.stats.warmup_seconds == pytest.approx(sum(warmups.values()))
    got = runner(torch.full((3, 2), 5.0))
    assert torch.equal(got, torch.full((3, 2), 10.0))


def test_warm_each_size_respects_warmup_zero():
    backend = SimulatedGraphBackend()
    policy = CapturePolicy(warm_each_size=True)
    runner = CUDAGraphRunner(double, max_batch_size=8, warmup=0, backend=backend, policy=policy)
    runner.capture(torch.ones(8, 2))
    assert backend.warmup_runs == 0 and backend.captures == 4
