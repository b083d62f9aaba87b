"""The MoE decode benchmark's parts on the CPU: the bytes a step reads from its own routing, the
uniform-routing expectation, the transformers anchor on shared weights, and `bench decode` with
--compare-hf and --layers end to end."""

from __future__ import annotations

import json

import pytest
import torch

from graphtune.bench.decode_results import DecodeBenchConfig
from graphtune.bench.hf_anchor import hf_config_fields, hf_model_sharing, time_hf_decode
from graphtune.bench.moe_floor import (
    expected_experts_hit,
    experts_hit,
    record_routing,
    step_bytes,
    step_weight_bytes,
)
from graphtune.engine import DecodeStep, KVCache, load_model, random_model
from graphtune.engine.config import PRESETS, from_hf_config, get_preset
from graphtune.errors import ConfigError, InputError
from graphtune.ops.moe import route_top_k


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_expected_experts_hit_matches_uniform_routing():
    assert expected_experts_hit(128, 8, 1) == pytest.approx(8)
    assert expected_experts_hit(8, 2, 1) == pytest.approx(2)
    assert expected_experts_hit(128, 8, 4096) == pytest.approx(128)
    # Monte Carlo of k distinct uniform experts per token.
    gen = torch.Generator().manual_seed(0)
    for experts, top_k, tokens in ((128, 8, 8), (128, 8, 64), (8, 2, 3)):
        hits = [
            torch.rand(tokens, experts, generator=gen).topk(top_k).indices.unique().numel()
            for _ in range(2000)
        ]
        mean = sum(hits) / len(hits)
        assert mean == pytest.approx(expected_experts_hit(experts, top_k, tokens), rel=0.02)


def test_a_dense_step_reads_every_weight():
    model = random_model(get_preset("tiny"))
    step = DecodeStep(model, KVCache(model.config, 2, 16))
    read = step_bytes(step, *step.example_inputs(2))
    assert read.total == model.weight_bytes() and read.experts == 0 and read.experts_hit == ()


def test_an_moe_step_reads_the_experts_its_routing_selects():
    cfg = get_preset("qwen3-moe-tiny").replace(num_layers=3, mlp_only_layers=(1,))
    model = random_model(cfg, seed=5)
    step = DecodeStep(model, KVCache(cfg, 4, 16), contiguous_slots=True)
    tokens, positions, slots = torch.tensor([3, 40, 41, 200]), torch.tensor([0, 5, 2, 7]), None
    slots = torch.arange(4)
    routings = record_routing(step, tokens, positions, slots)
    assert [tuple(ids.shape) for ids in routings] == [(4, 2), (4, 2)]  # the two MoE layers
    hits = experts_hit(routings, cfg.num_experts)
    assert all(2 <= hit <= 8 for hit in hits)
    assert hits == [len(set(ids.reshape(-1).tolist())) for ids in routings]
    read = step_bytes(step, tokens, positions, slots)
    per_expert = (
        sum(_nbytes(t) for t in (model.layers[0].experts_gate_up, model.layers[0].experts_down))
        // cfg.num_experts
    )
    assert read.experts == sum(hits) * per_expert and read.experts_hit == tuple(hits)
    everything = model.weight_bytes()
    unread = (2 * cfg.num_experts - sum(hits)) * per_expert
    assert read.total == everything - unread and read.dense == everything - 2 * 8 * per_expert
    with pytest.raises(InputError, match="1 expert counts for 2 MoE layers"):
        step_weight_bytes(model, [3])


def test_recorded_routing_is_route_top_k_of_the_router():
    model = random_model(get_preset("mixtral-tiny").replace(num_layers=1), seed=1)
    step = DecodeStep(model, KVCache(model.config, 2, 16), contiguous_slots=True)
    layer = model.layers[0]
    (ids,) = record_routing(step, torch.tensor([7, 9]), torch.tensor([0, 0]), torch.arange(2))
    # The MLP input by hand: at position 0 with an empty cache attention returns the values.
    with torch.inference_mode():
        cfg = model.config
        x = torch.nn.functional.embedding(torch.tensor([7, 9]), model.embed)
        h = torch.nn.functional.rms_norm(x, (64,), layer.attn_norm, cfg.rms_norm_eps)
        qkv = h @ layer.wqkv.T
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(2, cfg.num_kv_heads, -1)
        attn = v.repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=1).reshape(2, -1)
        x = x + attn @ layer.wo.T
        h = torch.nn.functional.rms_norm(x, (64,), layer.mlp_norm, cfg.rms_norm_eps)
        _, want = route_top_k(h @ layer.router.T, 2, renormalize=True)
    assert torch.equal(ids, want)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_hf_config_fields_map_back_to_the_same_config(preset):
    config = get_preset(preset)
    assert from_hf_config(hf_config_fields(config), name=preset) == config


@pytest.mark.parametrize(
    "preset", ["tiny", "qwen2-tiny", "mistral-tiny", "qwen3-moe-tiny", "mixtral-tiny"]
)
def test_transformers_anchor_shares_the_weights_and_agrees(preset):
    pytest.importorskip("transformers")
    model = load_model(preset, seed=2)
    hf = hf_model_sharing(model)
    ours = {t.untyped_storage().data_ptr() for t in [model.embed, model.lm_head, model.final_norm]}
    for layer in model.layers:
        ours |= {t.untyped_storage().data_ptr() for t in layer.tensors().values()}
    for name, param in hf.named_parameters():
        assert param.untyped_storage().data_ptr() in ours, name  # a view, not a copy
    step = DecodeStep(model, KVCache(model.config, 3, 16), contiguous_slots=True)
    timing = time_hf_decode(hf, step, torch.tensor([5, 99, 250]), 9, steps=1, repeats=1)
    assert timing.eager_ms > 0 and timing.compile_ms is None
    assert timing.argmax_agreement == 1.0 and timing.max_abs_diff < 1e-4, timing


def test_bench_decode_compare_hf_and_layers_end_to_end(tmp_path, capsys):
    pytest.importorskip("transformers")
    from graphtune.cli.main import main

    out = tmp_path / "moe.json"
    args = ["bench", "decode", "--model", "qwen3-moe-tiny", "--batch-sizes", "1,3"]
    args += ["--context", "6", "--steps", "1", "--repeats", "1", "--device", "cpu"]
    assert main([*args, "--compare-hf", "--layers", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "transformers on the same weights" in text and "experts hit: distinct" in text
    data = json.loads(out.read_text())
    assert data["model"]["name"] == "qwen3-moe-tiny[1 of 2 layers]"
    assert any("quick run" in note for note in data["notes"])
    for r in data["results"]:
        assert len(r["experts_hit"]) == 1 and r["hf_eager_ms"] > 0
        assert r["hf_argmax_agreement"] == 1.0 and r["speedup_over_hf"] > 0
        assert r["weight_bytes_read"] < data["model"]["weight_bytes"]
    assert main([*args, "--hf-compile"]) == 2
    assert "add --compare-hf" in capsys.readouterr().err
    assert main([*args, "--layers", "3"]) == 2
    assert "has only 2 layers" in capsys.readouterr().err


def test_bench_config_rules():
    with pytest.raises(ConfigError, match="--compare-hf is not supported with --tp"):
        DecodeBenchConfig(tp=2, compare_hf=True)
    with pytest.raises(ConfigError, match="layers must be >= 1"):
        DecodeBenchConfig(layers=0)


def test_hf_compile_is_timed_or_its_failure_recorded(monkeypatch):
    pytest.importorskip("transformers")
    model = load_model("mixtral-tiny", seed=1)
    hf = hf_model_sharing(model)
    step = DecodeStep(model, KVCache(model.config, 2, 16), contiguous_slots=True)
    tokens = torch.tensor([5, 6])
    # Compiling for real needs a C++ toolchain here; the path around it is what is tested.
    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: module)
    timing = time_hf_decode(hf, step, tokens, 4, steps=1, repeats=1, compile=True)
    assert timing.compile_ms > 0 and timing.compile_note.startswith("compiled in")

    def broken(module, **kwargs):
        def fail(**inputs):
            raise RuntimeError("no backend")

        return fail

    monkeypatch.setattr(torch, "compile", broken)
    timing = time_hf_decode(hf, step, tokens, 4, steps=1, repeats=1, compile=True)
    assert timing.compile_ms is None and timing.compile_note == "failed: RuntimeError: no backend"
    assert timing.eager_ms > 0 and timing.argmax_agreement == 1.0
