"""``bench decode --compare-hf``'s model: transformers' own model class holding the engine's
tensors gives the engine's logits (prefill and static-cache decode, float32 on the CPU)."""

from __future__ import annotations

import pytest
import torch

from graphtune.bench import hf_compare
from graphtune.engine import DecodeStep, KVCache, prefill, random_model
from graphtune.engine.config import get_preset

pytest.importorskip("transformers")


def _compare(preset: str, **changes) -> None:
    config = get_preset(preset).replace(**changes) if changes else get_preset(preset)
    model = random_model(config, seed=3)
    hf = hf_compare.hf_model(model, attn_implementation="eager")
    # The same storage: nothing was copied or drawn again.
    assert hf.model.embed_tokens.weight.data_ptr() == model.embed.data_ptr()
    assert hf.model.layers[0].self_attn.q_proj.weight.data_ptr() == model.layers[0].wqkv.data_ptr()
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
    _compare(
        "llama-1b-shape",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=256,
    )


@pytest.mark.parametrize("preset", ["tiny", "qwen2-tiny", "mistral-tiny"])
def test_tiny_presets_match_the_engine(preset: str) -> None:
    _compare(preset)


def test_unavailable_reasons_are_one_line() -> None:
    model = random_model(get_preset("tiny"))
    reason = hf_compare.hf_unavailable(model, torch.device("cpu"))
    assert reason is not None and "needs CUDA" in reason and "\n" not in reason


class _FirstWins:
    """Fake timer: every candidate takes 1 us and none runs (the torch fallbacks win)."""

    name = "fake"

    def measure(self, fn, *, warmup: int, repeat: int):
        from graphtune.autotuner.timing.base import Measurement

        return Measurement.from_samples([1.0], calls_per_sample=1, timer=self.name)


def test_bench_decode_notes_the_skipped_hf_recipe_and_times_the_unfused_step() -> None:
    from graphtune.autotuner import AutoTuner, TuningPolicy
    from graphtune.bench.decode import run_decode_bench
    from graphtune.bench.decode_report import format_report
    from graphtune.bench.decode_results import DecodeBenchConfig

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
    assert any("--compare-hf skipped" in note and "CUDA" in note for note in report.notes)
    assert all(r.tuned_unfused_ms > 0 and r.hf_ms is None for r in report.results)
    assert report.tuning_fallbacks == {}
    text = format_report(report)
    assert "tuned unfused" in text and "side by side" in text and "--compare-hf skipped" in text


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


def _tiny_hf():
    model = random_model(get_preset("tiny"), seed=1)
    prompt = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(2))
    return hf_compare.hf_model(model), prompt


def test_time_hf_decode_times_the_compiled_step(monkeypatch) -> None:
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    hf, prompt = _tiny_hf()
    with torch.inference_mode():
        timing = hf_compare.time_hf_decode(hf, prompt, steps=2, repeats=1)
    assert timing.ms > 0 and timing.compile_s >= 0 and "compiled in" in timing.note
    assert compiled == [dict(mode="reduce-overhead", fullgraph=True, dynamic=False)]
    assert timing.max_cache_len >= 8 + 1 + 3 + 2 + hf_compare.EXTRA_CALLS


def test_time_hf_decode_compiles_with_graph_breaks_when_fullgraph_fails(monkeypatch) -> None:
    def fake_compile(fn, *, fullgraph, **kw):
        if not fullgraph:
            return fn

        def broken(**kwargs):
            raise RuntimeError("graph break in mask creation")

        return broken

    monkeypatch.setattr(torch, "compile", fake_compile)
    hf, prompt = _tiny_hf()
    with torch.inference_mode():
        timing = hf_compare.time_hf_decode(hf, prompt, steps=1, repeats=1)
    assert timing.ms > 0 and "fullgraph=True failed (RuntimeError: graph break" in timing.note
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fake_compile(fn, fullgraph=True))
    with torch.inference_mode():
        failed = hf_compare.time_hf_decode(hf, prompt, steps=1, repeats=1)
    assert failed.ms is None and failed.note.startswith("failed: RuntimeError")
