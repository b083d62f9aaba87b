"""``bench decode --compare-hf``: transformers' own model class holding the engine's tensors
gives the engine's logits (prefill and static-cache decode, float32 on the CPU) for every
architecture; the eager and compiled timings, the logits check and the benchmark's notes."""

from __future__ import annotations

import pytest
import torch

from graphtune.bench import hf_compare
from graphtune.bench.decode_results import DecodeBenchConfig
from graphtune.engine import DecodeStep, KVCache, prefill, random_model
from graphtune.engine.config import from_hf_config
from graphtune.engine.presets import PRESETS, get_preset
from graphtune.errors import ConfigError

pytest.importorskip("transformers")

ARCHITECTURES = [
    "tiny",
    "qwen2-tiny",
    "mistral-tiny",
    "qwen3-tiny",
    "qwen3-moe-tiny",
    "mixtral-tiny",
]


def _engine_storages(model) -> set[int]:
    tensors = [model.embed, model.lm_head, model.final_norm]
    tensors += [t for layer in model.layers for t in layer.tensors().values()]
    return {t.untyped_storage().data_ptr() for t in tensors}


def _compare(config) -> None:
    model = random_model(config, seed=3)
    hf = hf_compare.hf_model(model, attn_implementation="eager")
    # The same storage: nothing was copied or drawn again.
    ours = _engine_storages(model)
    for name, param in hf.named_parameters():
        assert param.untyped_storage().data_ptr() in ours, name
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == config.tie_word_embeddings
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (2, 9), generator=gen)
    with torch.inference_mode():
        decoder = hf_compare.HfDecoder(hf, prompt, max_cache_len=16, compile_forward=False)
        step = DecodeStep(model, KVCache(config, 2, 32), contiguous_slots=True)
        for row in range(2):
            want = prefill(step, prompt[row], row)
            torch.testing.assert_close(decoder.prefill_logits[row, -1], want, rtol=1e-4, atol=1e-4)
        for i in range(3):
            position = torch.full((2,), 9 + i)
            want = step(decoder.token[:, 0], position, torch.arange(2))
            got = decoder.step()[:, -1]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert decoder.position == 12


def test_llama_with_llama3_rope_and_tied_embeddings_matches_the_engine() -> None:
    small = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4)
    small.update(num_kv_heads=2, head_dim=16, vocab_size=256)
    _compare(get_preset("llama-1b-shape").replace(**small))


@pytest.mark.parametrize("preset", ARCHITECTURES)
def test_every_architecture_matches_the_engine(preset: str) -> None:
    _compare(get_preset(preset))


def test_mlp_biases_and_another_activation_match_the_engine() -> None:
    _compare(get_preset("tiny").replace(mlp_bias=True, hidden_act="gelu_tanh"))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_hf_config_fields_map_back_to_the_same_config(preset: str) -> None:
    config = get_preset(preset)
    assert from_hf_config(hf_compare.hf_config_fields(config), name=preset) == config


def test_unavailable_reasons_are_one_line() -> None:
    model = random_model(get_preset("tiny"))
    assert hf_compare.hf_unavailable(model) is None
    model.parallel = object()  # a tensor-parallel shard
    reason = hf_compare.hf_unavailable(model)
    assert reason is not None and "shard" in reason and "\n" not in reason
    with pytest.raises(ConfigError, match="shard"):
        hf_compare.hf_model(model)


@pytest.mark.parametrize("preset", ["tiny", "mixtral-tiny"])
def test_time_hf_decode_times_both_steps_and_checks_the_logits(preset: str, monkeypatch) -> None:
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    model = random_model(get_preset(preset), seed=1)
    hf = hf_compare.hf_model(model)
    prompt = torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(2))
    step = DecodeStep(model, KVCache(model.config, 4, 64), contiguous_slots=True)
    with torch.inference_mode():
        timing = hf_compare.time_hf_decode(hf, prompt, steps=2, repeats=1, check_step=step)
    assert timing.ms > 0 and timing.eager_ms > 0 and timing.compile_s >= 0
    assert "compiled in" in timing.note and timing.check_note is None
    assert compiled == [dict(mode="reduce-overhead", fullgraph=True, dynamic=False)]
    assert timing.max_cache_len >= 8 + 1 + 4 + 2 + hf_compare.EXTRA_CALLS
    assert timing.argmax_agreement == 1.0 and timing.max_abs_diff < 1e-4, timing
    with torch.inference_mode():
        eager = hf_compare.time_hf_decode(hf, prompt, steps=1, repeats=1, compile=False)
    assert eager.ms is None and eager.eager_ms > 0 and eager.argmax_agreement is None


def test_a_sliding_window_the_context_fills_skips_the_check() -> None:
    config = get_preset("mistral-tiny").replace(sliding_window=4)
    model = random_model(config, seed=1)
    hf = hf_compare.hf_model(model)
    step = DecodeStep(model, KVCache(config, 2, 64), contiguous_slots=True)
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        timing = hf_compare.time_hf_decode(
            hf, prompt, steps=1, repeats=1, compile=False, check_step=step
        )
    assert timing.eager_ms > 0 and timing.argmax_agreement is None
    assert "fills the sliding window 4" in timing.check_note


def test_time_hf_decode_compiles_with_graph_breaks_when_fullgraph_fails(monkeypatch) -> None:
    def fake_compile(fn, *, fullgraph, **kw):
        if not fullgraph:
            return fn

        def broken(**kwargs):
            raise RuntimeError("graph break in mask creation")

        return broken

    monkeypatch.setattr(torch, "compile", fake_compile)
    hf = hf_compare.hf_model(random_model(get_preset("tiny"), seed=1))
    prompt = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        timing = hf_compare.time_hf_decode(hf, prompt, steps=1, repeats=1)
    assert timing.ms > 0 and "fullgraph=True failed (RuntimeError: graph break" in timing.note
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fake_compile(fn, fullgraph=True))
    with torch.inference_mode():
        failed = hf_compare.time_hf_decode(hf, prompt, steps=1, repeats=1)
    assert failed.ms is None and failed.note.startswith("failed: RuntimeError")
    assert failed.eager_ms > 0  # the eager anchor is still there


class _FirstWins:
    """Fake timer: every candidate takes 1 us and none runs (the torch fallbacks win)."""

    name = "fake"

    def measure(self, fn, *, warmup: int, repeat: int):
        from graphtune.autotuner.timing.base import Measurement

        return Measurement.from_samples([1.0], calls_per_sample=1, timer=self.name)


def test_bench_decode_times_transformers_eagerly_without_cuda_and_the_unfused_step() -> None:
    from graphtune.autotuner import AutoTuner, TuningPolicy
    from graphtune.bench.decode import run_decode_bench
    from graphtune.bench.decode_report import format_report

    cfg = DecodeBenchConfig(
        model="tiny",
        batch_sizes=(1, 2),
        context=8,
        steps=1,
        repeats=1,
        device="cpu",
        tune=True,
        compare_hf=True,
        compare_unfused=True,
    )
    policy = TuningPolicy(rounds=1, remeasure_top=0)
    tuner = AutoTuner(timer=_FirstWins(), policy=policy, show_progress=False)
    lines: list[str] = []
    report = run_decode_bench(cfg, log=lines.append, tuner=tuner)
    assert any("compiled recipe skipped" in note and "CUDA" in note for note in report.notes)
    for r in report.results:
        assert r.tuned_unfused_ms > 0 and r.hf_ms is None and r.hf_eager_ms > 0
        assert r.hf_argmax_agreement == 1.0 and r.speedup_over_hf > 0
    assert report.tuning_fallbacks == {}
    text = format_report(report)
    assert "tuned unfused" in text and "side by side" in text and "HF eager" in text
    assert "greedy tokens agree on 100% / 100% of rows at batch 1/2" in text


def test_bench_config_rules() -> None:
    with pytest.raises(ConfigError, match="--compare-hf is not supported with --tp"):
        DecodeBenchConfig(tp=2, compare_hf=True)
    with pytest.raises(ConfigError, match="add --compare-hf"):
        DecodeBenchConfig(hf_compile=False)
    with pytest.raises(ConfigError, match="--context >= 1"):
        DecodeBenchConfig(compare_hf=True, context=0)
    with pytest.raises(ConfigError, match="layers must be >= 1"):
        DecodeBenchConfig(layers=0)
    for bad in (dict(), dict(tune=True, tp=2)):
        with pytest.raises(ConfigError, match="--refine-in-step refines a tuned single-process"):
            DecodeBenchConfig(refine_in_step=True, **bad)
    tuned_only = dict(tuning_cache="c.json", compare_unfused=True, tune_cold_l2=False)
    for name, value in tuned_only.items():
        with pytest.raises(ConfigError, match="applies to the tuned step only: add --tune"):
            DecodeBenchConfig(**{name: value})
        DecodeBenchConfig(tune=True, **{name: value})


def test_speedup_over_hf_is_over_the_engines_fastest_step() -> None:
    from graphtune.bench.decode_results import BatchResult, DecodeBenchReport

    # The tuned step lost to the untuned graph here: the engine's fastest is the untuned one.
    result = BatchResult(1, graph_ms=1.0, tuned_graph_ms=2.0, hf_ms=1.5, hf_eager_ms=3.0)
    report = DecodeBenchReport(config={}, model={}, provenance={}, results=[result])
    report.derive()
    assert result.speedup_over_hf == pytest.approx(1.5)
    eager_only = BatchResult(1, eager_ms=4.0, tuned_eager_ms=2.0, hf_eager_ms=3.0)
    DecodeBenchReport(config={}, model={}, provenance={}, results=[eager_only]).derive()
    assert eager_only.speedup_over_hf == pytest.approx(1.5)


def test_main_table_headers_stay_distinguishable_in_140_columns() -> None:
    from graphtune.bench.decode_report import format_report
    from graphtune.bench.decode_results import BatchResult, DecodeBenchReport

    # Every column measured (the widest table): an empty column would be left out.
    result = BatchResult(1, eager_ms=19.0, graph_ms=3.0, busy_ms=2.0, floor_ms=1.0)
    result.compile_ms, result.tuned_graph_ms, result.tuned_busy_ms = 1.0, 2.6, 2.0
    config = {"context": 8, "dtype": "bfloat16", "device": "cuda:0"}
    model = {"name": "tiny", "parameters": 110_000}
    report = DecodeBenchReport(config=config, model=model, provenance={}, results=[result])
    report.tuning_seconds, report.tuning_compile_seconds, report.tuning_profiles = 1.0, 0.0, 1
    report.derive()
    header = format_report(report).split("┡")[0]
    assert "…" not in header  # "tuned/untuned" and "tuned/floor" were both cut to "tuned/…"
    assert "untuned" in header and "floor" in header and "GPU-busy" in header
    assert max(len(line) for line in header.splitlines()) <= 140


def test_family_table_lists_each_profiled_step() -> None:
    from graphtune.bench.decode_report import family_table
    from graphtune.bench.decode_results import BatchResult

    result = BatchResult(1, kernels_per_step=5, tuned_kernels_per_step=2)
    result.kernel_families = {"GEMV/GEMM": {"us": 10.0, "calls": 3}, "norms": {"us": 2, "calls": 2}}
    result.tuned_kernel_families = {"GEMV/GEMM": {"us": 9.0, "calls": 2}}
    table = family_table(result)
    assert "untuned" in table and "tuned" in table and "HF compile" not in table
    assert "10.0 (3)" in table and "9.0 (2)" in table and "12.0 (5)" in table
    assert family_table(BatchResult(1)) == ""


def test_a_nan_logits_difference_is_reported_not_hidden_behind_a_number() -> None:
    from graphtune.bench.decode_report import format_report, hf_check_line
    from graphtune.bench.decode_results import BatchResult, DecodeBenchReport

    nan = float("nan")
    # Python's max() keeps the first value when a NaN follows it.
    results = [
        BatchResult(1, graph_ms=1.0, tuned_graph_ms=0.9, tuned_max_abs_diff=0.125),
        BatchResult(8, graph_ms=2.0, tuned_graph_ms=1.8, tuned_max_abs_diff=nan),
    ]
    results[0].hf_max_abs_diff, results[0].hf_argmax_agreement = 0.01, 1.0
    results[1].hf_max_abs_diff, results[1].hf_argmax_agreement = nan, 0.0
    config = {"context": 8, "dtype": "float32", "device": "cpu"}
    model = {"name": "tiny", "parameters": 110_000}
    report = DecodeBenchReport(config=config, model=model, provenance={}, results=results)
    report.tuning_seconds, report.tuning_compile_seconds, report.tuning_profiles = 1.0, 0.0, 1
    report.derive()
    (tuned,) = [line for line in format_report(report).splitlines() if "tuned vs untuned" in line]
    hf = hf_check_line(report)
    assert hf is not None
    for line in (tuned, hf):
        assert "nan" in line and "0.125" not in line and "0.01" not in line
