"""Prefill through breakable graphs on CPU (simulated graph backend): packing, buckets, the
attention break against a per-prompt reference, bit-exact replays, the scratch slot, and the
engine's tokens against eager prefill."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphtune.engine import DecodeStep, Engine, KVCache, get_preset, load_model, prefill
from graphtune.engine.attention import PrefillAttention, PrefillBatch, PromptRun, causal_mask
from graphtune.engine.build import build_prefill_runner, build_prefill_step
from graphtune.engine.prefill import (
    PrefillStep,
    _check_prefill_inputs,
    pack_prompts,
    plan_chunks,
    prefill_capture_sizes,
    prefill_logits,
    prefill_pad_rule,
)
from graphtune.errors import ConfigError, InputError
from graphtune.graphs import FallbackReason, SimulatedGraphBackend

PROMPTS = [[1, 5, 9], [7, 8, 2], [3, 4, 5, 6, 7, 8], [10, 11], [12, 13, 14], [15]]
LIMITS = [6, 9, 3, 12, 1, 7]


def test_prefill_buckets_are_powers_of_two_and_one_and_a_half_times_them():
    assert prefill_capture_sizes(2048) == (
        16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
    )  # fmt: skip
    assert prefill_capture_sizes(100) == (16, 24, 32, 48, 64, 96, 100)
    assert prefill_capture_sizes(5) == (5,)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="max_prefill_tokens"):
            prefill_capture_sizes(bad)


def test_pack_prompts_lays_out_rows_and_groups_equal_lengths():
    packed = pack_prompts([[1, 2, 3], [4, 5, 6], [7], [8, 9]], [2, 3, 0, 5])
    tokens, positions, slots, logit_rows = packed.inputs.tolist()
    assert tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert positions == [0, 1, 2, 0, 1, 2, 0, 0, 1]
    assert slots == [2, 2, 2, 3, 3, 3, 0, 5, 5]
    assert logit_rows == [2, 5, 6, 8, 0, 0, 0, 0, 0]  # each prompt's last token, then row 0
    runs = packed.batch.runs
    assert runs == (PromptRun(0, 3, (2, 3)), PromptRun(6, 1, (0,)), PromptRun(7, 2, (5,)))
    assert runs[0].contiguous and packed.batch.tokens == 9 and packed.prompts == 4
    assert not PromptRun(0, 3, (3, 1)).contiguous
    with pytest.raises(ConfigError, match="one slot per prompt"):
        pack_prompts([[1]], [0, 1])
    with pytest.raises(ConfigError, match="at least one token"):
        pack_prompts([[1], []], [0, 1])


def test_plan_chunks_bounds_tokens_and_prompts_and_isolates_long_prompts():
    assert plan_chunks([3, 3, 3, 3], 8, 8) == [range(0, 2), range(2, 4)]
    assert plan_chunks([3, 3, 3, 3], 100, 3) == [range(0, 3), range(3, 4)]
    assert plan_chunks([2, 20, 2, 2], 8, 8) == [range(0, 1), range(1, 2), range(2, 4)]
    assert plan_chunks([20], 8, 8) == [range(0, 1)]
    assert plan_chunks([], 8, 8) == []


def _reference_attention(step, q, layer, prompts_and_slots):
    """Per prompt, the attention prefill ran before packing: a causal mask and K/V repeated per
    query head (float32 math)."""
    cfg = step.model.config
    outs, start = [], 0
    for length, slot in prompts_and_slots:
        positions = step.key_positions[:length]
        mask = causal_mask(positions, positions, step.zero, step.neg_inf, cfg.sliding_window)
        keys = step.cache.k_layers[layer][slot, :, :length].repeat_interleave(step.groups, dim=0)
        values = step.cache.v_layers[layer][slot, :, :length].repeat_interleave(step.groups, 0)
        attn = F.scaled_dot_product_attention(
            q[start : start + length].transpose(0, 1), keys, values, attn_mask=mask
        )
        outs.append(attn.transpose(0, 1).reshape(length, -1))
        start += length
    return torch.cat(outs)


@pytest.mark.parametrize(
    "preset, dtype",
    [("tiny", torch.float32), ("tiny", torch.bfloat16), ("mistral-tiny", torch.float32)],
)
def test_packed_attention_matches_one_prompt_at_a_time(preset, dtype):
    config = get_preset(preset)
    if config.sliding_window is not None:
        config = config.replace(sliding_window=4)  # shorter than the longest prompt
    model = load_model(config, dtype=dtype)  # bf16: grouped K/V straight into SDPA
    cfg = model.config
    cache = KVCache(cfg, 6, 32, dtype=dtype)
    step = DecodeStep(model, cache)
    gen = torch.Generator().manual_seed(0)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    # Mixed lengths, a run of equal lengths in non-consecutive slots, one in consecutive slots;
    # the sliding window (mistral-tiny) is shorter than the longest prompt.
    lengths = [5, 5, 12, 3, 3, 1]
    slots = [4, 1, 0, 2, 3, 5]
    packed = pack_prompts([[0] * n for n in lengths], slots)
    total = sum(lengths)
    q = torch.randn(total + 4, cfg.num_heads, cfg.dim_per_head, generator=gen).to(dtype)
    attention = PrefillAttention(step, rows=64)
    attention.batch = packed.batch
    with torch.inference_mode():
        out = attention(1, q)
        want = _reference_attention(step, q, 1, list(zip(lengths, slots, strict=True)))
    assert out.shape == (total + 4, cfg.num_heads * cfg.dim_per_head)
    assert out.data_ptr() == attention.buffer.data_ptr()  # written into the owned buffer
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:total], want, rtol=tol, atol=tol)
    assert torch.count_nonzero(out[total:]) == 0  # the 4 padded rows are zeros


def _prefill_engine_parts(max_tokens=32, slots=4, seq=64):
    model = load_model("tiny")
    cache = KVCache(model.config, slots, seq)
    step = DecodeStep(model, cache, contiguous_slots=True)
    prefill_step = build_prefill_step(step, max_tokens)
    runner = build_prefill_runner(prefill_step, "graph", backend=SimulatedGraphBackend())
    return model, cache, step, prefill_step, runner


def test_prefill_replay_is_bit_exact_against_eager_on_the_padded_inputs():
    _, cache, step, prefill_step, runner = _prefill_engine_parts()
    with torch.inference_mode():
        runner.capture(*prefill_step.example_inputs(32))
        layers = step.model.config.num_layers
        assert {r.pieces for r in runner.stats.records} == {layers + 1}
        assert {r.breaks for r in runner.stats.records} == {layers}
        packed = pack_prompts([[1, 2, 3], [4, 5, 6], [9, 8, 7, 6, 5]], [0, 1, 3])
        prefill_step.set_batch(packed.batch)
        inputs = tuple(packed.inputs)
        got = runner(*inputs).clone()
        k_got, v_got = cache.k.clone(), cache.v.clone()
        padded, n, size = runner.padded_inputs(*inputs)
        assert (n, size) == (11, 16)
        cache.k.zero_()
        cache.v.zero_()
        want = prefill_step(*padded)
    assert runner.stats.replays == 1 and runner.stats.break_runs == layers
    assert got.shape == want.shape == (4, step.model.config.vocab_size)  # min(16, 4 prompts)
    assert torch.equal(got, want)
    assert torch.equal(k_got, cache.k) and torch.equal(v_got, cache.v)


def test_padded_prefill_tokens_write_only_the_scratch_slot():
    _, cache, _, prefill_step, runner = _prefill_engine_parts()
    gen = torch.Generator().manual_seed(1)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    with torch.inference_mode():
        runner.capture(*prefill_step.example_inputs(32))
        before_k, before_v = cache.k.clone(), cache.v.clone()
        packed = pack_prompts([[1, 2, 3], [4, 5]], [1, 2])
        prefill_step.set_batch(packed.batch)
        runner(*packed.inputs)  # 5 tokens padded to 16
    assert runner.stats.padded_rows == 16
    scratch = cache.scratch_slot
    for now, before in ((cache.k, before_k), (cache.v, before_v)):
        # Slots 0 and 3 and the positions past each prompt are untouched byte for byte.
        assert torch.equal(now[:, 0], before[:, 0]) and torch.equal(now[:, 3], before[:, 3])
        assert torch.equal(now[:, 1, :, 3:], before[:, 1, :, 3:])
        assert torch.equal(now[:, 2, :, 2:], before[:, 2, :, 2:])
        # Padded tokens (token 0 at position 0) write position 0 of the scratch slot only.
        assert torch.equal(now[:, scratch, :, 1:], before[:, scratch, :, 1:])
    assert prefill_pad_rule(scratch) == (0, 0, scratch, 0)


def test_prefill_logits_in_several_calls_equal_one_call():
    _, _, step, prefill_step, runner = _prefill_engine_parts()
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with torch.inference_mode():
        runner.capture(*prefill_step.example_inputs(32))
        one = prefill_logits(prefill_step, runner, prompts, [0, 1, 2]).clone()
        calls = runner.stats.calls
        several = prefill_logits(prefill_step, runner, prompts, [0, 1, 2], max_tokens=4)
        assert runner.stats.calls - calls == 3
        pairs = zip(prompts, [0, 1, 2], strict=True)
        solo = torch.stack([prefill(step, torch.tensor(p), s) for p, s in pairs])
    torch.testing.assert_close(several, one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, solo, rtol=1e-5, atol=1e-5)


def _engine(preset="tiny", **kwargs):
    kwargs.setdefault("max_batch_size", 4)
    kwargs.setdefault("max_seq_len", 64)
    return Engine(load_model(preset), **kwargs)


def test_prefill_graphs_with_qk_norms_give_the_eager_tokens():
    # Qwen3's q/k RMSNorm runs in the QKV stage of the same forward (dense layers only here).
    config = get_preset("qwen3-moe-tiny").replace(name="qwen3-dense-tiny", mlp_only_layers=(0, 1))
    engines = [
        Engine(load_model(config), max_batch_size=4, max_seq_len=64, runner=kind, **extra)
        for kind, extra in (("eager", {}), ("graph", {"graph_backend": SimulatedGraphBackend()}))
    ]
    want, got = (e.generate(PROMPTS, LIMITS, stop_token_ids=[]) for e in engines)
    assert got == want
    assert engines[1].prefill_stats.replays >= 2 and engines[1].prefill_stats.eager_calls == 0


def test_a_mixture_of_experts_model_prefills_eagerly_by_default():
    engine = _engine("mixtral-tiny", runner="graph", graph_backend=SimulatedGraphBackend())
    assert type(engine.prefill_runner).__name__ == "EagerRunner"
    assert type(engine.runner).__name__ == "CUDAGraphRunner"
    asked = _engine("mixtral-tiny", prefill_runner="graph", graph_backend=SimulatedGraphBackend())
    assert type(asked.prefill_runner).__name__ == "CUDAGraphRunner"


def test_engine_prefill_graphs_give_the_eager_engines_tokens():
    eager = _engine(runner="eager")
    graph = _engine(runner="graph", graph_backend=SimulatedGraphBackend())
    want = eager.generate(PROMPTS, LIMITS, stop_token_ids=[])
    got = graph.generate(PROMPTS, LIMITS, stop_token_ids=[])
    assert got == want
    stats = graph.prefill_stats
    assert stats.replays >= 2 and stats.eager_calls == 0, stats.table()
    assert stats.break_runs == stats.replays * graph.config.num_layers
    assert graph.stats.replays > 0 and graph.stats.eager_calls == 0
    assert eager.prefill_stats.eager_calls == stats.calls
    # The one-prompt eager prefill gives the same tokens too.
    solo = _engine(runner="eager", max_batch_size=1)
    assert solo.generate(PROMPTS, LIMITS, stop_token_ids=[]) == want


@pytest.mark.parametrize("size, limits", [(4, [5, 5, 5, 2]), (7, [2, 5, 5, 5, 5, 5, 5])])
def test_lazy_graph_engine_gives_the_eager_engines_tokens_as_requests_finish(size, limits):
    # The first decode step at a full batch warms up eagerly; a request then finishes and the
    # next step pads to that size and captures. Its logits came back with the padded row (the
    # warm-up's shapes at that size were counted as a second size), and generate() raised.
    prompts = [[i + 1, 2, 3] for i in range(size)]
    eager = _engine(runner="eager", max_batch_size=size, max_seq_len=32)
    want = eager.generate(prompts, limits, stop_token_ids=[])
    graph = _engine(
        runner="graph",
        graph_backend=SimulatedGraphBackend(),
        max_batch_size=size,
        max_seq_len=32,
        lazy_capture=True,
    )
    assert graph.generate(prompts, limits, stop_token_ids=[]) == want
    assert graph.stats.replays > 0
    assert graph.generate(prompts, limits, stop_token_ids=[]) == want


def test_engine_prompt_longer_than_the_largest_prefill_graph_runs_eagerly():
    graph = _engine(max_prefill_tokens=16, graph_backend=SimulatedGraphBackend())
    eager = _engine(runner="eager")
    prompts = [list(range(1, 21)), [3, 4]]
    assert graph.prefill_runner.capture_sizes == (16,)
    assert graph.generate(prompts, 3, stop_token_ids=[]) == eager.generate(
        prompts, 3, stop_token_ids=[]
    )
    stats = graph.prefill_stats
    assert stats.fallback_count(FallbackReason.BATCH_TOO_LARGE) == 1 and stats.replays == 1


def test_engine_prefill_runner_choices():
    engine = _engine(runner="graph", prefill_runner="eager")
    assert type(engine.prefill_runner).__name__ == "EagerRunner"
    assert engine.prefill_step.max_tokens == min(2048, 4 * 64)
    with pytest.raises(ConfigError, match="prefill_runner must be one of"):
        _engine(prefill_runner="fast")
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        _engine(max_prefill_tokens=0)


def test_prefill_batch_layout_helpers():
    batch = PrefillBatch([PromptRun(0, 2, (0, 1)), PromptRun(4, 3, (2,))])
    assert batch.tokens == 7 and batch.prompts == 3
    made = []
    first = batch.derived(("x",), lambda: made.append(1) or torch.ones(1))
    assert batch.derived(("x",), lambda: made.append(1) or torch.zeros(1)) is first
    assert made == [1]
    assert PrefillBatch().tokens == 0


@pytest.mark.parametrize(
    "tokens, slot, fragment",
    [
        (torch.arange(20), 0, "20 tokens, but a prompt needs 1 to 16"),
        (torch.arange(0), 0, "0 tokens, but a prompt needs 1 to 16"),
        (torch.arange(4), 5, r"slot must be an int in \[0, 2\), got 5"),
        (torch.arange(4), 2, r"slot must be an int in \[0, 2\), got 2"),  # the scratch slot
        (torch.tensor([300]), 0, r"token ids must be in \[0, 256\), got 300..300"),
        (torch.arange(4.0), 0, "tokens must be a 1-D int64"),
        (torch.arange(4)[None], 0, "tokens must be a 1-D int64"),
    ],
)
def test_prefill_names_the_input_that_does_not_fit(tokens, slot, fragment):
    # Unchecked, each fails deep in the forward (a shape mismatch in RoPE, an index error).
    model = load_model("tiny")
    step = DecodeStep(model, KVCache(model.config, 2, 16))
    with pytest.raises(InputError, match=fragment):
        prefill(step, tokens, slot)
    assert prefill(step, torch.arange(16), 1).shape == (model.config.vocab_size,)


def test_prefill_checks_the_token_ids_with_one_host_read(monkeypatch):
    # Each read of a device tensor's value is a host sync, paid on every prefill() call.
    model = load_model("tiny")
    step = DecodeStep(model, KVCache(model.config, 2, 16))
    reads = []
    for name in ("__int__", "__index__", "__float__", "__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name):
            reads.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    _check_prefill_inputs(step, torch.arange(4), 0)
    assert len(reads) == 1, reads


def test_an_eager_prefill_runs_only_the_prompts_tokens(monkeypatch):
    # Padding a call to max_prompts tokens is for graph runners (their logits' rows); an eager
    # runner of a large engine must not run max_batch_size tokens for a short prompt.
    seen: list[int] = []
    call = PrefillStep.__call__

    def spy(self, *inputs):
        seen.append(int(inputs[0].shape[0]))
        return call(self, *inputs)

    monkeypatch.setattr(PrefillStep, "__call__", spy)
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=64, max_seq_len=64)
    engine.generate([[1, 2, 3, 4, 5]], 1, stop_token_ids=[])
    assert seen == [5]
