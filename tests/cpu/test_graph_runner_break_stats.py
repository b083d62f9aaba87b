"""stats.break_runs counts the breaks of every replayed call, lazily capturing calls included."""

from __future__ import annotations

import pytest
import torch

from graphtune.graphs import CUDAGraphRunner, SimulatedGraphBackend, graph_break


def scale(q):
    return q * 2


def halves(q):
    return q + 1, q.mean(-1)


def step(x):
    a = graph_break(scale, x)
    b, m = graph_break(halves, a)
    return torch.relu(b) + m[:, None]


@pytest.mark.parametrize("lazy", [False, True])
def test_every_replayed_call_counts_its_breaks(lazy):
    runner = CUDAGraphRunner(step, max_batch_size=16, lazy=lazy, backend=SimulatedGraphBackend())
    runner.capture(torch.randn(16, 4))
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 5, 9, 16, 3, 8) * 3:
        x = torch.randn(n, 4, generator=gen)
        assert torch.allclose(runner(x), step(x))
    stats = runner.stats
    assert all(r.breaks == 2 for r in stats.records)
    # lazy: capture() warmed the key, so the first call of each size captures it and counts as
    # a replay (its capture ran both breaks once for it), as every later call does.
    assert stats.replays == 21 and stats.fallbacks == {}
    assert stats.break_runs == 2 * stats.replays
    assert stats.break_seconds > 0
