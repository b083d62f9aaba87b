"""A step whose own parameters require grad (simulated backend, CPU): with autograd on, its calls
run eagerly so that their outputs carry gradients; with autograd off they replay. Before, a
replay returned outputs with the capture's stale grad_fn, and backward() raised."""

from __future__ import annotations

import logging

import pytest
import torch

from graphtune.errors import CaptureError
from graphtune.graphs import (
    CUDAGraphRunner,
    FallbackReason,
    SimulatedGraphBackend,
    graph_break,
)


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR, logger="graphtune.graphs")


def make(lin: torch.nn.Module, **kwargs) -> CUDAGraphRunner:
    return CUDAGraphRunner(
        lin, max_batch_size=4, capture_sizes=[2, 4], backend=SimulatedGraphBackend(), **kwargs
    )


def grads_of(lin: torch.nn.Module, out: torch.Tensor) -> torch.Tensor:
    lin.zero_grad()
    out.square().sum().backward()
    assert lin.weight.grad is not None
    return lin.weight.grad.clone()


@pytest.mark.parametrize("rows", [3, 4])  # padded, and a captured size
def test_a_step_whose_parameters_require_grad_runs_eagerly_under_autograd(rows):
    lin = torch.nn.Linear(4, 3)
    runner = make(lin)
    runner.capture(torch.randn(4, 4))  # with autograd on: the capture shows the grad
    x = torch.randn(rows, 4)
    out = runner(x)
    assert torch.equal(grads_of(lin, out), grads_of(lin, lin(x)))  # backward() raised
    assert (
        runner.stats.fallbacks == {FallbackReason.OUTPUT_NEEDS_GRAD: 1}
        and runner.stats.replays == 0
    )
    with torch.no_grad():  # nothing to lose: a replay, and no stale autograd graph on it
        out = runner(x)
    assert runner.stats.replays == 1
    assert not out.requires_grad and out.grad_fn is None and torch.allclose(out, lin(x))


def test_a_key_captured_without_autograd_tells_on_its_first_call_with_it():
    lin = torch.nn.Linear(4, 3)
    runner = make(lin)
    with torch.no_grad():  # the capture cannot show whether outputs need grad
        runner.capture(torch.randn(4, 4))
    x = torch.randn(3, 4)
    out = runner(x)  # replayed with no gradients at all before
    assert torch.equal(grads_of(lin, out), grads_of(lin, lin(x)))
    lin.requires_grad_(False)  # frozen: the next eager call shows it, later calls replay
    for _ in range(3):
        assert torch.allclose(runner(x), lin(x))
    assert (
        runner.stats.fallbacks == {FallbackReason.OUTPUT_NEEDS_GRAD: 2}
        and runner.stats.replays == 2
    )


def test_a_lazy_key_learns_it_from_its_warm_up_call():
    lin = torch.nn.Linear(4, 3)
    runner = make(lin, lazy=True)
    x = torch.randn(3, 4)
    for _ in range(3):
        out = runner(x)
    assert torch.equal(grads_of(lin, out), grads_of(lin, lin(x)))
    assert runner.captured_keys == []  # a capture under autograd would serve no call
    assert runner.stats.fallbacks == {
        FallbackReason.WARMING_UP: 1,
        FallbackReason.OUTPUT_NEEDS_GRAD: 2,
    }
    with torch.no_grad():
        runner(x), runner(x)
    assert runner.captured_keys == [(None, 4)] and runner.stats.replays == 2


class Counting(torch.nn.Module):
    """A linear step that counts its runs in a tensor (state a second run would step twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.runs = torch.zeros(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs.add_(1)
        return self.lin(x)


def test_a_lazy_capture_that_shows_the_grad_runs_its_call_eagerly_once():
    step = Counting()
    runner = make(step, lazy=True, warmup=0)  # no warm-up call to tell before the capture
    x = torch.randn(3, 4)
    out = runner(x)
    assert step.runs.item() == 1  # the capture's run was undone: eager ran the call once
    assert torch.equal(grads_of(step.lin, out), grads_of(step.lin, step.lin(x)))
    assert runner.stats.fallbacks == {
        FallbackReason.OUTPUT_NEEDS_GRAD: 1
    } and runner.captured_keys == [(None, 4)]
    with torch.no_grad():
        assert torch.allclose(runner(x), step.lin(x))
    assert runner.stats.replays == 1 and step.runs.item() == 2


def test_a_lazy_capture_with_breaks_that_shows_the_grad_raises_instead_of_rerunning():
    lin = torch.nn.Linear(4, 4)

    def step(x):
        return lin(graph_break(torch.relu, lin(x)))

    runner = make(step, lazy=True, warmup=0)
    x = torch.randn(3, 4)
    with pytest.raises(CaptureError, match="outputs require grad .* piece"):
        runner(x)  # the piece before the break ran on its rows: no second eager run
    assert torch.equal(grads_of(lin, runner(x)), grads_of(lin, step(x)))
    assert runner.stats.fallbacks == {FallbackReason.OUTPUT_NEEDS_GRAD: 1}
