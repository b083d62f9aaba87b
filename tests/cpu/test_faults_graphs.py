"""Graph runner faults on CPU (SimulatedGraphBackend): out of memory while capturing one size,
inputs of the wrong dtype / rank / trailing shape at replay, non-batched inputs that moved."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from graphtune.errors import InputError
from graphtune.graphs import CUDAGraphRunner, FallbackReason, SimulatedGraphBackend

HIDDEN = 4
OOM_SIZE = 8


class OomStep:
    """A step that runs out of memory while capturing one size, after allocating a workspace."""

    def __init__(self, backend: SimulatedGraphBackend) -> None:
        self.backend = backend
        self.w = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(0))
        self.workspaces: list[weakref.ref] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend.capturing and x.shape[0] == OOM_SIZE:
            workspace = torch.empty(1 << 16)  # what a real failed capture leaves in its pool
            self.workspaces.append(weakref.ref(workspace))
            raise torch.cuda.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 139.8 GiB total)"
            )
        return torch.tanh(x @ self.w)


def test_oom_while_capturing_one_size_leaves_the_others_usable_and_memory_released(caplog):
    backend = SimulatedGraphBackend()
    step = OomStep(backend)
    runner = CUDAGraphRunner(step, max_batch_size=16, capture_sizes=[1, 4, 8, 16], backend=backend)
    runner.capture(torch.randn(16, HIDDEN))
    assert sorted(s for _, s in runner.captured_keys) == [1, 4, 16]
    failed = [r for r in runner.stats.records if not r.ok]
    assert [r.size for r in failed] == [OOM_SIZE]
    assert "out of memory" in failed[0].error and "size 8" in failed[0].error
    assert backend.recoveries == 1
    gc.collect()
    assert step.workspaces and all(ref() is None for ref in step.workspaces), (
        "nothing may keep the failed capture's memory alive (traceback, frames, records)"
    )
    for n in (1, 3, 4, 5, 8, 9, 16):
        x = torch.randn(n, HIDDEN)
        torch.testing.assert_close(runner(x), torch.tanh(x @ step.w))
    stats = runner.stats
    assert stats.replays == 5  # 1, 3, 4, 9, 16 replay; 5 and 8 pad to the failed size
    assert stats.fallbacks.get(FallbackReason.CAPTURE_FAILED, 0) == 2
    assert stats.replays + stats.eager_calls == stats.calls
    runner.release()
    assert runner.captured_keys == [] and backend.empty_cache_calls >= 1


def _runner(**kwargs):
    def step(x, table):
        return x @ table

    runner = CUDAGraphRunner(step, max_batch_size=8, backend=SimulatedGraphBackend(), **kwargs)
    table = torch.randn(HIDDEN, HIDDEN)
    runner.capture(torch.randn(8, HIDDEN), table)
    return runner, table


@pytest.mark.parametrize(
    "bad, got",
    [
        (torch.randn(3, HIDDEN, dtype=torch.float64), "dtype torch.float64"),
        (torch.randn(3, HIDDEN + 1), r"shape \(3, 5\)"),
        (torch.randn(3, HIDDEN, 1), r"shape \(3, 4, 1\)"),
        (torch.randn(3, 2, 2), r"shape \(3, 2, 2\)"),
    ],
)
def test_replay_with_wrong_dtype_rank_or_trailing_shape_names_input_and_expected_shape(bad, got):
    runner, table = _runner()
    pattern = rf"input 0: expected shape \(3, 4\), dtype torch.float32.*got .*{got}"
    with pytest.raises(InputError, match=pattern):
        runner(bad, table)
    # The runner is not poisoned by the rejected call.
    x = torch.randn(3, HIDDEN)
    torch.testing.assert_close(runner(x, table), x @ table)


def test_rank_zero_batch_input_is_a_clear_error():
    runner, table = _runner()
    with pytest.raises(InputError, match="input 0 gives the batch size"):
        runner(torch.tensor(1.0), table)


def test_moved_non_batch_input_raises_in_debug_mode_on_every_path():
    runner, table = _runner(debug=True, lazy=True)
    runner(torch.randn(2, HIDDEN), table)  # lazy capture of size 2
    for n in (2, 5):  # replay of a captured size, then a lazy capture + replay
        with pytest.raises(InputError, match="input 1 changed address"):
            runner(torch.randn(n, HIDDEN), table.clone())
