"""Pad rules the graph runner must refuse before anything is captured (simulated backend, CPU):
a number that does not fit a floating input's dtype, and a callable of the wrong signature.
Accepted, they failed with a raw error on every padded call."""

from __future__ import annotations

import functools

import pytest
import torch

from graphtune.errors import ConfigError
from graphtune.graphs import CUDAGraphRunner, SimulatedGraphBackend


def step(x, pos):
    return x * 2, pos + 1


def runner_for(pad) -> CUDAGraphRunner:
    return CUDAGraphRunner(
        step, max_batch_size=8, capture_sizes=[4, 8], pad=pad, backend=SimulatedGraphBackend()
    )


def examples(dtype: torch.dtype, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 4).to(dtype), torch.zeros(rows, dtype=torch.long)


@pytest.mark.parametrize(
    "dtype, value",
    [
        (torch.float16, 1e6),
        (torch.float16, 70000),
        (torch.bfloat16, 1e300),
        (torch.float32, 1e300),
        (torch.float16, 1j),
        (torch.float32, 2 + 0j),
        (torch.complex64, 1e300),
    ],
)
def test_a_pad_number_that_does_not_fit_a_floating_input_is_refused_at_capture(dtype, value):
    runner = runner_for({"0": value})
    with pytest.raises(ConfigError, match=rf"input 0 .*{dtype}"):
        runner.capture(*examples(dtype))
    assert runner.captured_keys == []
    with torch.inference_mode():  # nothing was captured: a padded call runs eagerly, no error
        out, _ = runner(*examples(dtype, rows=3))
    assert out.shape == (3, 4)


def _padded_call(rule, dtype):
    """Captures with ``rule`` padding input 0, then calls with 3 rows (padded to 4): the real
    input, the output, the padded input and ``padded_inputs``' row counts (copies: the
    runner's buffers are released with it)."""
    runner = runner_for({"0": rule})
    with torch.inference_mode():
        runner.capture(*examples(dtype))
        x, pos = examples(dtype, rows=3)
        out, _ = runner(x, pos)
        (padded_x, _), n, size = runner.padded_inputs(x, pos)
    return x, out.clone(), padded_x.clone(), n, size


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), -65504.0, 0.5])
def test_a_pad_number_that_fits_a_floating_input_pads_its_rows(value):
    x, out, padded_x, n, size = _padded_call(value, torch.float16)
    assert (n, size) == (3, 4)
    assert torch.equal(out, x * 2)
    expected = torch.full((1, 4), value, dtype=torch.float16)
    assert torch.allclose(padded_x[3:], expected, equal_nan=True)


def _fill_ones(pad_rows, real_rows, *, value=1.0):
    pad_rows.fill_(value)


def _needs_three(pad_rows, real_rows, extra):
    pad_rows.fill_(extra)


def _needs_keyword(pad_rows, real_rows, *, value):
    pad_rows.fill_(value)


@pytest.mark.parametrize(
    "rule", [lambda pad_rows: pad_rows.zero_(), _needs_three, _needs_keyword, lambda: None]
)
def test_a_pad_callable_of_the_wrong_signature_is_refused_at_capture(rule):
    runner = runner_for({"0": rule})
    with pytest.raises(ConfigError, match=r"input 0 .*fn\(pad_rows, real_rows\)"):
        runner.capture(*examples(torch.float32))
    assert runner.captured_keys == []
    with torch.inference_mode():  # nothing was captured: a padded call runs eagerly, no error
        out, _ = runner(*examples(torch.float32, rows=3))
    assert out.shape == (3, 4)


@pytest.mark.parametrize(
    "rule",
    [
        _fill_ones,
        lambda *rows: rows[0].fill_(1.0),
        lambda pad_rows, real_rows=None: pad_rows.fill_(1.0),
        functools.partial(_needs_three, extra=1.0),
    ],
)
def test_a_pad_callable_that_takes_pad_rows_and_real_rows_pads_its_rows(rule):
    x, out, padded_x, _, _ = _padded_call(rule, torch.float32)
    assert torch.equal(out, x * 2)
    assert torch.equal(padded_x[3:], torch.ones(1, 4))
