"""Graph breaks on CPU: the simulated backend records each piece's ATen ops and replays them, so a
break's eager region, the pieces around it and their static buffers behave as on a GPU."""

from __future__ import annotations

import pytest
import torch

from graphtune.errors import InputError
from graphtune.graphs import (
    CUDAGraphRunner,
    FallbackReason,
    SimulatedGraphBackend,
    graph_break,
)
from graphtune.graphs.breaks import PiecewiseGraph
from graphtune.graphs.keys import typed_key

HIDDEN = 5
SLOTS = 20
PAD_SLOT = SLOTS - 1
LAYERS = 2


class BrokenStep:
    """Two layers; the attention-like part reads host state and syncs, so it must be a break."""

    def __init__(self, use_break: bool = True) -> None:
        gen = torch.Generator().manual_seed(3)
        self.w = [torch.randn(HIDDEN, HIDDEN, generator=gen) for _ in range(LAYERS)]
        self.cache = torch.zeros(LAYERS, SLOTS, HIDDEN)
        self.scale = 1.0  # host-side state: read by the break on every call
        self.use_break = use_break
        self.break_calls = 0

    def attend(self, q: torch.Tensor, layer: int, slot: torch.Tensor) -> torch.Tensor:
        self.break_calls += 1
        keys = self.cache[layer][slot]
        scores = (q * keys).sum(-1, keepdim=True) * self.scale
        if bool(torch.isnan(scores).any()):  # a host sync: cannot be captured
            raise ValueError("NaN scores")
        return torch.tanh(scores) * q

    def __call__(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        for layer, w in enumerate(self.w):
            q = x @ w
            self.cache[layer].index_copy_(0, slot, q)
            if self.use_break:
                a = graph_break(self.attend, q, layer, slot)
            else:
                a = self.attend(q, layer, slot)
            x = x + a
        return x


def inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + seed + n)
    return torch.randn(n, HIDDEN, generator=gen), torch.randperm(PAD_SLOT, generator=gen)[:n]


def make(step: BrokenStep | None = None, **kwargs) -> tuple[CUDAGraphRunner, BrokenStep]:
    step = step or BrokenStep()
    kwargs.setdefault("max_batch_size", 8)
    kwargs.setdefault("backend", SimulatedGraphBackend())
    runner = CUDAGraphRunner(step, pad={"1": PAD_SLOT}, **kwargs)
    return runner, step


def eager_padded(runner: CUDAGraphRunner, step: BrokenStep, x, slot) -> torch.Tensor:
    """Eager step on the inputs padded as the graph sees them, on a copy of the cache."""
    padded, n, _ = runner.padded_inputs(x, slot)
    ref = BrokenStep()
    ref.cache = step.cache.clone()
    ref.scale = step.scale
    return ref(*padded)[:n]


def test_without_break_the_host_sync_fails_capture_and_every_size_runs_eagerly():
    runner, _ = make(BrokenStep(use_break=False))
    runner.capture(*inputs(8))
    assert runner.stats.graphs == 0 and len(runner.stats.failed_captures) == 4
    assert "host synchronisation" in runner.stats.failed_captures[0].error
    assert "graph_break" in runner.stats.failed_captures[0].error  # the remedy is named
    runner(*inputs(3))
    assert runner.stats.fallbacks == {FallbackReason.CAPTURE_FAILED: 1}


def test_breaks_split_capture_into_pieces_and_replay_equals_eager_at_every_size():
    runner, step = make()
    runner.capture(*inputs(8))
    assert runner.stats.graphs == 4 and not runner.stats.failed_captures
    for record in runner.stats.records:
        assert (record.pieces, record.breaks) == (LAYERS + 1, LAYERS)
    for n in (1, 2, 3, 4, 5, 7, 8):
        x, slot = inputs(n, seed=n)
        before = step.cache.clone()
        want = eager_padded(runner, step, x, slot)
        step.cache.copy_(before)
        got = runner(x, slot)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert runner.stats.replays == 7 and runner.stats.eager_calls == 0
    assert runner.stats.break_runs == 7 * LAYERS and runner.stats.break_seconds > 0


def test_a_break_runs_python_at_replay_so_host_state_changes_take_effect():
    runner, step = make()
    runner.capture(*inputs(8))
    calls = step.break_calls
    x, slot = inputs(4, seed=9)
    first = runner(x, slot).clone()
    assert step.break_calls == calls + LAYERS  # the break ran again; the pieces were replayed
    step.scale = 3.0
    before = step.cache.clone()
    want = eager_padded(runner, step, x, slot)
    step.cache.copy_(before)
    got = runner(x, slot)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, first)


def test_no_break_is_one_piece_replayed_by_the_backend_graph_itself():
    def step(x):
        return torch.tanh(x) * 2

    runner = CUDAGraphRunner(step, max_batch_size=4, backend=SimulatedGraphBackend())
    runner.capture(torch.ones(4, 3))
    graph = runner._keys[None].graphs[4]
    assert not isinstance(graph.graph, PiecewiseGraph)
    assert graph.replay == graph.graph.replay
    assert {(r.pieces, r.breaks) for r in runner.stats.records} == {(1, 0)}


def test_graph_break_outside_a_capture_is_a_plain_call_in_both_forms():
    def double(x, *, by=2):
        return x * by

    wrapped = graph_break(double)
    assert wrapped.__name__ == "double"
    x = torch.arange(3.0)
    assert torch.equal(wrapped(x, by=3), x * 3)
    assert torch.equal(graph_break(double, x), x * 2)
    assert graph_break(lambda: 7)() == 7


def test_decorated_break_keyword_arguments_and_a_break_with_no_arguments():
    calls = []

    @graph_break
    def scaled(x, *, by):
        return x * by

    def counter():
        calls.append(1)
        return None

    def step(x):
        y = scaled(x + 1, by=3.0)
        graph_break(counter)()
        return y - 1

    backend = SimulatedGraphBackend()
    runner = CUDAGraphRunner(step, max_batch_size=4, backend=backend, warmup=0)
    runner.capture(torch.zeros(4, 2))
    assert {(r.pieces, r.breaks) for r in runner.stats.records} == {(3, 2)}
    before = len(calls)
    x = torch.randn(3, 2)
    torch.testing.assert_close(runner(x), (x + 1) * 3 - 1, rtol=0, atol=0)
    assert len(calls) == before + 1


def test_a_break_inside_a_break_runs_inline():
    def inner(x):
        return x + 1

    def outer(x):
        return graph_break(inner, x) * 2

    def step(x):
        return graph_break(outer, x * 3)

    runner = CUDAGraphRunner(step, max_batch_size=2, backend=SimulatedGraphBackend())
    runner.capture(torch.ones(2, 2))
    assert {r.breaks for r in runner.stats.records} == {1}
    x = torch.randn(2, 2)
    torch.testing.assert_close(runner(x), (x * 3 + 1) * 2, rtol=0, atol=0)


def test_break_outputs_share_one_static_buffer_per_output_across_sizes():
    runner, _ = make()
    runner.capture(*inputs(8))
    key = runner._keys[None]
    statics = {
        size: [brk.copies[0][1] for brk in key.graphs[size].graph.breaks]
        for size in runner.capture_sizes
    }
    for layer in range(LAYERS):
        base = statics[8][layer].data_ptr()
        assert all(statics[s][layer].data_ptr() == base for s in (1, 2, 4))
    expected = LAYERS * 8 * HIDDEN * 4 + key.inputs.nbytes
    assert runner.stats.buffer_bytes == expected


def test_a_non_contiguous_break_output_keeps_its_strides():
    seen = []

    def transposed(x):
        return x.t().contiguous().t()  # column-major: same values, other strides

    def step(x):
        y = graph_break(transposed, x * 2)
        seen.append((y.stride(), transposed(x).stride()))
        return y + 1

    runner = CUDAGraphRunner(step, max_batch_size=4, backend=SimulatedGraphBackend(), warmup=0)
    runner.capture(torch.ones(4, 3))
    assert len(seen) == 3 and all(static == eager for static, eager in seen)
    assert seen[0][0] == (1, 4)  # size 4: column-major, not the shared row-major buffer
    key = runner._keys[None]
    own = [brk.own_bytes for g in key.graphs.values() for brk in g.graph.breaks]
    assert own == [4 * 3 * 4, 2 * 3 * 4, 0]  # size 1 is contiguous both ways: the shared buffer
    assert runner.stats.buffer_bytes == key.inputs.nbytes + key.breaks.nbytes + sum(own)
    x = torch.randn(3, 3)
    torch.testing.assert_close(runner(x), x * 2 + 1, rtol=0, atol=0)


def test_a_break_whose_result_changes_shape_at_replay_is_an_input_error():
    state = {"rows": None}

    def head(x):
        return x if state["rows"] is None else x[: state["rows"]]

    def step(x):
        return graph_break(head, x) * 2

    runner = CUDAGraphRunner(step, max_batch_size=4, backend=SimulatedGraphBackend())
    runner.capture(torch.ones(4, 2))
    runner(torch.ones(4, 2))
    state["rows"] = 1
    with pytest.raises(InputError, match=r"graph break .*head returned a tensor of shape \(1, 2\)"):
        runner(torch.ones(4, 2))


def test_a_piece_that_cannot_be_captured_fails_only_its_size():
    def sync_if_big(x):
        y = x * 2
        if x.shape[0] == 4:
            y = y + float(y.sum())  # host sync in a *piece*, not in the break
        return y

    def step(x):
        return sync_if_big(graph_break(torch.tanh, x))

    backend = SimulatedGraphBackend()
    runner = CUDAGraphRunner(step, max_batch_size=4, backend=backend)
    runner.capture(torch.ones(4, 2))
    assert [r.size for r in runner.stats.failed_captures] == [4]
    assert sorted(s for _, s in runner.captured_keys) == [1, 2]
    assert not backend.capturing
    x = torch.randn(3, 2)
    torch.testing.assert_close(runner(x), sync_if_big(torch.tanh(x)))
    assert runner.stats.fallbacks == {FallbackReason.CAPTURE_FAILED: 1}
    x = torch.randn(2, 2)
    torch.testing.assert_close(runner(x), torch.tanh(x) * 2, rtol=0, atol=0)


def test_a_failing_break_at_capture_is_a_failed_capture_for_that_size():
    def picky(x):
        if x.shape[0] == 2:
            raise ValueError("no")
        return x + 1

    def step(x):
        return graph_break(picky, x)

    runner = CUDAGraphRunner(step, max_batch_size=4, backend=SimulatedGraphBackend(), warmup=0)
    runner.capture(torch.ones(4, 2))
    assert [r.size for r in runner.stats.failed_captures] == [2]
    assert "ValueError: no" in runner.stats.failed_captures[0].error


def test_lazy_capture_with_breaks():
    runner, step = make(lazy=True)
    for n in (3, 8, 3):
        x, slot = inputs(n, seed=n)
        before = step.cache.clone()
        want = eager_padded(runner, step, x, slot) if runner._keys else None
        step.cache.copy_(before)
        got = runner(x, slot)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert runner.captured_keys == [(None, 4), (None, 8)]
    # The key's first call (3) was its warm-up, run eagerly; 8 and then 3 captured and replayed.
    assert runner.stats.replays == 2 and runner.stats.eager_calls == 1


def test_each_extra_key_has_its_own_breaks_and_buffers():
    def scale(x, by):
        return x * by

    def step(x, by):
        return graph_break(scale, x + 1, by) - 1

    runner = CUDAGraphRunner(
        step, max_batch_size=4, key_fn=lambda inputs: inputs[1], backend=SimulatedGraphBackend()
    )
    runner.capture(torch.zeros(4, 2), 2.0)
    runner.capture(torch.zeros(4, 2), 3.0)
    assert {(r.extra_key, r.breaks) for r in runner.stats.records} == {(2.0, 1), (3.0, 1)}
    first, second = (runner._keys[typed_key(by)].breaks for by in (2.0, 3.0))
    assert first is not second and first.nbytes == second.nbytes > 0
    x = torch.randn(3, 2)
    torch.testing.assert_close(runner(x, 2.0), (x + 1) * 2 - 1, rtol=0, atol=0)
    torch.testing.assert_close(runner(x, 3.0), (x + 1) * 3 - 1, rtol=0, atol=0)
