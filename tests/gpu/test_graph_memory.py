"""Graph memory on a real GPU: the pool grows with the largest size, outputs stay bit-exact, and
what a caller may hold behaves as documented (docs/graph-runner.md, "Outputs")."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from graphtune.graphs import CapturePolicy, CUDAGraphRunner, default_capture_sizes

pytestmark = pytest.mark.gpu

DEV = "cuda"
DT = torch.bfloat16
VOCAB = 64000


class LogitsStep:
    """A decode-like step whose output is one row of logits per batch row (the memory that used
    to stay allocated per captured size)."""

    def __init__(self, hidden=1024, layers=2, seed=0):
        gen = torch.Generator(device=DEV).manual_seed(seed)

        def w(*shape):
            return (torch.randn(*shape, generator=gen, device=DEV) * shape[0] ** -0.5).to(DT)

        self.layers = [(w(hidden, 2 * hidden), w(2 * hidden, hidden)) for _ in range(layers)]
        self.head = w(hidden, VOCAB)
        self.hidden = hidden

    def __call__(self, x):
        for up, down in self.layers:
            x = x + torch.nn.functional.silu(x @ up) @ down
        return x @ self.head


def _x(n, seed=0, hidden=1024):
    gen = torch.Generator(device=DEV).manual_seed(5000 + 31 * seed + n)
    return torch.randn(n, hidden, generator=gen, device=DEV).to(DT)


def _clean():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _pool_bytes(step, sizes, **kwargs):
    _clean()
    runner = CUDAGraphRunner(step, max_batch_size=sizes[-1], capture_sizes=sizes, **kwargs)
    runner.capture(_x(sizes[-1]))
    assert not runner.stats.failed_captures, runner.stats.table()
    pool = runner.stats.pool_bytes
    records = list(runner.stats.records)
    runner.release()
    return pool, records


def test_pool_of_35_sizes_is_within_1_15x_of_the_largest_size_alone():
    step = LogitsStep()
    sizes = list(default_capture_sizes(256))
    alone, _ = _pool_bytes(step, [256])
    shared, records = _pool_bytes(step, sizes)
    owning, _ = _pool_bytes(step, sizes, policy=CapturePolicy(share_output_memory=False))
    assert all(r.shared_outputs for r in records)
    assert alone > 0 and shared <= 1.15 * alone, (shared / max(alone, 1), alone, shared)
    # One row of bf16 logits per row per size stays allocated without sharing.
    logits = sum(sizes) * VOCAB * 2
    assert owning >= shared + 0.8 * (logits - 256 * VOCAB * 2), (owning, shared)


def test_bit_exact_at_every_size_after_interleaved_calls():
    step = LogitsStep(layers=3)
    runner = CUDAGraphRunner(step, max_batch_size=64)
    runner.capture(_x(64))
    sizes = list(runner.capture_sizes) + [3, 5, 13, 27, 50, 63]
    order = sizes * 2
    random.Random(0).shuffle(order)
    for call, n in enumerate(order):
        x = _x(n, seed=call)
        got = runner(x).clone()
        padded, real, size = runner.padded_inputs(x)
        exact = step(*padded)[:real]
        assert torch.equal(got, exact), f"call {call}: batch {n} (padded to {size}) differs"
    assert runner.stats.replays == len(order) and runner.stats.eager_calls == 0
    runner.release()


def test_a_kept_output_is_valid_until_the_next_call_and_raises_after_release():
    step = LogitsStep(layers=1)
    runner = CUDAGraphRunner(step, max_batch_size=16)
    runner.capture(_x(16))
    x = _x(5, seed=1)
    out = runner(x)
    padded, real, _ = runner.padded_inputs(x)
    assert torch.equal(out, step(*padded)[:real])  # valid until the next call
    runner.release()
    with pytest.raises(RuntimeError, match="released"):
        out.float().sum().item()


def test_cloned_outputs_survive_other_sizes_and_release():
    step = LogitsStep(layers=1)
    runner = CUDAGraphRunner(step, max_batch_size=32, clone_outputs=True)
    runner.capture(_x(32))
    xs = [_x(n, seed=2) for n in (3, 32, 1, 17)]
    outs = [runner(x) for x in xs]
    wants = []
    for x in xs:
        padded, real, _ = runner.padded_inputs(x)
        wants.append(step(*padded)[:real])
    runner.release()
    for got, want in zip(outs, wants, strict=True):
        assert torch.equal(got, want)


def test_capture_records_phases_and_pool_bytes_per_size():
    step = LogitsStep()
    runner = CUDAGraphRunner(step, max_batch_size=64)
    runner.capture(_x(64))
    records = {r.size: r for r in runner.stats.records}
    largest = records[64]
    assert largest.pool_bytes > 0 and largest.record_seconds > 0 and largest.finish_seconds > 0
    assert runner.stats.largest_graph_pool_bytes == largest.pool_bytes
    assert runner.stats.pool_vs_largest is not None
    text = runner.stats.table()
    assert "pool / largest size" in text and "finish ms" in text
    runner.release()


def test_recapture_after_release_gives_the_same_pool_and_results():
    step = LogitsStep()
    runner = CUDAGraphRunner(step, max_batch_size=128)
    runner.capture(_x(128))
    first = runner.stats.pool_bytes
    x = _x(37, seed=3)
    want = runner(x).clone()
    runner.release()
    runner.capture(_x(128))
    assert runner.stats.pool_bytes <= 1.05 * first + (2 << 20)
    assert torch.equal(runner(x), want)
    runner.release()
