"""EagerRunner has the read-only interface docs/graph-runner.md promises, and refuses named
inputs with the graph runner's InputError."""

from __future__ import annotations

import pytest
import torch

from graphtune.errors import ConfigError, InputError
from graphtune.graphs import CUDAGraphRunner, EagerRunner, FallbackReason, SimulatedGraphBackend


def double(x):
    return x * 2


def test_eager_runner_reports_what_an_engine_reads_from_a_runner():
    eager = EagerRunner(double, max_batch_size=8)
    eager.capture(torch.ones(8, 2))
    assert eager.max_batch_size == 8
    assert eager.captured_keys == [] and eager.capture_sizes == ()
    assert eager.fallback_reason is FallbackReason.DISABLED
    assert EagerRunner(double).max_batch_size is None
    with pytest.raises(ConfigError, match="max_batch_size"):
        EagerRunner(double, max_batch_size=0)


def test_both_runners_refuse_named_inputs_with_input_error():
    graph = CUDAGraphRunner(double, max_batch_size=8, backend=SimulatedGraphBackend())
    for runner in (graph, EagerRunner(double)):
        with pytest.raises(InputError, match="positional inputs only"):
            runner(x=torch.ones(2, 2))
        assert runner.stats.calls == 1 and runner.stats.eager_calls == 0


def test_capture_raises_what_its_docstring_says_for_pad_and_batched():
    runner = CUDAGraphRunner(
        double, max_batch_size=8, backend=SimulatedGraphBackend(), pad={"3": 0}
    )
    with pytest.raises(ConfigError, match="matches no input"):
        runner.capture(torch.ones(8, 2))
    runner = CUDAGraphRunner(
        lambda x, y: x + y.sum(), max_batch_size=8, backend=SimulatedGraphBackend(),
        batched={"1": True},
    )  # fmt: skip
    with pytest.raises(InputError, match="marked batched"):
        runner.capture(torch.ones(8, 2), torch.ones(3))
    doc = CUDAGraphRunner.capture.__doc__
    assert "ConfigError: ``pad`` or ``batched``" in doc


def test_eager_runner_counts_calls_as_disabled_and_keeps_its_fields_read_only():
    eager = EagerRunner(double, max_batch_size=8)
    eager(torch.ones(3, 2))
    disabled = CUDAGraphRunner(
        double, max_batch_size=8, enabled=False, backend=SimulatedGraphBackend()
    )
    disabled(torch.ones(3, 2))
    assert eager.stats.fallbacks == disabled.stats.fallbacks == {FallbackReason.DISABLED: 1}
    assert eager.stats.fallback_count(FallbackReason.DISABLED) == 1
    for name in ("max_batch_size", "capture_sizes", "frozen", "fallback_reason"):
        with pytest.raises(AttributeError):
            setattr(eager, name, 5)
    eager.freeze()
    assert eager.frozen and eager.max_batch_size == 8
    eager.unfreeze()
    assert not eager.frozen
