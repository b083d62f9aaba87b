"""Outputs of tuple and dict subclasses keep their type through capture, replay and breaks.

``torch.return_types`` (``torch.max(x, 1)``, ``topk``, ``sort``) are tuple subclasses built from
one sequence, unlike namedtuples; a dict subclass (an HF ``ModelOutput``-like class) keeps its
class and its attribute access.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import namedtuple

import pytest
import torch

from graphtune.graphs import (
    CapturePolicy,
    CUDAGraphRunner,
    RunnerState,
    SimulatedGraphBackend,
    graph_break,
)
from graphtune.graphs.tree import flatten_with_paths


def runner_for(fn, *, lazy=False, share=True):
    return CUDAGraphRunner(
        fn,
        max_batch_size=8,
        lazy=lazy,
        backend=SimulatedGraphBackend(),
        policy=CapturePolicy(share_output_memory=share),
    )


def top(x):
    return torch.max(x, dim=1)


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("lazy", [False, True])
def test_a_torch_return_type_output_round_trips(lazy, share):
    runner = runner_for(top, lazy=lazy, share=share)
    runner.capture(torch.randn(8, 4))
    gen = torch.Generator().manual_seed(0)
    for n in (3, 3, 8, 5, 5):  # lazy: a warm-up call, then a capture, then replays
        x = torch.randn(n, 4, generator=gen)
        out = runner(x)
        want = torch.max(x, dim=1)
        assert type(out) is type(want)
        assert torch.equal(out.values, want.values) and torch.equal(out.indices, want.indices)
    assert runner.state is RunnerState.CAPTURED
    assert runner.stats.records and all(r.ok for r in runner.stats.records)
    assert runner.stats.replays >= 2


def test_a_torch_return_type_from_a_graph_break_captures():
    def step(x):
        values, _ = graph_break(torch.topk, x, 2)
        return values * 2

    runner = runner_for(step)
    runner.capture(torch.randn(8, 4))
    assert [r.ok for r in runner.stats.records] == [True] * len(runner.capture_sizes)
    x = torch.randn(3, 4)
    assert torch.equal(runner(x), torch.topk(x, 2).values * 2)
    assert runner.stats.fallbacks == {} and runner.stats.replays == 1


class ModelOutput(dict):
    """Like HF's ModelOutput: a dict with attribute access."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@pytest.mark.parametrize("share", [True, False])
def test_a_dict_subclass_output_keeps_its_type(share):
    runner = runner_for(lambda x: ModelOutput(logits=x * 2, hidden=x + 1), share=share)
    runner.capture(torch.randn(8, 4))
    x = torch.randn(3, 4)
    out = runner(x)
    assert type(out) is ModelOutput
    assert torch.equal(out.logits, x * 2) and torch.equal(out.hidden, x + 1)
    assert runner.stats.replays == 1


class KeywordsOnly(dict):
    """A dict subclass built from keywords only (as a dataclass-based ModelOutput)."""

    def __init__(self, *, logits):
        super().__init__(logits=logits)


class Pair(tuple):
    """A tuple subclass whose constructor takes other arguments: rebuilt as a plain tuple."""

    def __new__(cls, a, b, c):
        return super().__new__(cls, (a, b))


def test_subclasses_are_rebuilt_with_their_type_or_as_plain_containers():
    point = namedtuple("Point", "x y")
    t = torch.ones(2)
    for value in (point(t, 1), torch.sort(t), KeywordsOnly(logits=t), [t, (t,)]):
        _, _, spec = flatten_with_paths(value)
        rebuilt = spec.unflatten(flatten_with_paths(value)[0])
        assert type(rebuilt) is type(value)
    _, _, spec = flatten_with_paths(Pair(t, 2, 3))
    assert spec.unflatten([t, 2]) == (t, 2)


def test_a_capture_whose_outputs_cannot_be_rebuilt_is_a_failed_record(caplog, monkeypatch):
    from graphtune.graphs import capture

    def broken(self, n, clone):
        raise TypeError("outputs cannot be rebuilt")

    monkeypatch.setattr(capture.StaticOutputs, "result", broken)
    runner = runner_for(top)
    with caplog.at_level(logging.WARNING, logger="graphtune.graphs"):
        runner.capture(torch.randn(8, 4))  # does not raise
    assert runner.stats.records and not any(r.ok for r in runner.stats.records)
    assert "outputs cannot be rebuilt" in runner.stats.records[0].error
    assert runner.captured_keys == []


@dataclasses.dataclass
class StepOut:
    logits: torch.Tensor
    note: str = "ok"


@dataclasses.dataclass
class Meta:
    note: str
    step: int


def dataclass_step(x):
    return StepOut(x @ W2)


W2 = torch.randn(4, 4)


@pytest.mark.parametrize(
    "kwargs", [dict(capture_sizes=[8]), dict(capture_sizes=[1, 2, 4, 8], lazy=True, warmup=0)]
)
def test_an_object_output_holding_tensors_runs_eagerly_instead_of_returning_padded_rows(kwargs):
    runner = CUDAGraphRunner(
        dataclass_step, max_batch_size=8, backend=SimulatedGraphBackend(), **kwargs
    )
    with torch.inference_mode():
        runner.capture(torch.randn(8, 4))  # does not raise: a failed capture, recorded
        x = torch.randn(5, 4)
        out = runner(x)
    assert out.logits.shape == (5, 4)  # was (8, 4): the padded rows of the one captured graph
    assert torch.equal(out.logits, x @ W2)
    assert runner.stats.replays == 0
    assert runner.stats.records and not any(r.ok for r in runner.stats.records)
    error = runner.stats.records[0].error
    assert "StepOut" in error and "'logits'" in error and "NamedTuple" in error


def test_an_object_output_without_tensors_is_returned_as_captured():
    def step(x):
        return x @ W2, Meta("plain", 3)

    runner = CUDAGraphRunner(
        step, max_batch_size=8, capture_sizes=[4, 8], backend=SimulatedGraphBackend()
    )
    with torch.inference_mode():
        runner.capture(torch.randn(8, 4))
        x = torch.randn(3, 4)
        out, meta = runner(x)
    assert torch.equal(out, x @ W2) and meta == Meta("plain", 3)
    assert runner.stats.replays == 1
