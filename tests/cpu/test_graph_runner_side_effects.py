"""A lazy capture the runner cannot use leaves the step's state as a CUDA capture would.

On CUDA a capture records kernels without running them, so when a lazy capture fails (or its
graph is dropped because its outputs cannot be sliced) the call's only computation is the eager
run that follows. The simulated capture computes while it records; the runner undoes what that
wrote, so a stateful step's state counts the same as on CUDA.
"""

from __future__ import annotations

import logging

import pytest
import torch

from graphtune.graphs import CUDAGraphRunner, FallbackReason, SimulatedGraphBackend


class Counter:
    """A stateful step: ``count`` is device state (a tensor), ``calls`` counts Python runs."""

    def __init__(self, out):
        self.count = torch.zeros(())
        self.calls = 0
        self.out = out

    def __call__(self, x):
        self.calls += 1
        self.count.add_(1)
        return self.out(x)


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR, logger="graphtune.graphs")


def test_a_dropped_lazy_capture_steps_the_state_once_as_on_cuda():
    # size+1 rows: cannot be sliced to a batch. (x[1:], size-1 rows, would be undecided at one
    # size, a cap or a constant, and its batch-3 call would run eagerly to tell, not capture.)
    step = Counter(lambda x: torch.cat([x, x[:1]]))
    runner = CUDAGraphRunner(
        step, max_batch_size=8, lazy=True, warmup=0, backend=SimulatedGraphBackend()
    )
    x8 = torch.randn(8, 2)
    assert torch.equal(runner(x8), torch.cat([x8, x8[:1]]))
    # CUDA, call 1 (batch 8): the capture runs fn's Python (calls 1) but no kernel, then the
    # graph is replayed once for this call (count 1).
    assert (step.calls, step.count.item()) == (1, 1.0)
    x3 = torch.randn(3, 2)
    assert torch.equal(runner(x3), torch.cat([x3, x3[:1]]))
    # CUDA, call 2 (batch 3, size 4): the capture runs fn's Python (calls 2) and no kernel; its
    # outputs cannot be sliced beside size 8's, so the key's graphs are dropped and fn runs
    # eagerly once (calls 3, count 2). The simulated capture's own step is undone.
    assert (step.calls, step.count.item()) == (3, 2.0)
    assert runner.stats.fallbacks == {FallbackReason.CAPTURE_FAILED: 1}
    runner(x3)  # later calls of the key run eagerly, once each
    assert (step.calls, step.count.item()) == (4, 3.0)


def test_a_failed_lazy_capture_steps_the_state_once_as_on_cuda():
    state = torch.zeros(4)

    def step(x):
        state.add_(1)  # written before the host sync fails the capture
        if x.sum().item() > 1e9:  # a host sync: fails under capture, fine eagerly
            return x
        return x * state[0]

    runner = CUDAGraphRunner(
        step, max_batch_size=4, lazy=True, warmup=0, backend=SimulatedGraphBackend()
    )
    x = torch.ones(3, 2)
    out = runner(x)
    # CUDA: the capture fails having run no kernel; the eager run steps the state once.
    assert torch.equal(state, torch.ones(4))
    assert torch.equal(out, x)
    assert runner.stats.fallbacks == {FallbackReason.CAPTURE_FAILED: 1}
    assert not runner.stats.records[0].ok


def test_a_kept_lazy_capture_is_this_calls_computation():
    step = Counter(lambda x: x * 2)
    runner = CUDAGraphRunner(
        step, max_batch_size=8, lazy=True, warmup=1, backend=SimulatedGraphBackend()
    )
    for n in (3, 3, 3):  # a warm-up call, a capturing call, a replay: one step each
        x = torch.randn(n, 2)
        assert torch.equal(runner(x), x * 2)
    assert step.count.item() == 3.0
