"""Prefill through breakable CUDA graphs on a GPU, and the KV cache sized to a memory budget.

Graph prefill gives eager prefill's tokens (bit-identical replays on the padded inputs, near-ties
in bf16 accepted only as in test_engine.py), padded tokens write only the scratch slot, and an
engine built with gpu_memory_utilization stays inside its budget."""

from __future__ import annotations

import pytest
import torch
from test_engine import _assert_equal_or_near_tie

from graphtune.engine import Engine, load_model
from graphtune.engine.prefill import pack_prompts
from graphtune.errors import ConfigError
from graphtune.graphs import FallbackReason

pytestmark = pytest.mark.gpu

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llama_1b():
    return load_model("llama-1b-shape", device="cuda", dtype=torch.bfloat16, seed=0)


@pytest.fixture(scope="module")
def engines(llama_1b):
    common = dict(max_batch_size=8, max_seq_len=160, max_prefill_tokens=512)
    graph = Engine(llama_1b, runner="graph", prefill_runner="graph", **common)
    eager = Engine(llama_1b, runner="graph", prefill_runner="eager", **common)
    yield graph, eager
    graph.release()
    eager.release()


def _prompts(batch: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(100 + batch)
    lengths = torch.randint(3, 120, (batch,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def test_prefill_graphs_are_captured_with_one_break_per_layer(engines):
    graph, _ = engines
    stats = graph.prefill_stats
    layers = graph.config.num_layers
    assert not stats.failed_captures, stats.table()
    assert stats.graphs == len(graph.prefill_runner.capture_sizes)
    assert {r.pieces for r in stats.records} == {layers + 1}
    print(stats.table())


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graph_prefill_tokens_equal_eager_prefill(engines, batch):
    graph, eager = engines
    prompts = _prompts(batch, graph.config.vocab_size)
    stats = graph.prefill_stats
    replays, breaks = stats.replays, stats.break_runs
    want = eager.generate(prompts, NEW_TOKENS, stop_token_ids=[])
    got = graph.generate(prompts, NEW_TOKENS, stop_token_ids=[])
    assert stats.replays > replays and stats.eager_calls == 0, stats.table()
    assert stats.break_runs - breaks == (stats.replays - replays) * graph.config.num_layers
    assert stats.fallback_count(FallbackReason.NO_CUDA) == 0
    _assert_equal_or_near_tie(eager, prompts, got, want, f"batch {batch}: graph prefill")


def test_prefill_replay_is_bit_exact_against_eager_on_the_padded_inputs(engines):
    graph, _ = engines
    step, runner, cache = graph.prefill_step, graph.prefill_runner, graph.cache
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (5, 17, 17, 30)]
    slots = [cache.allocate() for _ in prompts]
    try:
        with torch.inference_mode():
            packed = pack_prompts(prompts, slots)
            inputs = tuple(packed.inputs.cuda())
            step.set_batch(packed.batch)
            got = runner(*inputs).clone()
            k_graph, v_graph = cache.k.clone(), cache.v.clone()
            padded, n, size = runner.padded_inputs(*inputs)
            want = step(*padded)  # writes the same K/V rows again, eagerly
        assert (n, size) == (69, 96)
        assert torch.equal(got, want)
        assert torch.equal(k_graph, cache.k) and torch.equal(v_graph, cache.v)
    finally:
        for slot in slots:
            cache.free(slot)


def test_padded_prefill_tokens_write_only_the_scratch_slot(engines):
    graph, _ = engines
    step, runner, cache = graph.prefill_step, graph.prefill_runner, graph.cache
    slots = [cache.allocate() for _ in range(2)]
    try:
        with torch.inference_mode():
            before_k, before_v = cache.k.clone(), cache.v.clone()
            packed = pack_prompts([[5] * 5, [9] * 7], slots)
            step.set_batch(packed.batch)
            runner(*packed.inputs.cuda())  # 12 tokens padded to 16
            torch.cuda.synchronize()
        others = [s for s in range(cache.max_batch_size) if s not in slots]
        for now, before in ((cache.k, before_k), (cache.v, before_v)):
            assert torch.equal(now[:, others], before[:, others])
            assert torch.equal(now[:, slots[0], :, 5:], before[:, slots[0], :, 5:])
            assert torch.equal(now[:, slots[1], :, 7:], before[:, slots[1], :, 7:])
            scratch = cache.scratch_slot
            assert torch.equal(now[:, scratch, :, 1:], before[:, scratch, :, 1:])
    finally:
        for slot in slots:
            cache.free(slot)


def test_an_admission_round_above_max_prefill_tokens_is_chunked(engines):
    graph, eager = engines
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (100,), generator=gen).tolist() for _ in range(8)]
    stats = graph.prefill_stats
    replays = stats.replays
    want = eager.generate(prompts, 8, stop_token_ids=[])
    got = graph.generate(prompts, 8, stop_token_ids=[])
    assert stats.replays - replays == 2 and stats.eager_calls == 0  # 500 + 300 tokens
    _assert_equal_or_near_tie(eager, prompts, got, want, "chunked prefill")


def _fraction_leaving(extra_bytes: int) -> float:
    """The gpu_memory_utilization that leaves ``extra_bytes`` above what is in use now (earlier
    tests of this process may still hold memory)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return min(1.0, (total - free + extra_bytes) / total)


def test_memory_plan_keeps_the_engine_inside_its_budget(llama_1b):
    # 24 GiB above what is in use: room for a handful of 2 GiB slots after the graphs and the
    # activations, which include one eager prefill of a whole 65536-token prompt (the longest a
    # slot admits, which the plan profiles).
    engine = Engine(
        llama_1b,
        max_batch_size=32,
        max_seq_len=65536,
        max_prefill_tokens=2048,
        gpu_memory_utilization=_fraction_leaving(24 << 30),
    )
    try:
        plan = engine.memory_plan
        print(plan.table())
        assert 1 <= plan.slots < 32 and engine.max_batch_size == plan.slots
        assert plan.profile.graph_bytes > 0 and plan.profile.activation_bytes > 0
        assert plan.headroom_bytes >= 0
        assert plan.measured_in_use_bytes <= 1.02 * plan.budget_bytes, plan.table()
        out = engine.generate([[1, 2, 3]] * (plan.slots + 2), 4, stop_token_ids=[])
        assert [len(o) for o in out] == [4] * (plan.slots + 2)
    finally:
        engine.release()


def test_memory_plan_refuses_when_one_slot_does_not_fit(llama_1b):
    with pytest.raises(ConfigError, match="less than one slot of max_seq_len=131072"):
        Engine(  # 2 GiB left, a slot of 131072 positions needs 4 GiB
            llama_1b,
            max_batch_size=4,
            max_seq_len=131072,
            gpu_memory_utilization=_fraction_leaving(2 << 30),
        )


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_moe_graph_prefill_and_decode_give_the_eager_tokens(preset):
    # Untuned, an MoE layer inside a CUDA graph runs every expert on every token (the dense
    # form), eagerly the loop over the selected experts: the same tokens in float32. (The CPU's
    # simulated backend cannot show this: it records the loop's data-dependent ops as they ran.)
    model = load_model(preset, device="cuda", dtype=torch.float32, seed=0)
    common = dict(max_batch_size=4, max_seq_len=64, max_prefill_tokens=64)
    graph = Engine(model, runner="graph", prefill_runner="graph", **common)
    eager = Engine(model, runner="eager", **common)
    try:
        default = Engine(model, lazy_capture=True, **common)  # runner="graph"
        assert type(default.prefill_runner).__name__ == "EagerRunner"
        default.release()
        prompts = _prompts(3, model.config.vocab_size)
        prompts = [p[:20] for p in prompts]
        want = eager.generate(prompts, 8, stop_token_ids=[])
        assert graph.generate(prompts, 8, stop_token_ids=[]) == want
        assert graph.prefill_stats.replays > 0 and graph.prefill_stats.eager_calls == 0
        assert graph.stats.replays > 0 and graph.stats.eager_calls == 0
    finally:
        graph.release()
        eager.release()
