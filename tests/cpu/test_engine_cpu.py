"""Engine behaviour on CPU: loading, errors, eager == graph runner, slot isolation, sampling."""

from __future__ import annotations

import json

import pytest
import torch

from graphtune.engine import (
    DecodeStep,
    Engine,
    KVCache,
    SamplingParams,
    from_hf_config,
    get_preset,
    load_checkpoint,
    load_model,
    prefill,
)
from graphtune.errors import CheckpointError, ConfigError, InputError
from graphtune.graphs import SimulatedGraphBackend

PROMPTS = [[1, 5, 9], [7], [3, 4, 5, 6, 7, 8], [10, 11], [12, 13, 14], [15]]
LIMITS = [6, 9, 3, 12, 1, 7]


def test_presets_are_valid():
    cfg = get_preset("llama-1b-shape")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2048, 16, 32, 8)
    assert cfg.vocab_size == 128256 and cfg.tie_word_embeddings
    assert 1.2e9 < cfg.num_parameters() < 1.3e9  # Llama-3.2-1B has 1.24 B
    with pytest.raises(ConfigError, match="unknown model preset"):
        get_preset("nope")


def test_random_weights_are_seeded_and_never_zero():
    a, b = load_model("tiny", seed=3), load_model("tiny", seed=3)
    c = load_model("tiny", seed=4)
    assert torch.equal(a.layers[0].wqkv, b.layers[0].wqkv)
    assert not torch.equal(a.layers[0].wqkv, c.layers[0].wqkv)
    assert all(t.abs().sum() > 0 for t in a.layers[1].tensors().values())


def test_greedy_eager_equals_graph_runner_on_cpu():
    from graphtune.graphs import SimulatedGraphBackend

    eager = Engine(load_model("tiny"), runner="eager", max_batch_size=4, max_seq_len=64)
    # The simulated backend captures and replays on the CPU (without it every call of a graph
    # runner falls back to eager here, and this would compare eager with eager).
    graph = Engine(
        load_model("tiny"),
        runner="graph",
        max_batch_size=4,
        max_seq_len=64,
        graph_backend=SimulatedGraphBackend(),
    )
    want = eager.generate(PROMPTS, LIMITS, stop_token_ids=[])
    got = graph.generate(PROMPTS, LIMITS, stop_token_ids=[])
    assert graph.stats.replays > 0 and graph.stats.eager_calls == 0, graph.stats.table()
    assert got == want
    assert [len(o) for o in got] == LIMITS
    # Batch composition must not matter: one request at a time gives the same tokens.
    solo = Engine(load_model("tiny"), runner="eager", max_batch_size=1, max_seq_len=64)
    assert solo.generate(PROMPTS, LIMITS, stop_token_ids=[]) == want


def test_graph_runner_without_cuda_falls_back_with_reason():
    graph = Engine(load_model("tiny"), runner="graph", max_batch_size=4, max_seq_len=32)
    graph.generate([[1, 2]], 3)
    from graphtune.graphs import FallbackReason

    assert graph.stats.fallback_count(FallbackReason.NO_CUDA) == 2  # 2 decode steps after prefill
    assert graph.stats.replays == 0
    assert "no CUDA" in graph.stats.table()


def test_stop_tokens_end_a_request_early():
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=2, max_seq_len=64)
    free = engine.generate([[1, 2, 3]], 10, stop_token_ids=[])[0]
    stop = free[3]
    first = free.index(stop)
    assert engine.generate([[1, 2, 3]], 10, stop_token_ids=[stop])[0] == free[: first + 1]


def _step_inputs(rows):
    return tuple(torch.tensor(col, dtype=torch.long) for col in zip(*rows, strict=True))


@pytest.mark.parametrize("contiguous", [True, False])
def test_padded_rows_never_touch_live_slots(contiguous):
    model = load_model("tiny")
    cache = KVCache(model.config, max_batch_size=4, max_seq_len=32)
    step = DecodeStep(model, cache, contiguous_slots=contiguous)
    scratch = cache.scratch_slot
    with torch.inference_mode():
        for slot, prompt in enumerate([[1, 2, 3], [4, 5]]):
            prefill(step, torch.tensor(prompt), slot)
        saved_k, saved_v = cache.k.clone(), cache.v.clone()
        live = [(9, 3, 0), (8, 2, 1)]  # (token, position, slot)

        def run(rows):
            cache.k.copy_(saved_k)
            cache.v.copy_(saved_v)
            logits = step(*_step_inputs(rows))[:2].clone()
            return logits, cache.k.clone(), cache.v.clone()

        plain = run(live)
        padded = run(live + [(0, 0, scratch)] * 2)  # the engine's pad rule
        garbage = run(live + [(77, 13, scratch), (200, 5, scratch)])  # any pad contents
    owned = slice(0, cache.max_batch_size)
    # Same batch shape, different pad contents: live rows and live slots are bit-identical.
    for got, want in zip(garbage, padded, strict=True):
        assert torch.equal(
            got[:2] if got.dim() == 2 else got[:, owned],
            want[:2] if want.dim() == 2 else want[:, owned],
        )
    # Against no padding at all: only GEMM blocking may differ (CPU kernels pick by batch size).
    torch.testing.assert_close(padded[0], plain[0], rtol=1e-5, atol=1e-5)
    for got, want in ((padded[1], plain[1]), (padded[2], plain[2])):
        torch.testing.assert_close(got[:, owned], want[:, owned], rtol=1e-5, atol=1e-6)
        # Slots nobody owns in this step are untouched byte for byte.
        assert torch.equal(
            got[:, 2:scratch], saved_k[:, 2:scratch] if got is padded[1] else saved_v[:, 2:scratch]
        )


def test_unknown_architecture_is_a_checkpoint_error():
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        from_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_config_without_fields_or_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="missing the field") as missing:
        load_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in str(missing.value)  # which folder's config
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path / "nothing")


@pytest.fixture(scope="module")
def engine():
    return Engine(load_model("tiny"), runner="eager", max_batch_size=2, max_seq_len=32)


def test_prompt_longer_than_cache(engine):
    with pytest.raises(InputError, match="max_seq_len=32"):
        engine.generate([list(range(1, 40))], 1)
    with pytest.raises(InputError, match="max_seq_len"):
        engine.generate([list(range(1, 30))], 8)


def test_empty_prompt_and_unknown_tokens(engine):
    with pytest.raises(InputError, match="empty"):
        engine.generate([[]], 2)
    with pytest.raises(InputError, match="outside"):
        engine.generate([[1, 256]], 2)
    with pytest.raises(InputError, match="tokenizer"):
        engine.generate(["hello"], 2)
    with pytest.raises(InputError, match="max_new_tokens"):
        engine.generate([[1]], 0)


def test_batch_above_max_is_refused(engine):
    with pytest.raises(InputError, match="max_batch_size=2"):
        engine.step(*_step_inputs([(1, 0, 0)] * 3))


def test_bad_engine_arguments():
    with pytest.raises(ConfigError, match="runner"):
        Engine(load_model("tiny"), runner="fast")
    with pytest.raises(ConfigError):
        Engine(load_model("tiny"), max_batch_size=0)


def test_sampling_is_seeded_and_respects_top_k():
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=3, max_seq_len=64)
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=7)
    a = engine.generate(PROMPTS[:3], 8, sampling=params, stop_token_ids=[])
    b = engine.generate(PROMPTS[:3], 8, sampling=params, stop_token_ids=[])
    assert a == b
    from graphtune.engine import sample

    logits = torch.randn(4, 256)
    allowed = logits.topk(3, dim=-1).indices
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        picked = sample(logits, SamplingParams(temperature=1.0, top_k=3), gen)
        assert (allowed == picked[:, None]).any(dim=-1).all()
    top1 = sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), gen)
    assert torch.equal(top1, logits.argmax(-1))
    with pytest.raises(ConfigError):
        SamplingParams(top_p=0)


def test_a_sampled_request_does_not_depend_on_what_shares_its_batch():
    # One generator per call used to draw the whole batch's noise each step: a request's tokens
    # changed with max_batch_size, its row and the other requests. Its noise is now a function
    # of (seed, its index in the call, the token's number).
    from graphtune.graphs import SimulatedGraphBackend

    params = SamplingParams(temperature=1.0, seed=7)
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]

    def run(batch: int, prompts: list, **kwargs) -> list:
        engine = Engine(load_model("tiny"), max_batch_size=batch, max_seq_len=64, **kwargs)
        return engine.generate(prompts, 8, sampling=params, stop_token_ids=[])

    want = run(1, prompts, runner="eager")
    assert run(3, prompts, runner="eager") == want
    assert run(2, prompts, runner="graph", graph_backend=SimulatedGraphBackend()) == want
    assert run(1, prompts[:1], runner="eager") == want[:1]  # alone, as the call's first request
    assert len({tuple(o) for o in run(3, [prompts[0]] * 3, runner="eager")}) > 1  # n samples


def test_keyed_noise_is_exponential_and_per_row():
    from graphtune.engine.sampling import keyed_exponential, request_keys

    keys = request_keys(3, [(0, 0), (1, 0), (0, 1)])
    noise = keyed_exponential(keys, 200_000)
    assert bool((noise > 0).all())
    assert noise.mean(dim=1).sub(1).abs().max() < 0.02  # Exponential(1): mean 1, variance 1
    assert noise.var(dim=1).sub(1).abs().max() < 0.05
    assert torch.equal(keyed_exponential(keys[1:2], 200_000)[0], noise[1])  # its key alone
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])


def test_fill_random_is_seeded_keys_first_and_never_zero():
    config = load_model("tiny").config
    cache = KVCache(config, max_batch_size=2, max_seq_len=8)
    cache.fill_random(3)
    gen = torch.Generator().manual_seed(3)
    want_k = torch.randn(cache.k.shape, generator=gen)
    want_v = torch.randn(cache.v.shape, generator=gen)
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v)
    assert not torch.equal(cache.k, cache.v)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "1"),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", float("nan")),
        ("seed", 2**70),
        ("seed", 1.5),
    ],
)
def test_sampling_params_refuse_values_that_would_sample_garbage(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_take_numpy_scalars_as_python_numbers():
    np = pytest.importorskip("numpy")
    params = SamplingParams(
        temperature=np.float32(0.5), top_k=np.int64(4), top_p=np.float64(0.9), seed=np.uint32(3)
    )
    assert params == SamplingParams(temperature=0.5, top_k=4, top_p=0.9, seed=3)
    assert [type(v) for v in (params.temperature, params.top_k, params.top_p, params.seed)] == [
        float,
        int,
        float,
        int,
    ]
    with pytest.raises(ConfigError, match="seed"):
        SamplingParams(seed=np.int64(-1))


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_sampling_params_refuse_an_int_too_large_for_a_float(field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(
            **{field: 10**400, "temperature": 1.0} if field == "top_p" else {field: 10**400}
        )


@pytest.mark.parametrize(
    "kwargs, fields",
    [
        (dict(top_k=5), "top_k=5 needs"),
        (dict(top_k=1), "top_k=1 needs"),
        (dict(top_p=0.9), "top_p=0.9 needs"),
        (dict(temperature=0, top_k=2, top_p=0.5), "top_k=2 and top_p=0.5 need"),
    ],
)
def test_top_k_and_top_p_are_refused_at_temperature_zero(kwargs, fields):
    # Greedy decoding takes the argmax and would silently ignore them.
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{fields} temperature > 0")
    assert "pass a temperature > 0, or leave" in message
    assert SamplingParams(
        temperature=0.5, **{k: v for k, v in kwargs.items() if k != "temperature"}
    )
    assert SamplingParams(top_k=0, top_p=1.0).greedy  # the "off" values stay allowed


def test_a_tiny_temperature_samples_the_argmax_not_token_zero():
    from graphtune.engine import sample

    logits = torch.randn(6, 256) * 4
    # 2e-38: just above the smallest allowed temperature; logits / 2e-38 overflow float32.
    picked = sample(logits, SamplingParams(temperature=2e-38, seed=1), torch.Generator())
    assert torch.equal(picked, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1e-46, 1e-45, 5e-324, 1e-39])
def test_a_temperature_too_small_for_float32_is_refused_not_sampled_as_token_zero(temperature):
    # Below float32's smallest normal number the divisor is 0 (or a subnormal that flushing
    # makes 0), the scores NaN, and argmax would return token 0 with no failure.
    with pytest.raises(ConfigError, match=r"below 1\.175e-38.*use temperature=0 for greedy"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float8_e4m3fn])
def test_an_engine_of_a_non_float_dtype_is_refused_before_the_weights_change(dtype):
    model = load_model("tiny")
    embed, norm = model.embed.clone(), model.layers[0].attn_norm.clone()
    with pytest.raises(ConfigError, match="dtype must be one of"):
        Engine(model, runner="eager", dtype=dtype)
    assert torch.equal(model.embed, embed) and torch.equal(model.layers[0].attn_norm, norm)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        load_model("tiny", dtype=dtype)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"max_batch_size": 2.5}, "max_batch_size must be an integer >= 1"),
        ({"max_batch_size": None}, "max_batch_size must be an integer >= 1"),
        ({"max_seq_len": 64.5}, "max_seq_len must be an integer >= 2"),
        ({"device": "gpu"}, "'gpu' is not a device torch knows"),
    ],
)
def test_engine_arguments_of_the_wrong_kind_are_config_errors(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Engine(load_model("tiny"), runner="eager", **kwargs)


def test_a_cuda_device_without_cuda_is_a_config_error_not_a_torch_crash(monkeypatch):
    model = load_model("tiny")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for call in (
        lambda: Engine(model, runner="eager", max_seq_len=32, device="cuda"),
        lambda: load_model("tiny", device="cuda"),
        lambda: load_model("tiny", device=torch.device("cuda", 0)),
    ):
        with pytest.raises(ConfigError, match=r"device=.*CUDA is not available.*device='cpu'"):
            call()
    assert model.device.type == "cpu"


def _two_rows(rows=2):
    ids = torch.arange(rows, dtype=torch.long)
    return ids + 1, ids + 3, ids


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda t, p, s: (t.float(), p, s), "tokens must be a 1-D int64 tensor"),
        (lambda t, p, s: (t.tolist(), p, s), "tokens must be a 1-D int64 tensor"),
        (lambda t, p, s: (t, p[:1], s), "have 2, 1 and 2 rows"),
        (lambda t, p, s: (t[None], p, s), "tokens must be a 1-D int64 tensor"),
        (lambda t, p, s: (t, p, s.to("meta")), "slots is on meta"),
    ],
)
def test_step_names_the_input_that_does_not_fit(change, fragment):
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=4, max_seq_len=32)
    with pytest.raises(InputError, match=fragment):
        engine.step(*change(*_two_rows()))


def test_step_checks_values_in_debug_mode(monkeypatch):
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=4, max_seq_len=32)
    tokens, positions, slots = _two_rows()
    monkeypatch.setenv("GRAPHTUNE_DEBUG", "1")
    with pytest.raises(InputError, match=r"tokens must be in \[0, "):
        engine.step(tokens - 5, positions, slots)
    with pytest.raises(InputError, match=r"slots must be in \[0, 4\)"):
        engine.step(tokens, positions, slots + 9)
    assert engine.step(tokens, positions, slots).shape[0] == 2


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda e: e.generate([1, 2, 3], 2), InputError, "pass \\[\\[1, 2, 3\\]\\]"),
        (lambda e: e.generate("hello", 2), InputError, "list of prompts"),
        (lambda e: e.generate(torch.tensor([5, 6, 7]), 2), InputError, "tensor of prompts is 2-D"),
        (lambda e: e.generate([{5: 1, 6: 2}], 2), InputError, "list of token ids, got dict"),
        (lambda e: e.generate([{5, 6}], 2), InputError, "list of token ids, got set"),
        (lambda e: e.generate([[1, 2]], 2, stop_token_ids=5), InputError, "stop_token_ids"),
        (lambda e: e.generate([[1, 2]], 2, stop_token_ids=[1.5]), InputError, "stop_token_ids"),
        (lambda e: e.generate([[1, 2]], 2, stop_token_ids=[10**6]), InputError, "outside"),
        (lambda e: e.generate([[1, 2]], 2, sampling={"temperature": 1}), ConfigError, "sampling"),
    ],
)
def test_generate_names_an_argument_of_the_wrong_kind(call, error, fragment):
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=2, max_seq_len=32)
    with pytest.raises(error, match=fragment):
        call(engine)


def test_a_kv_cache_too_large_to_allocate_says_its_size_and_the_fix(monkeypatch):
    from graphtune.engine import kv_cache

    def refuse(*args, **kwargs):  # what torch's CPU allocator raises (no real huge allocation)
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")

    model = load_model("tiny")
    monkeypatch.setattr(kv_cache.torch, "zeros", refuse)
    # The host-memory check before allocating is tests/cpu/test_kv_cache_host_memory.py's; here
    # the allocator itself refuses (a device, or a host whose available memory is unknown).
    monkeypatch.setattr(kv_cache, "available_host_memory", lambda: None)
    pattern = (
        r"the KV cache \(max_batch_size 1000000 slots .* GiB .* could not be allocated.* lower"
    )
    with pytest.raises(ConfigError, match=pattern):
        Engine(model, runner="eager", max_batch_size=10**6, max_seq_len=2048)


def test_a_kv_cache_longer_than_the_model_positions_is_refused():
    model = load_model("tiny")  # max_position_embeddings 2048
    with pytest.raises(ConfigError, match="max_seq_len=4096 needs 4096 positions"):
        Engine(model, runner="eager", max_batch_size=1, max_seq_len=4096)


@pytest.mark.parametrize("sizes", [(2.0, 16), (2, 16.5), ("2", 16), (True, 16), (2, 0)])
def test_kv_cache_sizes_must_be_positive_ints(sizes):
    # Not a raw torch TypeError for a float, and not one slot for True.
    with pytest.raises(ConfigError):
        KVCache(get_preset("tiny"), *sizes)


@pytest.mark.parametrize(
    "bad", [dict(tuner="x"), dict(tuner=object(), tune=True), dict(tuning_cache=3)]
)
def test_engine_refuses_a_tuner_or_tuning_cache_of_the_wrong_type(bad):
    # Before: accepted, then a TypeError from deep inside generate() or the cache's load.
    with pytest.raises(ConfigError):
        Engine(load_model("tiny"), runner="eager", max_batch_size=2, max_seq_len=32, **bad)


def test_generate_refuses_a_kv_slot_held_outside_it_instead_of_decoding_wrong_slots():
    # generate() keeps request i in slot i; with slot 0 held, request 0 got slot 1 but the
    # decode step read slot 0 (the holder's keys and values): wrong tokens, no error.
    engine = Engine(load_model("tiny", seed=0), runner="eager", max_batch_size=2, max_seq_len=32)
    prompt = [[5, 9, 17, 3, 100, 42]]
    want = engine.generate(prompt, 8, stop_token_ids=[])
    held = engine.cache.allocate()
    engine.cache.k[:, held].normal_()
    engine.cache.v[:, held].normal_()
    with pytest.raises(InputError):
        engine.generate(prompt, 8, stop_token_ids=[])
    assert engine.cache.num_free == 1  # nothing was allocated or freed
    engine.cache.free(held)
    assert engine.generate(prompt, 8, stop_token_ids=[]) == want


def _simulated_graph_engine(**kwargs):
    backend = SimulatedGraphBackend()  # captures and replays on the CPU
    return Engine(
        load_model("tiny"), max_batch_size=2, max_seq_len=32, graph_backend=backend, **kwargs
    )


def test_step_replays_after_generate_captured_lazily():
    # generate()'s lazy capture made the buffers under inference mode; step() was then refused.
    engine = _simulated_graph_engine(lazy_capture=True)
    engine.generate([[5, 17, 42, 3]], 4)
    slot = engine.cache.allocate()
    with torch.inference_mode():
        first = int(prefill(engine.step_fn, torch.tensor([7, 7, 7]), slot).argmax())
    want = engine.step_fn(*_step_inputs([(first, 3, slot)])).clone()
    replays = engine.stats.replays
    torch.testing.assert_close(engine.step(*_step_inputs([(first, 3, slot)])), want)
    assert engine.stats.replays == replays + 1


def test_serving_again_after_release_recaptures_instead_of_running_eagerly():
    # A non-lazy engine ran every decode step and prefill eagerly after release(), silently.
    engine = _simulated_graph_engine()
    prompts = [[5, 17, 42, 3], [9, 8, 6]]
    want = engine.generate(prompts, 4, stop_token_ids=[])
    engine.release()
    assert engine.generate(prompts, 4, stop_token_ids=[]) == want
    assert engine.stats.eager_calls == 0 and engine.prefill_stats.eager_calls == 0
    assert engine.runner.captured_keys and engine.prefill_runner.captured_keys
    engine.release()
    replays = engine.stats.replays
    engine.step(*_step_inputs([(5, 0, 0)]))  # step() recaptures too
    assert engine.stats.replays == replays + 1 and engine.stats.eager_calls == 0
