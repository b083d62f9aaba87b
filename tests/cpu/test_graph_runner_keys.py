"""key_fn values that Python calls equal but that are different keys (1, 1.0, True).

A dict keys 1, 1.0 and True alike (equal, same hash); the runner keys graphs by type and value
(``graphs.keys.typed_key``), so each gets its own buffers, graphs and records.
"""

from __future__ import annotations

import collections
import logging
import math

import numpy as np
import pytest
import torch

from graphtune.errors import ConfigError, InputError
from graphtune.graphs import CUDAGraphRunner, SimulatedGraphBackend
from graphtune.graphs.keys import typed_key


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR, logger="graphtune.graphs")


def test_equal_keys_of_other_types_get_their_own_graphs():
    # The scale reaches fn outside its inputs, so only key_fn tells the keys apart: x * 1 keeps
    # an int tensor's dtype, x * 1.0 makes it float. A shared graph would replay the int one.
    scale = {"value": 1}

    def step(x):
        return x * scale["value"]

    runner = CUDAGraphRunner(
        step,
        max_batch_size=4,
        capture_sizes=[2, 4],
        key_fn=lambda inp: scale["value"],
        backend=SimulatedGraphBackend(),
    )
    x = torch.arange(6).reshape(3, 2)
    for value in (1, 1.0, True):
        scale["value"] = value
        runner.capture(torch.ones(4, 2, dtype=torch.long))
    got = [(type(k).__name__, size) for k, size in runner.captured_keys]
    assert got == [("int", 2), ("int", 4), ("float", 2), ("float", 4), ("bool", 2), ("bool", 4)]
    assert [type(r.extra_key) for r in runner.stats.records] == [int] * 2 + [float] * 2 + [bool] * 2
    for value in (1.0, 1, True, 1.0):
        scale["value"] = value
        out = runner(x)
        assert out.dtype == step(x).dtype and torch.equal(out, step(x))
        assert runner.padded_inputs(x)[2] == 4
    assert runner.stats.replays == 4 and runner.stats.eager_calls == 0


def test_equal_constant_inputs_returned_from_key_fn_are_other_keys():
    # The error for a changed constant input says to return it from key_fn; doing so works for
    # a value equal to another key's.
    runner = CUDAGraphRunner(
        lambda x, flag: x * flag,
        max_batch_size=2,
        key_fn=lambda inp: inp[1],
        backend=SimulatedGraphBackend(),
    )
    x = torch.ones(2, 3)
    for flag in (1, True, 1.0):
        runner.capture(x, flag)
    for flag in (True, 1.0, 1):
        assert runner(x, flag).dtype == (x * flag).dtype
    assert runner.stats.replays == 3


def test_a_zero_of_the_other_sign_is_another_constant_and_another_key():
    # -0.0 == 0.0, so a graph captured with c=0.0 replayed for c=-0.0: inf where eager gives -inf.
    def step(x, c):
        return x / c

    x = torch.ones(4, 2)
    baked = CUDAGraphRunner(step, max_batch_size=4, backend=SimulatedGraphBackend())
    baked.capture(x, 0.0)
    with pytest.raises(InputError, match="-0.0 but the graph was captured with 0.0"):
        baked(x, -0.0)
    keyed = CUDAGraphRunner(
        step, max_batch_size=4, key_fn=lambda inp: inp[1], backend=SimulatedGraphBackend()
    )
    for c in (0.0, -0.0):
        keyed.capture(x, c)
    signs = [(math.copysign(1.0, key), size) for key, size in keyed.captured_keys]
    assert signs == [(1.0, 1), (1.0, 2), (1.0, 4), (-1.0, 1), (-1.0, 2), (-1.0, 4)]
    for c in (-0.0, 0.0):
        assert torch.equal(keyed(x, c), step(x, c))
    assert keyed.stats.replays == 2


@pytest.mark.parametrize("dtype", ["float16", "float32", "complex64"])
def test_numpy_zeros_of_the_other_sign_are_other_keys(dtype):
    # float32 / float16 / complex64 are not float subclasses: they keyed by ==, one key for both
    # signs, and the second capture was refused as a changed constant.
    zeros = [np.dtype(dtype).type(0.0), np.dtype(dtype).type(-0.0)]
    assert typed_key(zeros[0]) != typed_key(zeros[1])
    assert typed_key(np.dtype(dtype).type(0.0)) == typed_key(zeros[0])
    runner = CUDAGraphRunner(
        lambda x, c: x * 1,
        max_batch_size=2,
        key_fn=lambda inp: inp[1],
        backend=SimulatedGraphBackend(),
    )
    x = torch.ones(2, 2)
    for c in zeros:
        runner.capture(x, c)
    assert len(runner.captured_keys) == 4


def test_a_dropped_key_fails_its_own_records_only():
    # Key True's outputs cannot be sliced to a batch, so its graphs are dropped; key 1's
    # records (equal key, other type) stay ok and its graphs replay.
    runner = CUDAGraphRunner(
        lambda x, flag: x[1:] * flag if flag is True else x * flag,
        max_batch_size=4,
        capture_sizes=[2, 4],
        key_fn=lambda inp: inp[1],
        backend=SimulatedGraphBackend(),
    )
    runner.capture(torch.ones(4, 2), 1)
    runner.capture(torch.ones(4, 2), True)
    status = {(type(r.extra_key), r.size): r.ok for r in runner.stats.records}
    assert status == {(int, 2): True, (int, 4): True, (bool, 2): False, (bool, 4): False}
    assert runner.captured_keys == [(1, 2), (1, 4)]
    assert torch.equal(runner(torch.ones(3, 2), 1), torch.ones(3, 2))
    assert runner.stats.replays == 1


def test_typed_key_compares_type_and_value_through_tuples():
    assert typed_key(None) is None
    assert len({typed_key(v) for v in (1, 1.0, True)}) == 3
    assert typed_key((1, (2, "a"))) == typed_key((1, (2, "a")))
    assert typed_key((1, (2, "a"))) != typed_key((1, (2.0, "a")))
    assert typed_key((True,)) != typed_key((1,))
    assert typed_key(float("nan")) == typed_key(float("nan"))
    # Equal, but two constants to a graph (x / c is -inf or inf): two keys, as NaN is one.
    assert typed_key(-0.0) != typed_key(0.0) and typed_key(-0.0) == typed_key(-0.0)
    assert typed_key(complex(1.0, -0.0)) != typed_key(complex(1.0, 0.0))
    assert typed_key(np.float64(-0.0)) != typed_key(np.float64(0.0))
    assert typed_key(frozenset({1})) == typed_key(frozenset({True}))  # other values: ==
    # The flat-tuple fast path keeps the same rules.
    assert len({typed_key(v) for v in ((1, "a"), (1.0, "a"), (True, "a"))}) == 3
    assert typed_key((float("nan"), 1)) == typed_key((float("nan"), 1))
    assert typed_key((-0.0, None)) != typed_key((0.0, None))
    assert typed_key((0.0, 0)) == typed_key((0.0, 0)) != typed_key((-0.0, 0))
    assert typed_key(((-0.0,), 2)) != typed_key(((0.0,), 2))
    assert typed_key(((float("nan"),), 2)) == typed_key(((float("nan"),), 2))
    assert typed_key(collections.namedtuple("P", "a")(1)) != typed_key((1,))


def test_nan_key_reuses_its_buffers_and_unhashable_keys_still_raise():
    runner = CUDAGraphRunner(
        lambda x: x * 2,
        max_batch_size=2,
        key_fn=lambda inp: float("nan"),  # a new NaN object each call
        backend=SimulatedGraphBackend(),
    )
    runner.capture(torch.ones(2, 3))
    runner(torch.ones(2, 3))
    assert runner.stats.replays == 1 and len(runner.captured_keys) == 2
    listed = CUDAGraphRunner(
        lambda x: x,
        max_batch_size=2,
        key_fn=lambda inp: ("a", [1]),
        backend=SimulatedGraphBackend(),
    )
    with pytest.raises(ConfigError, match="not hashable"):
        listed(torch.ones(2, 3))
    with pytest.raises(ConfigError, match="not hashable"):
        listed.padded_inputs(torch.ones(2, 3))


@pytest.mark.parametrize(
    "make_nan",
    [
        lambda: np.float64("nan"),
        lambda: ("mode", np.float64("nan")),
        lambda: complex(float("nan"), 1.0),
        lambda: np.complex128(complex(1.0, float("nan"))),
    ],
    ids=["numpy-float64", "numpy-float64-in-tuple", "complex", "numpy-complex128"],
)
def test_a_numpy_or_complex_nan_key_reuses_its_buffers(make_nan):
    # NaN was recognised only for an exact float: a numpy.float64 NaN key (a float subclass)
    # built new buffers (and would capture new graphs) at every call, without bound.
    assert typed_key(make_nan()) == typed_key(make_nan())
    assert hash(typed_key(make_nan())) == hash(typed_key(make_nan()))
    runner = CUDAGraphRunner(
        lambda x, k: x * 2,
        max_batch_size=4,
        key_fn=lambda inp: make_nan(),  # a new NaN object each call
        backend=SimulatedGraphBackend(),
        warmup=0,
        lazy=True,
    )
    for _ in range(5):
        assert runner(torch.ones(2, 3), 0).tolist() == [[2.0] * 3] * 2
    assert len(runner._keys) == 1 and runner.stats.replays == 5
    # Still typed: a numpy NaN is not a float NaN, nor a NaN with another other part.
    assert typed_key(np.float64("nan")) != typed_key(float("nan"))
    assert typed_key(complex(float("nan"), 1.0)) != typed_key(complex(float("nan"), 2.0))


@pytest.mark.parametrize(
    "key_fn",
    [
        lambda inputs: ("mode", inputs[1]),
        lambda inputs: (1, ("nested", inputs[1])),
        lambda inputs: frozenset({inputs[1]}),
    ],
    ids=["in-tuple", "nested-tuple", "in-frozenset"],
)
@pytest.mark.parametrize("how", ["capture", "lazy-call", "frozen-lazy-call"])
def test_a_tensor_inside_a_key_is_refused_as_a_tensor_key_is(key_fn, how):
    runner = CUDAGraphRunner(
        lambda x, t: x * 2,
        max_batch_size=4,
        key_fn=key_fn,
        lazy=how != "capture",
        backend=SimulatedGraphBackend(),
    )
    if how == "frozen-lazy-call":
        runner.freeze()
    call = runner.capture if how == "capture" else runner
    for _ in range(2):  # identity-hashed: every call was a new key with new buffers
        with pytest.raises(ConfigError, match="^key_fn returned a tensor, which would key"):
            call(torch.ones(4, 2), torch.tensor(1))
    assert runner.stats.buffer_bytes == 0 and not runner._keys


def test_a_non_lazy_runner_refuses_a_tensor_key_on_a_call_as_docs_say():
    runner = CUDAGraphRunner(
        lambda x, k: x * 2,
        max_batch_size=8,
        capture_sizes=[2, 4, 8],
        key_fn=lambda inputs: inputs[1],
        backend=SimulatedGraphBackend(),
    )
    runner.capture(torch.ones(8, 2), 3)
    with pytest.raises(ConfigError, match="key_fn returned a tensor"):
        runner(torch.ones(3, 2), torch.tensor(3))
    assert runner.stats.eager_calls == 0  # refused, not run eagerly as "key not captured"
    runner(torch.ones(3, 2), 3)
    assert runner.stats.replays == 1
