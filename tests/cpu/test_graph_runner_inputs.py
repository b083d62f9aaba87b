"""Calls the graph runner must not replay as captured (simulated backend, CPU): inputs that need
autograd, a frozen runner meeting a new key, and padded_inputs() given inputs a call refuses."""

from __future__ import annotations

import pytest
import torch

from graphtune.errors import CaptureError, InputError
from graphtune.graphs import (
    CapturePolicy,
    CUDAGraphRunner,
    FallbackReason,
    SimulatedGraphBackend,
)

W = torch.randn(4, 4)


def step(x):
    return x @ W


def captured(**kwargs) -> CUDAGraphRunner:
    runner = CUDAGraphRunner(
        step, max_batch_size=8, capture_sizes=[2, 4, 8], backend=SimulatedGraphBackend(), **kwargs
    )
    runner.capture(torch.randn(8, 4))
    return runner


@pytest.mark.parametrize("rows", [3, 4])  # padded, and a captured size
def test_an_input_that_requires_grad_runs_eagerly_and_keeps_its_gradient(rows):
    runner = captured()
    x = torch.randn(rows, 4, requires_grad=True)
    out = runner(x)
    out.sum().backward()  # a replay's output carries no graph: this raised or x.grad stayed None
    assert x.grad is not None and torch.allclose(x.grad, W.sum(1).expand(rows, 4))
    assert runner.stats.fallback_count(FallbackReason.NEEDS_GRAD) == 1
    plain = torch.randn(rows, 4)
    assert torch.allclose(runner(plain), step(plain))  # the runner still replays afterwards
    assert runner.stats.replays == 1
    with torch.no_grad():  # no autograd: nothing to lose, so it replays
        runner(x)
    assert runner.stats.replays == 2


def test_capture_refuses_examples_that_require_grad_under_autograd():
    runner = CUDAGraphRunner(step, max_batch_size=8, backend=SimulatedGraphBackend())
    with pytest.raises(InputError):
        runner.capture(torch.randn(8, 4, requires_grad=True))


def test_a_frozen_lazy_runner_allocates_nothing_for_a_new_key():
    runner = CUDAGraphRunner(
        step,
        max_batch_size=8,
        backend=SimulatedGraphBackend(),
        lazy=True,
        key_fn=lambda inputs: inputs[0].shape[1],
    )
    runner.freeze()
    x = torch.randn(3, 4)
    assert torch.allclose(runner(x), step(x))
    assert runner.stats.fallback_count(FallbackReason.FROZEN) == 1
    assert runner.stats.buffer_bytes == 0


def frozen_lazy(when_frozen: str, **kwargs) -> CUDAGraphRunner:
    runner = CUDAGraphRunner(
        lambda x, key: x * 2,
        backend=SimulatedGraphBackend(),
        lazy=True,
        key_fn=lambda inputs: inputs[1],
        policy=CapturePolicy(when_frozen=when_frozen, padding=kwargs.pop("padding", True)),
        **kwargs,
    )
    runner.freeze()
    return runner


@pytest.mark.parametrize("when_frozen", ["fallback", "raise"])
@pytest.mark.parametrize(
    ("x", "kwargs", "reason"),
    [
        (torch.ones(100, 2), {}, FallbackReason.BATCH_TOO_LARGE),
        (torch.tensor(3.0), {}, FallbackReason.NO_BATCH),
        (torch.ones(0, 2), {}, FallbackReason.NO_BATCH),
        (torch.ones(3, 2), {"padding": False}, FallbackReason.SIZE_NOT_CAPTURED),
        (torch.ones(3, 2), {"batched": {"0": False}}, FallbackReason.NO_BATCH),
    ],
    ids=["too-large", "no-batch-dim", "empty-batch", "padding-off", "marked-unbatched"],
)
def test_a_frozen_runner_routes_a_new_key_that_would_not_capture_as_before(
    when_frozen, x, kwargs, reason
):
    runner = frozen_lazy(when_frozen, max_batch_size=8, capture_sizes=[2, 4, 8], **kwargs)
    assert torch.equal(runner(x, "new"), x * 2)  # was FROZEN, or CaptureError with "raise"
    assert runner.stats.fallbacks == {reason: 1}
    assert runner.stats.buffer_bytes == 0


def test_a_frozen_runner_refuses_a_new_key_that_would_capture():
    runner = frozen_lazy("raise", max_batch_size=8)
    with pytest.raises(CaptureError, match="a call of a new key of batch 3 .size 4."):
        runner(torch.ones(3, 2), "new")
    assert runner.stats.buffer_bytes == 0
    runner = frozen_lazy("fallback", max_batch_size=8)
    assert torch.equal(runner(torch.ones(3, 2), "new"), torch.full((3, 2), 2.0))
    assert runner.stats.fallbacks == {FallbackReason.FROZEN: 1}


def test_padded_inputs_refuses_what_a_call_refuses():
    runner = captured()
    for bad in (torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 5)):
        with pytest.raises(InputError):
            runner.padded_inputs(bad)  # a float64 input was converted; a wrong width raised


def scaled(x, scale, w):
    return x * scale + w


def test_padded_inputs_refuses_a_changed_constant_as_a_call_does():
    w = torch.ones(2)
    runner = CUDAGraphRunner(
        scaled, max_batch_size=4, capture_sizes=[4], warmup=0, backend=SimulatedGraphBackend()
    )
    runner.capture(torch.zeros(4, 2), 2, w)
    x = torch.ones(3, 2)
    with pytest.raises(InputError, match="captured with 2") as call:
        runner(x, 3, w)
    with pytest.raises(InputError) as padded:  # padded_inputs accepted it
        runner.padded_inputs(x, 3, w)
    assert str(padded.value) == str(call.value)
    inputs, n, size = runner.padded_inputs(x, 2, w)
    assert (n, size, inputs[1]) == (3, 4, 2)


def test_padded_inputs_in_debug_mode_refuses_a_moved_tensor_as_a_call_does():
    runner = CUDAGraphRunner(
        scaled,
        max_batch_size=4,
        capture_sizes=[4],
        warmup=0,
        debug=True,
        backend=SimulatedGraphBackend(),
    )
    runner.capture(torch.zeros(4, 2), 2, torch.ones(2))
    for call in (runner, runner.padded_inputs):
        with pytest.raises(InputError, match="changed address"):
            call(torch.ones(3, 2), 2, torch.ones(2))


@pytest.mark.parametrize("answer", [True, False])
def test_can_graph_may_answer_with_a_numpy_bool(answer):
    np = pytest.importorskip("numpy")
    runner = CUDAGraphRunner(
        step,
        max_batch_size=8,
        capture_sizes=[2, 4, 8],
        backend=SimulatedGraphBackend(),
        can_graph=lambda inputs: np.bool_(inputs[0].shape[0] > 0) == answer,
    )
    with torch.inference_mode():
        runner.capture(torch.randn(8, 4))
        x = torch.randn(3, 4)
        assert torch.equal(runner(x), x @ W)
    assert runner.stats.replays == (1 if answer else 0)
    assert runner.stats.fallback_count(FallbackReason.PREDICATE_REFUSED) == (0 if answer else 1)


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize(
    "replacement",
    [lambda w: (w,), lambda w: [w], lambda w: None, lambda w: 3],
    ids=["tuple", "list", "None", "int"],
)
def test_a_non_batched_tensor_replaced_by_another_value_is_refused(replacement, nested):
    # The graph kept reading the captured tensor: the call returned x @ W for any value there,
    # without debug mode (which checks the tensor's address, not whether it is a tensor).
    def fn(x, w, *rest):
        return x @ (w[0] if isinstance(w, (tuple, list)) else w)

    runner = CUDAGraphRunner(
        fn,
        max_batch_size=4,
        capture_sizes=[2, 4],
        batched={"1": False},
        backend=SimulatedGraphBackend(),
    )
    rest = ({"k": 1},) if nested else ()  # a nested call does not take the flat fast path
    runner.capture(torch.randn(4, 4), W, *rest)
    x = torch.randn(3, 4)
    with pytest.raises(InputError, match="input 1 got a value of type .* non-batched tensor"):
        runner(x, replacement(torch.randn(4, 4)), *rest)
    with pytest.raises(InputError, match="input 1 got a value of type"):
        runner.padded_inputs(x, replacement(W), *rest)
    assert torch.equal(runner(x, W, *rest), fn(x, W))
    assert runner.stats.replays == 1
