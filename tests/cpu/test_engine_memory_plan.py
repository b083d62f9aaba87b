"""The KV cache sized to gpu_memory_utilization, on CPU: a fake memory report drives the real
profiling and sizing (the steps run, the graph runners capture on the simulated backend)."""

from __future__ import annotations

import pytest
import torch

from graphtune.engine import Engine, load_model
from graphtune.engine.kv_cache import aligned_seq_len, kv_bytes_per_token
from graphtune.engine.memory_plan import (
    MemoryPlan,
    StepProfile,
    check_fraction,
    model_bytes,
    profile_step_memory,
    size_kv_cache,
)
from graphtune.engine.parallel import ParallelContext, shard_model
from graphtune.engine.prefill import plan_chunks
from graphtune.errors import ConfigError
from graphtune.graphs import SimulatedGraphBackend

MIB = 1 << 20


class FakeMemoryReport:
    """A device of ``total`` bytes with ``in_use`` bytes taken before the engine; every eager
    run peaks ``activation`` bytes above what is allocated."""

    def __init__(self, total: int, in_use: int, activation: int = 0) -> None:
        self.total, self.in_use, self.activation = total, in_use, activation
        self.allocated = 0
        self.settles = 0

    def device_bytes(self) -> tuple[int, int]:
        return self.total - self.in_use, self.total

    def allocated_bytes(self) -> int:
        return self.allocated

    def peak_allocated_bytes(self) -> int:
        return self.allocated + self.activation

    def reset_peak(self) -> None:
        pass

    def settle(self) -> None:
        self.settles += 1


class GrowingPoolBackend(SimulatedGraphBackend):
    """The simulated backend whose reserved memory grows by ``step`` bytes per reading, so every
    captured piece adds ``step`` bytes to its runner's pool."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.reserved = step, 0

    def memory_reserved(self, device) -> int:
        self.reserved += self.step
        return self.reserved


SEQ = 64


def _slot_bytes(model) -> int:
    return aligned_seq_len(SEQ) * kv_bytes_per_token(model.config, model.dtype.itemsize)


def _profile(**kwargs) -> StepProfile:
    fields = dict(batch=8, prefill_tokens=64, step_bytes=0, activation_bytes=0, graph_bytes=0)
    return StepProfile(**{**fields, **kwargs})


def test_size_kv_cache_fits_what_is_left_and_caps_at_the_asked_slots():
    profile = _profile(step_bytes=10, activation_bytes=20, graph_bytes=30)
    common = dict(total_bytes=1000, in_use_bytes=340, profile=profile, slot_bytes=50, seq_len=16)
    # Budget 900: 900 - 340 - 60 = 500 bytes = 10 slots, one of them the scratch slot.
    assert size_kv_cache(fraction=0.9, asked_slots=64, **common) == 9
    assert size_kv_cache(fraction=0.9, asked_slots=4, **common) == 4
    # 500 - 340 - 60 = 100 bytes: one slot and the scratch slot.
    assert size_kv_cache(fraction=0.5, asked_slots=4, **common) == 1
    with pytest.raises(ConfigError, match="less than one slot of max_seq_len=16") as info:
        size_kv_cache(fraction=0.49, asked_slots=4, **common)
    message = str(info.value)
    assert "raise gpu_memory_utilization, lower max_seq_len" in message and "\n" not in message


@pytest.mark.parametrize("bad", [0, 0.0, 1.5, -0.2, "0.9", True, None])
def test_fraction_must_be_in_zero_one(bad):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        check_fraction(bad)
    assert check_fraction(1) == 1.0


def test_engine_sizes_its_kv_cache_from_the_fake_report_and_shows_the_plan():
    model = load_model("tiny")
    slot = _slot_bytes(model)
    weights = model_bytes(model)
    # 1 GiB device at fraction 0.5; leave exactly 5 slots (+ scratch) after in use + activations.
    budget = (1 << 30) // 2
    activation = 3 * MIB
    in_use = budget - activation - 6 * slot - slot // 2
    report = FakeMemoryReport(1 << 30, in_use, activation)
    engine = Engine(
        model,
        runner="eager",
        max_batch_size=16,
        max_seq_len=SEQ,
        gpu_memory_utilization=0.5,
        memory_report=report,
    )
    plan = engine.memory_plan
    assert isinstance(plan, MemoryPlan)
    assert plan.slots == 5 and plan.asked_slots == 16
    assert engine.max_batch_size == 5 and engine.cache.max_batch_size == 5
    assert engine.cache.nbytes == plan.kv_bytes == 6 * slot
    assert plan.profile.activation_bytes == activation and plan.profile.graph_bytes == 0
    assert plan.profile.batch == 16 and plan.weights_bytes == weights
    assert 0 <= plan.headroom_bytes < slot
    assert plan.measured_in_use_bytes == in_use  # the fake device does not move
    table = plan.table()
    for part in (
        "budget (0.5",
        "weights",
        "activations",
        "CUDA graphs",
        "KV cache (5 slots",
        "headroom",
    ):
        assert part in table
    assert plan.as_dict()["slots"] == 5
    # The engine serves with the cache it got.
    out = engine.generate([[1, 2, 3]] * 7, 2, stop_token_ids=[])
    assert [len(o) for o in out] == [2] * 7


def _graph_engine(model, in_use, backend, **kwargs):
    kwargs.setdefault("max_prefill_tokens", 64)
    return Engine(
        model,
        max_seq_len=SEQ,
        gpu_memory_utilization=0.5,
        memory_report=FakeMemoryReport(1 << 30, in_use),
        graph_backend=backend,
        **kwargs,
    )


def test_graph_pools_and_buffers_are_profiled_and_leave_fewer_slots():
    model = load_model("tiny")
    slot = _slot_bytes(model)
    in_use = (1 << 29) - 100 * slot
    plain = _graph_engine(model, in_use, SimulatedGraphBackend(), max_batch_size=64)
    buffers = plain.memory_plan.profile.graph_bytes  # static buffers only: no pool on the CPU
    assert buffers > 0 and plain.memory_plan.slots == 64
    piece = 2 * slot
    growing = _graph_engine(model, in_use, GrowingPoolBackend(piece), max_batch_size=64)
    plan = growing.memory_plan
    # Profiled: every decode size up to 64 (one piece each) and every prefill bucket (a piece
    # per layer and one more); the runners then capture again for the real cache.
    pieces = len(plain.runner.capture_sizes)
    pieces += len(plain.prefill_runner.capture_sizes) * (model.config.num_layers + 1)
    assert plan.profile.graph_bytes == buffers + piece * pieces
    left = 100 * slot - plan.profile.graph_bytes - plan.profile.step_bytes
    assert plan.slots == min(64, left // slot - 1) < 64
    assert growing.max_batch_size == plan.slots
    assert growing.stats.graphs == len(growing.runner.capture_sizes)
    assert growing.prefill_stats.graphs == len(growing.prefill_runner.capture_sizes)


def test_capture_sizes_above_the_slots_become_the_slots():
    # Dropped, they left a batch of 3 with no graph to pad to: every such decode step ran eagerly.
    model = load_model("tiny")
    slot = _slot_bytes(model)
    probe = _graph_engine(model, 0, SimulatedGraphBackend(), max_batch_size=8)
    need = probe.memory_plan.profile.graph_bytes + probe.memory_plan.profile.step_bytes
    in_use = (1 << 29) - need - 4 * slot
    engine = _graph_engine(
        model, in_use, SimulatedGraphBackend(), max_batch_size=8, capture_sizes=[1, 2, 4, 8]
    )
    assert engine.max_batch_size == 3 and engine.runner.capture_sizes == (1, 2, 3)
    prompts = [[1, 2], [3], [4, 5, 6]]
    engine.generate(prompts, 4)
    assert engine.stats.replays > 0 and not engine.stats.fallbacks


def test_not_even_one_slot_is_a_clear_error():
    model = load_model("tiny")
    report = FakeMemoryReport(1 << 30, (1 << 29) - _slot_bytes(model))
    with pytest.raises(ConfigError, match="less than one slot of max_seq_len=64"):
        Engine(
            model,
            runner="eager",
            max_seq_len=SEQ,
            gpu_memory_utilization=0.5,
            memory_report=report,
        )


def test_tensor_parallel_shards_are_refused():
    shard = shard_model(load_model("tiny"), ParallelContext(None, 0, 2, all_reduce_backend="nccl"))
    with pytest.raises(ConfigError, match="tensor-parallel"):
        Engine(
            shard,
            runner="eager",
            max_seq_len=SEQ,
            gpu_memory_utilization=0.5,
            memory_report=FakeMemoryReport(1 << 30, 0),
        )


class GrowingInUseReport(FakeMemoryReport):
    """A device where ``grow`` more bytes are in use at every reading after the first
    ``planned`` (the plan reads before and after profiling): the engine's start takes more than
    it planned."""

    def __init__(self, total: int, in_use: int, grow: int, planned: int = 2) -> None:
        super().__init__(total, in_use)
        self.grow, self.readings, self.planned = grow, 0, planned

    def device_bytes(self) -> tuple[int, int]:
        self.readings += 1
        if self.readings > self.planned:
            self.in_use += self.grow
        return super().device_bytes()


class RetainingReport(FakeMemoryReport):
    """A device where profiling leaves ``kept`` bytes in use (the first peak measured takes them
    for good), as a caching allocator that keeps segments it cannot return."""

    def __init__(self, total: int, in_use: int, kept: int) -> None:
        super().__init__(total, in_use)
        self.kept = kept

    def reset_peak(self) -> None:
        self.in_use += self.kept
        self.kept = 0


def test_memory_that_profiling_keeps_counts_against_the_kv_cache():
    model = load_model("tiny")
    slot = _slot_bytes(model)
    budget = (1 << 30) // 2
    in_use = budget - 10 * slot - slot // 2  # 9 slots and the scratch slot fit
    common = dict(runner="eager", max_batch_size=16, max_seq_len=SEQ, gpu_memory_utilization=0.5)
    plain = Engine(model, memory_report=FakeMemoryReport(1 << 30, in_use), **common)
    assert plain.memory_plan.slots == 9 and plain.memory_plan.profile.retained_bytes == 0
    report = RetainingReport(1 << 30, in_use, kept=3 * slot)
    engine = Engine(model, memory_report=report, **common)
    plan = engine.memory_plan
    assert plan.profile.retained_bytes == 3 * slot
    assert plan.slots == 6 and engine.cache.max_batch_size == 6
    assert plan.headroom_bytes >= 0 and plan.over_budget_bytes == 0
    assert plan.measured_in_use_bytes == in_use + 3 * slot
    assert "kept after profiling" in plan.table()
    assert plan.as_dict()["retained_bytes"] == 3 * slot


def test_an_engine_over_its_budget_after_start_up_says_so(caplog):
    model = load_model("tiny")
    fine = Engine(
        model,
        runner="eager",
        max_seq_len=SEQ,
        gpu_memory_utilization=0.5,
        memory_report=FakeMemoryReport(1 << 30, 1 << 28),
    )
    assert fine.memory_plan.over_budget_bytes == 0
    assert "over the budget" not in caplog.text
    report = GrowingInUseReport(1 << 30, 1 << 28, grow=3 << 27)
    engine = Engine(
        model, runner="eager", max_seq_len=SEQ, gpu_memory_utilization=0.5, memory_report=report
    )
    plan = engine.memory_plan
    assert plan.over_budget_bytes > 0.01 * plan.budget_bytes
    assert plan.over_budget_bytes == plan.measured_in_use_bytes - plan.budget_bytes
    assert "over the budget of gpu_memory_utilization=0.5" in caplog.text
    assert "measured in use after start-up" in caplog.text  # the table comes with it


class LargestTensorReport(FakeMemoryReport):
    """Peak: the bytes of the largest tensor an op made between ``reset_peak`` and
    ``peak_allocated_bytes`` (a stand-in for a device's peak that grows with a call's tokens)."""

    def reset_peak(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        report = self

        class Largest(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        report.activation = max(report.activation, t.nbytes)
                return out

        self.activation = 0
        self._mode = Largest()
        self._mode.__enter__()

    def peak_allocated_bytes(self) -> int:
        self._mode.__exit__(None, None, None)
        return super().peak_allocated_bytes()


def test_a_prompt_longer_than_a_prefill_call_is_profiled_too():
    # A prompt longer than max_prefill_tokens runs eagerly as a call of its own; its activations
    # (and a windowed model's [L, L] mask) must be in the plan, or the slots do not fit.
    model = load_model("tiny")

    def profile(seq_len):
        return profile_step_memory(
            model,
            batch=2,
            seq_len=seq_len,
            report=LargestTensorReport(1 << 30, 0),
            runner="eager",
            prefill_runner="eager",
            max_prefill_tokens=32,
        )

    short, long = profile(32), profile(256)
    assert (short.prefill_tokens, long.prefill_tokens) == (32, 256)
    assert long.activation_bytes > short.activation_bytes


@pytest.mark.parametrize(
    "seq_len, batch, tokens",
    [(80, 8, 128), (48, 8, 128), (80, 1, 80), (128, 8, 128), (16, 2, 32)],
)
def test_the_profiled_prefill_call_is_as_large_as_the_engine_packs(seq_len, batch, tokens):
    # The engine packs up to max_prefill_tokens tokens (max_batch_size prompts, each at most a
    # slot long) into one call; a smaller profiled call budgets too little activation memory.
    model = load_model("tiny")
    profile = profile_step_memory(
        model,
        batch=batch,
        seq_len=seq_len,
        report=FakeMemoryReport(1 << 30, 0),
        runner="eager",
        prefill_runner="eager",
        max_prefill_tokens=128,
    )
    assert profile.prefill_tokens == tokens


@pytest.mark.parametrize("seq_len, batch", [(80, 8), (48, 8), (80, 1), (300, 4), (16, 2)])
def test_the_largest_prefill_call_is_one_call_of_plan_chunks(seq_len, batch):
    from graphtune.engine.memory_plan import largest_prefill_call

    lengths = largest_prefill_call(seq_len, 128, batch)
    assert plan_chunks(lengths, 128, batch) == [range(len(lengths))]
    assert max(lengths) == min(seq_len, 128) and len(lengths) <= batch
    assert sum(lengths) == min(128, batch * seq_len)
