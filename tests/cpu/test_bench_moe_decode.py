"""The MoE decode benchmark's parts on the CPU: the bytes a step reads from its own routing, the
uniform-routing expectation, and `bench decode` of an MoE preset with --compare-hf and --layers
end to end (the transformers comparison itself: tests/cpu/test_bench_hf.py)."""

from __future__ import annotations

import json

import pytest
import torch

from graphtune.bench.moe_floor import (
    expected_experts_hit,
    experts_hit,
    record_routing,
    step_bytes,
    step_weight_bytes,
)
from graphtune.engine import DecodeStep, KVCache, random_model
from graphtune.engine.presets import get_preset
from graphtune.errors import InputError
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


def test_bench_decode_compare_hf_and_layers_end_to_end(tmp_path, capsys):
    pytest.importorskip("transformers")
    from graphtune.cli.main import main

    out = tmp_path / "moe.json"
    args = ["bench", "decode", "--model", "qwen3-moe-tiny", "--batch-sizes", "1,3"]
    args += ["--context", "6", "--steps", "1", "--repeats", "1", "--device", "cpu"]
    assert main([*args, "--compare-hf", "--layers", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "transformers vs engine" in text and "experts hit: distinct" in text
    data = json.loads(out.read_text())
    assert data["model"]["name"] == "qwen3-moe-tiny[1 of 2 layers]"
    assert any("quick run" in note for note in data["notes"])
    assert any("timed eagerly (an MoE model" in note for note in data["notes"])
    for r in data["results"]:
        assert len(r["experts_hit"]) == 1 and r["hf_eager_ms"] > 0 and r["hf_ms"] is None
        assert r["hf_argmax_agreement"] == 1.0 and r["speedup_over_hf"] > 0
        assert r["weight_bytes_read"] < data["model"]["weight_bytes"]
    assert main([*args, "--hf-compile"]) == 1  # a failure, one error line
    assert "add --compare-hf" in capsys.readouterr().err
    assert main([*args, "--layers", "3"]) == 1
    assert "has only 2 layers" in capsys.readouterr().err
