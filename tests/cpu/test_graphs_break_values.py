"""Values crossing a graph break on CPU (simulated backend, outputs sharing pool memory as by
default): the containers a break is given stay the caller's objects at every replay, its constant
results are checked with NaN- and array-aware equality, and its static buffers are allocated only
where used."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from graphtune.errors import InputError
from graphtune.graphs import CUDAGraphRunner, SimulatedGraphBackend, graph_break


def make(step, rows: int = 4) -> CUDAGraphRunner:
    return CUDAGraphRunner(
        step, max_batch_size=rows, capture_sizes=[rows], warmup=0, backend=SimulatedGraphBackend()
    )


def test_a_break_gets_the_callers_dicts_and_lists_at_every_replay():
    host = {"scale": 1.0}  # host state the caller changes between calls
    log: list[float] = []  # a list the break appends to
    counts: collections.defaultdict[str, int] = collections.defaultdict(int)

    def attend(q, params, seen, tally):
        seen.append(params["scale"])
        tally["calls"] += 1
        return q * params["scale"]

    def step(x):
        return graph_break(attend, x + 1, host, log, tally=counts) * 1

    runner = make(step)
    runner.capture(torch.zeros(4, 2))
    assert runner.stats.records[0].shared_outputs
    brk = runner._keys[None].graphs[4].graph.breaks[0]
    assert brk.args[1] is host and brk.args[2] is log and brk.kwargs["tally"] is counts
    log.clear()
    counts.clear()
    host["scale"] = 10.0
    out = runner(torch.ones(4, 2))
    assert out.tolist() == [[20.0, 20.0]] * 4
    assert log == [10.0] and counts == {"calls": 1}


def test_tensors_and_tuples_are_twinned_lists_and_dicts_stay_the_callers():
    made: list[torch.Tensor] = []
    bias = torch.ones(2)
    kept = {"bias": bias}

    def add(q, pair, parts, named):
        return q + pair[1] + parts[0] + named["q"] + named["held"]["bias"]

    def step(x):
        q = x + 1
        made.append(q)
        return graph_break(add, q, (None, q), [q], {"q": q, "held": kept}) * 1

    runner = make(step)
    runner.capture(torch.zeros(4, 2))
    brk = runner._keys[None].graphs[4].graph.breaks[0]
    q, pair, parts, named = brk.args
    for twin in (q, pair[1]):  # non-owning: the block can go back to the pool
        assert twin is not made[-1] and twin.data_ptr() == made[-1].data_ptr()
    assert parts[0] is made[-1] and named["q"] is made[-1]  # a list or dict is never rewritten
    assert named["held"] is kept and kept["bias"] is bias
    assert runner(torch.ones(4, 2)).tolist() == [[9.0, 9.0]] * 4


@pytest.mark.parametrize(
    "make_constant",
    [
        lambda: float("nan"),
        lambda: np.array([1.0, float("nan")]),
        lambda: np.float32("nan"),
        lambda: np.array([1, 2]),
    ],
    ids=["nan", "array-with-nan", "numpy-nan", "int-array"],
)
def test_a_constant_break_result_that_plain_equality_cannot_compare_replays(make_constant):
    def brk(q):
        return q * 2, make_constant()  # a new object at every call, equal to the last

    def step(x):
        y, _ = graph_break(brk, x + 1)
        return y + 1

    runner = make(step)
    runner.capture(torch.zeros(4, 2))
    assert runner.stats.records[0].ok
    assert runner(torch.ones(4, 2)).tolist() == [[5.0, 5.0]] * 4
    assert runner.stats.replays == 1


def test_a_break_result_that_is_not_equal_to_itself_fails_its_capture():
    class Odd:
        def __eq__(self, other):
            raise TypeError("cannot compare")

        __hash__ = object.__hash__

    def step(x):
        y, _ = graph_break(lambda q: (q * 2, Odd()), x + 1)
        return y + 1

    runner = make(step)
    runner.capture(torch.zeros(4, 2))
    record = runner.stats.records[0]
    assert not record.ok and "Odd" in (record.error or "")
    assert runner(torch.ones(4, 2)).tolist() == [[5.0, 5.0]] * 4  # runs eagerly instead


def test_a_non_contiguous_break_output_allocates_no_shared_buffer():
    def transposed(q):
        return (q.t().contiguous() * 2).t()  # the batch leads, but the layout is column-major

    def step(x):
        return graph_break(transposed, x + 1) + 1

    runner = make(step, rows=8)
    runner.capture(torch.zeros(8, 3))
    key = runner._keys[None]
    assert key.breaks.nbytes == 0
    own = sum(b.own_bytes for b in key.graphs[8].graph.breaks)
    assert own == 8 * 3 * 4
    assert runner.stats.buffer_bytes == key.inputs.nbytes + own
    assert runner(torch.ones(8, 3)).tolist() == [[5.0] * 3] * 8


def test_a_changed_constant_still_fails_at_replay():
    values = iter([np.array([1, 2]), np.array([1, 3])])

    def step(x):
        y, _ = graph_break(lambda q: (q * 2, next(values)), x + 1)
        return y + 1

    runner = make(step)
    runner.capture(torch.zeros(4, 2))
    with pytest.raises(InputError):
        runner(torch.ones(4, 2))
