"""Values crossing a graph break on CPU (simulated backend, outputs sharing pool memory as by
default): the containers a break is given stay the caller's objects at every replay, its constant
results are checked with NaN- and array-aware equality, and its static buffers are allocated only
where used."""

from __future__ import annotations

import collections
import decimal
from typing import NamedTuple

import numpy as np
import pytest
import torch

from graphtune.errors import InputError
from graphtune.graphs import CUDAGraphRunner, SimulatedGraphBackend, graph_break
from graphtune.graphs.policy import FallbackReason
from graphtune.graphs.values import same_constant


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


class QK(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor


class Pair(tuple):
    """A tuple subclass with a constructor of its own (not from one sequence)."""

    def __new__(cls, q, k):
        return super().__new__(cls, (q, k))

    @property
    def q(self):
        return self[0]


class Reversed(tuple):
    """A tuple subclass whose constructor takes one sequence but reorders it."""

    def __new__(cls, items):
        return super().__new__(cls, list(items)[::-1])

    @property
    def q(self):
        return self[0]


@pytest.mark.parametrize(
    ("build", "twinned"),
    [
        (lambda q: QK(q, q + 1), True),  # rebuilt with its type, its tensors twinned
        (lambda q: Pair(q, q + 1), False),  # cannot be rebuilt: the caller's own object
        (lambda q: Reversed([q + 1, q]), False),  # rebuilt as another value: the caller's
    ],
    ids=["namedtuple", "own-constructor", "reordering-constructor"],
)
def test_a_tuple_subclass_argument_keeps_its_type_at_every_replay(build, twinned):
    seen: list[type] = []
    made: list[tuple] = []

    def attend(pair):
        seen.append(type(pair))
        return pair.q * 2

    def step(x):
        made.append(build(x + 1))
        return graph_break(attend, made[-1]) + 1

    runner = make(step)
    runner.capture(torch.zeros(4, 2))
    assert runner.stats.records[0].ok
    arg = runner._keys[None].graphs[4].graph.breaks[0].args[0]
    assert type(arg) is type(made[-1])
    assert (arg is not made[-1]) is twinned
    assert arg[0].data_ptr() == made[-1][0].data_ptr()
    assert runner(torch.ones(4, 2)).tolist() == [[5.0, 5.0]] * 4  # AttributeError: a plain tuple
    assert seen == [type(made[-1])] * 2


class Odd:
    """A value whose ``==`` raises: equal to nothing by value, only by identity."""

    def __eq__(self, other):
        raise TypeError("cannot compare")

    __hash__ = object.__hash__


ODD = Odd()
NAT = np.datetime64("NaT")
DECIMAL_NAN = decimal.Decimal("NaN")
COMPLEX_NAN = complex("nan")


@pytest.mark.parametrize(
    "constant",
    [NAT, DECIMAL_NAN, COMPLEX_NAN, ODD],
    ids=["nat", "decimal-nan", "complex-nan", "odd"],
)
def test_a_break_result_that_is_the_same_object_at_every_call_replays(constant):
    def step(x):
        y, _ = graph_break(lambda q: (q * 2, constant), x + 1)  # a cached marker, say
        return y + 1

    runner = make(step)
    runner.capture(torch.zeros(4, 2))
    assert runner.stats.records[0].ok, runner.stats.records[0].error  # failed its capture
    assert runner(torch.ones(4, 2)).tolist() == [[5.0, 5.0]] * 4
    assert runner.stats.replays == 1 and not runner.stats.fallbacks


@pytest.mark.parametrize(
    "make_constant",
    [
        lambda: np.datetime64("NaT"),
        lambda: np.timedelta64("NaT"),
        lambda: np.array(["2024-01-01", "NaT"], dtype="datetime64[s]"),
        lambda: decimal.Decimal("NaN"),
        lambda: complex(float("nan"), 1.0),
    ],
    ids=["nat", "timedelta-nat", "datetime-array", "decimal-nan", "complex-nan"],
)
def test_a_new_nan_or_nat_break_result_equals_the_captured_one(make_constant):
    def step(x):
        y, _ = graph_break(lambda q: (q * 2, make_constant()), x + 1)
        return y + 1

    runner = make(step)
    runner.capture(torch.zeros(4, 2))
    assert runner.stats.records[0].ok, runner.stats.records[0].error
    assert runner(torch.ones(4, 2)).tolist() == [[5.0, 5.0]] * 4
    assert runner.stats.replays == 1


def test_a_new_break_result_not_equal_to_itself_fails_the_capture_and_runs_eagerly():
    # The capture accepted it and every call then raised InputError, for good: a new object
    # that is not equal to itself can never match the captured one at a replay.
    seen = []

    def brk(q):
        seen.append(Odd())
        return q * 2, seen[-1]

    def step(x):
        y, _ = graph_break(brk, x + 1)  # a new object at every call
        return y + 1

    runner = make(step)
    runner.capture(torch.zeros(4, 2))
    record = runner.stats.records[0]
    assert not record.ok and "not equal to itself" in record.error, record.error
    assert "at each call" in record.error and "run eagerly" in record.error
    for _ in range(3):  # no exception: eager calls, reason recorded
        assert runner(torch.ones(4, 2)).tolist() == [[5.0, 5.0]] * 4
    assert runner.stats.replays == 0
    assert runner.stats.fallbacks == {FallbackReason.CAPTURE_FAILED: 3}


def test_a_cached_break_result_that_changes_later_still_fails_at_replay():
    # Accepted at capture (the same object twice), then a new one: a changed constant.
    markers = [Odd()]

    def step(x):
        y, _ = graph_break(lambda q: (q * 2, markers[-1]), x + 1)
        return y + 1

    runner = make(step)
    runner.capture(torch.zeros(4, 2))
    assert runner.stats.records[0].ok
    assert runner(torch.ones(4, 2)).tolist() == [[5.0, 5.0]] * 4
    markers.append(Odd())
    with pytest.raises(InputError, match="not equal to itself.*that very object"):
        runner(torch.ones(4, 2))


def test_a_nat_in_a_constant_input_matches_an_equal_array():
    stamps = np.array(["2024-01-01", "NaT"], dtype="datetime64[s]")
    runner = CUDAGraphRunner(
        lambda x, s: x * 2,
        max_batch_size=4,
        capture_sizes=[4],
        warmup=0,
        backend=SimulatedGraphBackend(),
    )
    runner.capture(torch.zeros(4, 2), stamps)
    assert runner(torch.ones(4, 2), stamps.copy()).tolist() == [[2.0, 2.0]] * 4
    assert runner.stats.replays == 1


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (NAT, NAT, True),
        (ODD, ODD, True),
        (Odd(), Odd(), False),
        (np.datetime64("NaT"), np.datetime64("NaT"), True),
        (np.timedelta64("NaT"), np.timedelta64(1), False),
        (decimal.Decimal("NaN"), decimal.Decimal("NaN"), True),
        (decimal.Decimal("sNaN"), decimal.Decimal("sNaN"), True),
        (decimal.Decimal("sNaN"), decimal.Decimal("NaN"), False),
        (decimal.Decimal(1), decimal.Decimal("sNaN"), False),  # == raised InvalidOperation
        (complex(float("nan"), 1), complex(float("nan"), 1), True),
        (complex(float("nan"), 1), complex(float("nan"), 2), False),
        (1.0, 1, False),
        # Equal by ==, but x / c is -inf for one and inf for the other.
        (-0.0, 0.0, False),
        (-0.0, -0.0, True),
        (complex(1.0, -0.0), complex(1.0, 0.0), False),
        (decimal.Decimal("-0"), decimal.Decimal("0"), False),
        (np.float32(-0.0), np.float32(0.0), False),
        (np.array([1.0, -0.0]), np.array([1.0, 0.0]), False),
        (np.array([1.0, -0.0, np.nan]), np.array([1.0, -0.0, np.nan]), True),
        (np.array([complex(0.0, -0.0)]), np.array([0j]), False),
    ],
)
def test_same_constant(a, b, same):
    assert same_constant(a, b) is same


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
