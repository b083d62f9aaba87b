"""Graph breaks on a real GPU: pieces captured with torch.cuda.CUDAGraph, breaks run eagerly in
between; replays are bit-exact against eager on the padded inputs, at every size and after
interleaved calls, and a break sees host state that changes between calls."""

from __future__ import annotations

import random

import pytest
import torch

from graphtune.graphs import CapturePolicy, CUDAGraphRunner, FallbackReason, graph_break

pytestmark = pytest.mark.gpu

DEV = "cuda"
DT = torch.bfloat16


class VarContextStep:
    """Per layer: projections and a KV-cache write (captured), attention over the first
    ``context`` cache positions (a Python int the caller changes between calls, so the shapes of
    the attention change: it can only run as a graph break), then the output projection."""

    SLOTS, CTX, HEADS, DIM, LAYERS = 72, 64, 4, 64, 3

    def __init__(self, breaks=True, seed=0):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        hidden = self.HEADS * self.DIM

        def w():
            return (torch.randn(hidden, hidden, generator=gen, device=DEV) * hidden**-0.5).to(DT)

        self.weights = [(w(), w(), w(), w()) for _ in range(self.LAYERS)]
        shape = (self.LAYERS, self.SLOTS, self.CTX, self.HEADS, self.DIM)
        self.cache_k = torch.randn(*shape, generator=gen, device=DEV).to(DT)
        self.cache_v = torch.randn(*shape, generator=gen, device=DEV).to(DT)
        self.pad_slot = self.SLOTS - 1
        self.context = self.CTX
        self.breaks = breaks

    def attend(self, q, layer, slot):
        ctx = self.context
        keys = self.cache_k[layer][slot, :ctx]  # [b, ctx, heads, dim]
        values = self.cache_v[layer][slot, :ctx]
        scores = torch.einsum("bhd,bthd->bht", q, keys) * self.DIM**-0.5
        att = torch.softmax(scores.float(), dim=-1).to(DT)
        return torch.einsum("bht,bthd->bhd", att, values).reshape(q.shape[0], -1)

    def __call__(self, x, slot, pos):
        b = x.shape[0]
        for layer, (wq, wk, wv, wo) in enumerate(self.weights):
            q = (x @ wq).view(b, self.HEADS, self.DIM)
            self.cache_k[layer][slot, pos] = (x @ wk).view(b, self.HEADS, self.DIM)
            self.cache_v[layer][slot, pos] = (x @ wv).view(b, self.HEADS, self.DIM)
            if self.breaks:
                a = graph_break(self.attend, q, layer, slot)
            else:
                a = self.attend(q, layer, slot)
            x = x + a @ wo
        return x

    def inputs(self, n, seed):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        x = torch.randn(n, self.HEADS * self.DIM, generator=gen, device=DEV).to(DT)
        slot = torch.randperm(self.pad_slot, generator=gen, device=DEV)[:n]
        pos = torch.randint(0, self.CTX, (n,), generator=gen, device=DEV)
        return x, slot, pos


def _check(runner, step, inputs):
    """Replay vs eager on the padded inputs, both from the same cache state."""
    saved = step.cache_k.clone(), step.cache_v.clone()
    got = runner(*inputs).clone()
    graph_cache = step.cache_k.clone()
    step.cache_k.copy_(saved[0])
    step.cache_v.copy_(saved[1])
    padded, real, _ = runner.padded_inputs(*inputs)
    want = step(*padded)[:real]
    assert torch.equal(got, want)
    real_slots = slice(0, step.pad_slot)
    assert torch.equal(graph_cache[:, real_slots], step.cache_k[:, real_slots])


def test_breaks_bit_exact_at_every_size_after_interleaved_calls():
    step = VarContextStep()
    runner = CUDAGraphRunner(step, max_batch_size=64, pad={"1": step.pad_slot, "2": 0})
    runner.capture(*step.inputs(64, seed=1))
    assert not runner.stats.failed_captures, runner.stats.table()
    assert {(r.pieces, r.breaks) for r in runner.stats.records} == {(4, 3)}
    sizes = list(runner.capture_sizes) + [3, 5, 13, 27, 50, 63]
    order = sizes * 2
    random.Random(1).shuffle(order)
    for call, n in enumerate(order):
        step.context = (16, 40, 64)[call % 3]  # host state the break reads at every replay
        _check(runner, step, step.inputs(n, seed=1000 + call))
    assert runner.stats.replays == len(order) and runner.stats.eager_calls == 0
    assert runner.stats.break_runs == 3 * len(order)
    runner.release()


def test_without_breaks_the_context_is_baked_in_at_capture():
    step = VarContextStep(breaks=False)
    runner = CUDAGraphRunner(step, max_batch_size=8, pad={"1": step.pad_slot, "2": 0})
    runner.capture(*step.inputs(8, seed=1))
    step.context = 16
    inputs = step.inputs(8, seed=2)
    saved = step.cache_k.clone(), step.cache_v.clone()
    got = runner(*inputs).clone()
    step.cache_k.copy_(saved[0])
    step.cache_v.copy_(saved[1])
    assert not torch.equal(got, step(*inputs))  # the graph still attends over 64 positions
    runner.release()


def test_breaks_hot_path_has_no_host_sync():
    step = VarContextStep()
    runner = CUDAGraphRunner(step, max_batch_size=16, pad={"1": step.pad_slot, "2": 0})
    runner.capture(*step.inputs(16, seed=1))
    calls = [step.inputs(n, seed=n) for n in (1, 3, 16, 9)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for inputs in calls:
            runner(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert runner.stats.replays == 4
    runner.release()


def test_a_host_sync_in_a_piece_fails_that_size_and_the_others_replay():
    step = VarContextStep()

    def step_call(x, slot, pos):
        out = step(x, slot, pos)
        if x.shape[0] == 4:
            out = out + out.sum().item() * 0  # a host sync after the last break
        return out

    runner = CUDAGraphRunner(step_call, max_batch_size=8, pad={"1": step.pad_slot, "2": 0})
    runner.capture(*step.inputs(8, seed=1))
    assert [r.size for r in runner.stats.failed_captures] == [4]
    assert sorted(s for _, s in runner.captured_keys) == [1, 2, 8]
    runner(*step.inputs(3, seed=3))
    assert runner.stats.fallback_count(FallbackReason.CAPTURE_FAILED) == 1
    _check(runner, step, step.inputs(6, seed=4))
    runner.release()


def test_frozen_lazy_runner_falls_back_on_a_new_size():
    step = VarContextStep()
    runner = CUDAGraphRunner(
        step,
        max_batch_size=16,
        pad={"1": step.pad_slot, "2": 0},
        lazy=True,
        policy=CapturePolicy(when_frozen="fallback"),
    )
    runner(*step.inputs(3, seed=4))  # the key's first call is its warm-up, run eagerly
    _check(runner, step, step.inputs(3, seed=5))
    runner.freeze()
    runner(*step.inputs(12, seed=6))
    assert runner.stats.fallback_count(FallbackReason.FROZEN) == 1
    assert runner.captured_keys == [(None, 4)]
    runner.release()


def test_a_break_gets_the_callers_dict_and_list_at_every_replay():
    # The break's arguments are twinned for pool sharing; containers the caller holds must stay
    # the caller's objects, or replays read host state frozen at capture.
    host = {"scale": 1.0}
    log: list[float] = []

    def scaled(q, params, seen):
        seen.append(params["scale"])
        return q * params["scale"]

    def step(x):
        return graph_break(scaled, x + 1, host, log) * 1

    runner = CUDAGraphRunner(step, max_batch_size=4, capture_sizes=[4])
    runner.capture(torch.zeros(4, 2, device=DEV))
    log.clear()
    host["scale"] = 10.0
    out = runner(torch.ones(4, 2, device=DEV))
    assert torch.equal(out, torch.full((4, 2), 20.0, device=DEV))
    assert log == [10.0] and runner.stats.replays == 1
    runner.release()
