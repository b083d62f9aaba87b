"""Graph output memory on CPU: outputs as non-owning twins, what a caller may hold, accounting.

The simulated backend models memory sharing pessimistically (see graphtune.graphs.simulated):
memory the runner gave back to the pool is overwritten whenever another graph of the pool
replays, and at release(). So a test that reads an output past its documented lifetime sees
garbage here, and outputs that must survive (clones, the step's own tensors) are checked.
"""

from __future__ import annotations

import pytest
import torch

from graphtune.engine.build import ENGINE_POOL_SLACK_BYTES, build_runner, build_step
from graphtune.engine.kv_cache import KVCache
from graphtune.engine.loading import load_model
from graphtune.errors import ConfigError
from graphtune.graphs import CapturePolicy, CUDAGraphRunner, SimulatedGraphBackend
from graphtune.graphs.memory import Disowner

HIDDEN = 4


class Step:
    """Returns fresh tensors (aliased in two ways) and a persistent buffer it owns."""

    def __init__(self) -> None:
        self.w = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(1))
        self.total = torch.zeros(HIDDEN)

    def __call__(self, x):
        h = torch.tanh(x @ self.w)
        self.total.add_(h.sum(0))
        return {"h": h, "head": h[:, :2], "hv": h.view(-1, 2, 2)}, self.total


def make(**kwargs):
    step = Step()
    kwargs.setdefault("backend", SimulatedGraphBackend())
    runner = CUDAGraphRunner(step, max_batch_size=8, **kwargs)
    runner.capture(torch.zeros(8, HIDDEN))
    return runner, step


def test_disowner_twins_alias_the_original_memory_and_each_other():
    base = torch.arange(12.0).view(3, 4)
    twins = Disowner()
    out = twins.tree({"a": base, "b": base[1:, ::2], "c": base.t(), "n": 3})
    assert out["n"] == 3 and len(twins.storages) == 1
    for name, original in (("a", base), ("b", base[1:, ::2]), ("c", base.t())):
        twin = out[name]
        assert twin is not original
        assert twin.data_ptr() == original.data_ptr()
        assert (twin.shape, twin.stride()) == (original.shape, original.stride())
    base.add_(100)
    assert torch.equal(out["b"], base[1:, ::2])
    param = torch.nn.Parameter(torch.ones(2))
    assert twins.tensor(param) is param and twins.kept == 1


def test_disowner_keeps_tensors_of_other_devices_owning():
    # Capturing on CUDA, a host tensor the step made (and returns, or hands to a graph break)
    # is not pool memory: a twin of it would read freed host memory once the capture's owner
    # is dropped.
    twins = Disowner("cuda")
    host = torch.arange(4.0)
    assert twins.tensor(host) is host and twins.kept == 1 and twins.storages == []
    assert Disowner("cpu").tensor(host) is not host  # the capture device's own tensors twin


def test_outputs_are_twins_and_the_record_says_so():
    runner, _ = make()
    graph = runner._keys[None].graphs[8]
    assert graph.shared and all(r.shared_outputs for r in runner.stats.records)
    out, total = runner(torch.randn(8, HIDDEN))
    assert out["head"].data_ptr() == out["h"].data_ptr()  # aliasing survived the twinning
    assert out["hv"].data_ptr() == out["h"].data_ptr()
    torch.testing.assert_close(out["hv"], out["h"].view(-1, 2, 2), rtol=0, atol=0)


def test_output_is_valid_until_the_next_call_and_a_clone_survives():
    runner, step = make()
    x4, x8 = torch.randn(4, HIDDEN), torch.randn(8, HIDDEN)
    out, _ = runner(x4)
    torch.testing.assert_close(out["h"], torch.tanh(x4 @ step.w), rtol=0, atol=0)
    kept = out["h"]
    copy = out["h"].clone()
    runner(x8)  # another size's graph may reuse the memory of this size's outputs
    assert torch.isnan(kept).all(), "the simulated pool overwrites memory other graphs reuse"
    torch.testing.assert_close(copy, torch.tanh(x4 @ step.w), rtol=0, atol=0)


def test_clone_outputs_survive_calls_of_other_sizes_and_release():
    runner, step = make(clone_outputs=True)
    xs = [torch.randn(n, HIDDEN) for n in (3, 8, 1, 5)]
    outs = [runner(x)[0]["h"] for x in xs]
    runner.release()
    for x, out in zip(xs, outs, strict=True):
        torch.testing.assert_close(out, torch.tanh(x @ step.w), rtol=0, atol=0)


def test_the_steps_own_tensors_stay_valid_across_calls_and_release():
    runner, step = make()
    _, total = runner(torch.randn(2, HIDDEN))
    runner(torch.randn(8, HIDDEN))
    assert torch.equal(total, step.total)  # a twin of memory the step owns: never reused
    runner.release()
    assert torch.isfinite(step.total).all()


def test_outputs_kept_after_release_are_invalidated():
    runner, _ = make()
    out, _ = runner(torch.randn(8, HIDDEN))
    kept = out["h"]
    runner.release()
    assert torch.isnan(kept).all()  # on a GPU, reading it raises RuntimeError instead


def test_outputs_kept_after_the_runner_is_collected_are_invalidated():
    import gc

    backend = SimulatedGraphBackend()  # kept: its memory stands in for the device's
    runner, _ = make(backend=backend)
    out, _ = runner(torch.randn(8, HIDDEN))
    kept = out["h"]
    del runner, out
    gc.collect()
    assert torch.isnan(kept).all()  # as after release(): on a GPU, reading it raises


def test_share_output_memory_off_keeps_one_owning_output_set_per_size():
    runner, step = make(policy=CapturePolicy(share_output_memory=False))
    assert not any(r.shared_outputs for r in runner.stats.records)
    assert not runner._keys[None].graphs[8].shared
    x4 = torch.randn(4, HIDDEN)
    kept = runner(x4)[0]["h"]
    runner(torch.randn(8, HIDDEN))
    torch.testing.assert_close(kept, torch.tanh(x4 @ step.w), rtol=0, atol=0)


class CountingBackend(SimulatedGraphBackend):
    """Reserved memory that grows by a given amount per captured piece (a fake allocator)."""

    def __init__(self, growth) -> None:
        super().__init__()
        self.growth = growth
        self.reserved = 1000
        self.reads = 0

    def begin_capture(self, pool, device):
        graph = super().begin_capture(pool, device)
        self.reserved += self.growth.pop(0)
        return graph

    def memory_reserved(self, device):
        self.reads += 1
        return self.reserved


def test_pool_bytes_are_reserved_growth_per_capture_without_sync_or_empty_cache():
    backend = CountingBackend([600, 30, 0, 10])
    runner = CUDAGraphRunner(lambda x: x * 2, max_batch_size=8, backend=backend)
    runner.capture(torch.ones(8, 2))
    by_size = {r.size: r.pool_bytes for r in runner.stats.records}
    assert by_size == {8: 600, 4: 30, 2: 0, 1: 10}
    assert backend.reads == 8  # one reading before and one after each capture
    assert backend.empty_cache_calls == 0 and backend.synchronize_calls == 0
    stats = runner.stats
    assert stats.pool_bytes == 640 and stats.largest_graph_pool_bytes == 600
    assert stats.pool_vs_largest == pytest.approx(640 / 600)
    text = stats.table()
    assert "largest size alone MiB" in text and "pool / largest size" in text
    data = stats.as_dict()
    assert data["largest_graph_pool_bytes"] == 600 and data["pool_vs_largest"] == pytest.approx(
        640 / 600
    )
    assert {"record", "finish", "break", "account"} == set(data["capture_phases"])
    for record in data["records"]:
        assert record["extra_key"] == "None" and record["pieces"] == 1


def test_capture_phases_add_up_to_at_most_the_capture_time():
    runner, _ = make()
    for r in runner.stats.records:
        phases = r.record_seconds + r.finish_seconds + r.break_seconds + r.account_seconds
        assert 0 < phases <= r.seconds
        assert r.record_seconds > 0 and r.account_seconds > 0
    warmups = [r.warmup_seconds for r in runner.stats.records]  # largest first
    assert warmups[0] == pytest.approx(runner.stats.warmup_seconds) and not any(warmups[1:])


def test_lazy_capture_records_each_sizes_own_warmup():
    runner = CUDAGraphRunner(
        Step(),
        max_batch_size=8,
        lazy=True,
        backend=SimulatedGraphBackend(),
        policy=CapturePolicy(warm_each_size=True),
    )
    for n in (3, 3, 7, 7):  # each size: its warm-up call, then its capture
        runner(torch.randn(n, HIDDEN))
    assert len(runner.stats.records) == 2
    assert all(r.warmup_seconds > 0 for r in runner.stats.records)


def test_pool_slack_is_held_during_the_first_capture_into_a_fresh_pool_only():
    slack = CapturePolicy(pool_slack_bytes=10 << 20)
    backend = SimulatedGraphBackend()
    runner, _ = make(backend=backend, policy=slack)  # sizes 1, 2, 4, 8: largest first, one pool
    assert backend.slack_requests == [10 << 20]
    runner.release()
    runner.capture(torch.zeros(8, HIDDEN))  # a new pool after release: slack once more
    assert backend.slack_requests == [10 << 20] * 2
    single = SimulatedGraphBackend()
    make(backend=single, capture_sizes=[8], policy=slack)  # one size: nothing drifts
    default = SimulatedGraphBackend()
    make(backend=default)  # a generic runner holds none by default
    assert single.slack_requests == [] and default.slack_requests == []


def test_the_engines_runners_hold_the_engine_slack():

    model = load_model("tiny", device="cpu", dtype=torch.float32)
    step = build_step(model, KVCache(model.config, 4, 16, model.device, torch.float32))
    backend = SimulatedGraphBackend()
    runner = build_runner(step, "graph", backend=backend)
    runner.capture(*step.example_inputs(4))
    assert backend.slack_requests == [ENGINE_POOL_SLACK_BYTES] == [10 << 20]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "20MiB"])
def test_pool_slack_must_be_a_byte_count(bad):
    with pytest.raises(ConfigError, match="pool_slack_bytes"):
        CapturePolicy(pool_slack_bytes=bad)
