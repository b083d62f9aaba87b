"""The graph runner refuses what it cannot serve correctly: outputs that cannot be sliced to the
real batch (their key runs eagerly), pad values an input cannot hold, a backend or key of the
wrong kind (CPU, SimulatedGraphBackend)."""

from __future__ import annotations

import logging

import pytest
import torch
from test_graphs_runner import inputs, make

from graphtune.errors import ConfigError, InputError
from graphtune.graphs import CUDAGraphRunner, FallbackReason, SimulatedGraphBackend

# ---------------------------------------------------------------- outputs that cannot be sliced


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x[1:] * 2,  # the batch first, but one row short: padded rows would leak out
        lambda x: x.t() * 2,  # the batch second
        lambda x: x @ x.t(),  # the batch in both dims
        lambda x: torch.cat([x, x]),  # more rows than the batch at every size: no cap
    ],
    ids=["shifted", "transposed", "square", "doubled"],
)
@pytest.mark.parametrize("lazy", [False, True])
def test_outputs_that_cannot_be_sliced_run_eagerly_instead_of_wrong(caplog, fn, lazy):
    runner = CUDAGraphRunner(
        fn, backend=SimulatedGraphBackend(), max_batch_size=8, capture_sizes=[1, 2, 4, 8], lazy=lazy
    )
    x8 = torch.randn(8, 8)
    with caplog.at_level(logging.WARNING, logger="graphtune"):
        runner.capture(x8)
        if lazy:  # two sizes captured on first use are what shows the mismatch
            runner(torch.randn(8, 8))
            runner(torch.randn(4, 8))
    for n in (5, 8, 3):
        x = torch.randn(n, 8)
        out = runner(x)
        assert out.shape == fn(x).shape and torch.allclose(out, fn(x))
    assert runner.stats.replays == 0 or lazy
    assert runner.stats.fallbacks.get(FallbackReason.CAPTURE_FAILED, 0) >= 3
    # The stats say what is alive: no graph, every capture of the key failed.
    assert runner.captured_keys == [] and runner.stats.graphs == 0
    assert runner.stats.pool_bytes == 0 and runner.stats.failed_captures
    assert runner.state.value != "captured"
    assert any(
        "cannot" in r.getMessage() or "batch first" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize("lazy", [False, True])
def test_fixed_and_capped_outputs_keep_their_rows_at_every_size(lazy):
    table = torch.randn(8, 3)  # 8 rows, as many as a captured size

    def step(x):
        return x * 2, table + 1, x[:6] * 3  # the batch, a constant, the batch capped at 6

    runner = CUDAGraphRunner(
        step, backend=SimulatedGraphBackend(), max_batch_size=16, capture_sizes=[4, 8, 16],
        lazy=lazy,
    )  # fmt: skip
    runner.capture(torch.randn(16, 3))
    # Lazy: sizes on first use. A capped output is told from a constant once a size below its
    # cap is captured, so a small size comes first here (docs/graph-runner.md, *Outputs*).
    for n in (16, 3, 9, 5, 7, 3, 12, 5):
        x = torch.randn(n, 3)
        got, want = runner(x), step(x)
        assert [g.shape for g in got] == [w.shape for w in want]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert runner.stats.replays >= 6 and FallbackReason.CAPTURE_FAILED not in runner.stats.fallbacks


def test_outputs_with_the_batch_first_or_a_fixed_shape_still_replay():
    table = torch.randn(3, 5)
    runner = CUDAGraphRunner(
        lambda x: (x * 2, table + 1),
        backend=SimulatedGraphBackend(),
        max_batch_size=8,
        capture_sizes=[1, 2, 4, 8],
    )
    runner.capture(torch.randn(8, 8))
    x = torch.randn(5, 8)
    rows, fixed = runner(x)
    assert torch.equal(rows, x * 2) and torch.equal(fixed, table + 1)
    assert runner.stats.replays == 1 and runner.stats.fallbacks == {}


@pytest.mark.parametrize("pad", [1.5, float("nan"), 2**70])
def test_a_pad_value_an_integer_input_cannot_hold_is_refused_at_capture(pad):
    runner, _ = make(pad={"1.slot": pad})
    with pytest.raises(ConfigError, match="is not a value of its dtype torch.int64"):
        runner.capture(*inputs(4))


def test_a_backend_of_the_wrong_kind_and_an_unhashable_key_are_named():
    with pytest.raises(ConfigError, match="backend must be a GraphBackend"):
        CUDAGraphRunner(lambda x: x, max_batch_size=4, backend=5)
    runner = CUDAGraphRunner(
        lambda x: x * 2, max_batch_size=4, backend=SimulatedGraphBackend(), key_fn=lambda i: [1]
    )
    with pytest.raises(ConfigError, match="key_fn returned \\[1\\].*not hashable"):
        runner(torch.randn(2, 3))
    with pytest.raises(ConfigError, match="key_fn returned \\[1\\].*not hashable"):
        runner.capture(torch.randn(4, 3))


def test_callables_and_the_predicate_answer_are_checked():
    from graphtune.graphs import EagerRunner, graph_break

    with pytest.raises(ConfigError, match="fn must be callable"):
        EagerRunner(5)
    with pytest.raises(ConfigError, match="graph_break needs a callable"):
        graph_break(5)
    runner = CUDAGraphRunner(
        lambda x: x * 2,
        max_batch_size=4,
        backend=SimulatedGraphBackend(),
        can_graph=lambda i: torch.tensor(True),
    )
    with pytest.raises(ConfigError, match="can_graph must return True or False, got Tensor"):
        runner(torch.randn(2, 3))


def test_a_second_capture_warms_up_on_its_own_examples():
    seen = []

    def step(x):
        seen.append(x[:2].clone())
        return x * 2

    runner = CUDAGraphRunner(
        step, backend=SimulatedGraphBackend(), max_batch_size=4, capture_sizes=[4], warmup=1
    )
    runner.capture(torch.zeros(4, 3))
    runner(torch.full((2, 3), 7.0))  # leaves 7s in the buffers' first rows
    seen.clear()
    runner.capture(torch.ones(4, 3))  # the size is captured already: only the warm-up runs
    assert seen and all(torch.equal(s, torch.ones(2, 3)) for s in seen)


@pytest.mark.parametrize("with_break", [False, True])
def test_lazy_capture_runs_a_stateful_step_once_per_call(with_break):
    from graphtune.graphs import graph_break

    state = torch.zeros(16)

    def update(new, slots):
        state[slots] = new  # persistent state, read and written by every call
        return new

    def step(x, slots):
        new = 0.5 * state[slots] + x
        if with_break:
            new = graph_break(update, new, slots)
        else:
            state[slots] = new
        return new * 1.0

    runner = CUDAGraphRunner(
        step, backend=SimulatedGraphBackend(), max_batch_size=8, capture_sizes=[4, 8], lazy=True,
        pad={1: 15},  # padded rows update a scratch slot of their own
    )  # fmt: skip
    want = torch.zeros(16)
    for n in (3, 3, 6, 3, 6):
        x, slots = torch.ones(n), torch.arange(n)
        expected = 0.5 * want[slots] + x
        want[slots] = expected
        assert torch.equal(runner(x, slots), expected)
        assert torch.equal(state[:14], want[:14])
    assert runner.stats.fallbacks == {FallbackReason.WARMING_UP: 1}


def test_calls_the_graphs_cannot_serve_are_named():
    runner = CUDAGraphRunner(
        lambda x: x * 2, backend=SimulatedGraphBackend(), max_batch_size=4, capture_sizes=[4]
    )
    with torch.inference_mode():
        runner.capture(torch.randn(4, 3))
    with pytest.raises(InputError, match="inference_mode"):  # buffers made under it
        runner(torch.randn(2, 3))
    calls = runner.stats.calls
    with pytest.raises(InputError, match="positional inputs only"):
        runner(x=torch.randn(2, 3))
    assert runner.stats.calls == calls + 1  # counted as every refused call is
    keyed = CUDAGraphRunner(
        lambda x: x * 2, backend=SimulatedGraphBackend(), max_batch_size=4, key_fn=lambda i: i[0]
    )
    with pytest.raises(ConfigError, match="key_fn returned a tensor"):
        keyed.capture(torch.randn(4, 3))


def test_a_value_that_is_not_a_tensor_may_not_depend_on_the_batch():
    runner = CUDAGraphRunner(
        lambda x: (x * 2, x.shape[0], "kept"),
        backend=SimulatedGraphBackend(),
        max_batch_size=8,
        capture_sizes=[4, 8],
    )
    runner.capture(torch.zeros(8, 1))
    rows, count, text = runner(torch.ones(5, 1))
    assert count == 5 and text == "kept" and torch.equal(rows, torch.full((5, 1), 2.0))
    assert runner.captured_keys == [] and runner.stats.failed_captures
    constant = CUDAGraphRunner(
        lambda x: (x * 2, "kept"), backend=SimulatedGraphBackend(), max_batch_size=8,
        capture_sizes=[4, 8],
    )  # fmt: skip
    constant.capture(torch.zeros(8, 1))
    assert constant(torch.ones(5, 1))[1] == "kept" and constant.stats.replays == 1


def test_a_second_capture_pads_the_rows_an_earlier_smaller_call_left():
    scratch = 15
    cache = torch.zeros(16)

    def step(x, slot):
        cache.index_copy_(0, slot, x)  # state written by slot, as a KV cache is
        return x * 2

    runner = CUDAGraphRunner(
        step, backend=SimulatedGraphBackend(), max_batch_size=8, capture_sizes=[2, 8],
        pad={"1": scratch},
    )  # fmt: skip
    example = (torch.zeros(1), torch.tensor([scratch]))
    runner.capture(*example)
    runner(torch.tensor([7.0]), torch.tensor([scratch]))  # one row, padded to 2
    runner(torch.arange(1.0, 6.0), torch.arange(5))  # real rows in slots 0..4
    cache.zero_()
    cache[:5] = 100.0
    runner.capture(*example)  # the warm-up runs on the example, padded to every row
    assert cache[:5].tolist() == [100.0] * 5


def test_a_lazy_capture_that_fails_after_a_break_ran_raises_instead_of_running_twice(caplog):
    from graphtune.errors import CaptureError
    from graphtune.graphs import graph_break

    steps = torch.zeros(4)

    def step(x, slot):
        steps.index_add_(0, slot, torch.ones_like(slot, dtype=steps.dtype))  # before the break
        h = graph_break(torch.relu, x)
        if x.shape[0] == 2:
            h.sum().item()  # a host sync after the break: this size's capture fails
        return h * 2

    runner = CUDAGraphRunner(
        step, backend=SimulatedGraphBackend(), max_batch_size=4, capture_sizes=[2, 4], lazy=True,
        warmup=0, pad={"1": 3},
    )  # fmt: skip
    runner(torch.ones(4), torch.arange(4))
    with caplog.at_level(logging.WARNING, logger="graphtune"):
        with pytest.raises(CaptureError, match="run them twice"):
            runner(torch.ones(2), torch.tensor([0, 1]))
    assert steps.tolist() == [2.0, 2.0, 1.0, 1.0]  # the first piece ran once for each call
    assert torch.equal(runner(torch.ones(2), torch.tensor([0, 1])), torch.full((2,), 2.0))
    assert steps.tolist() == [3.0, 3.0, 1.0, 1.0]  # later calls of the size run eagerly, once


def test_capture_keeps_the_applications_own_gc_freeze():
    import gc

    runner = CUDAGraphRunner(
        lambda x: x * 2, backend=SimulatedGraphBackend(), max_batch_size=4, capture_sizes=[4]
    )
    gc.freeze()
    try:
        runner.capture(torch.zeros(4))
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    runner.release()
    runner.capture(torch.zeros(4))
    assert gc.get_freeze_count() == 0  # its own freeze is undone


def test_a_pad_rule_for_an_input_that_is_not_batched_is_refused():
    runner = CUDAGraphRunner(
        lambda x, table, k: x + table.sum() + k,
        backend=SimulatedGraphBackend(),
        max_batch_size=4,
        pad={"1": 99},
    )
    with pytest.raises(ConfigError, match="pad names input 1, which is not batched"):
        runner.capture(torch.zeros(4), torch.zeros(3), 1)
