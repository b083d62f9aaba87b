"""Qwen3-MoE and Mixtral in the engine against transformers' own models (the oracle).

Tiny random checkpoints are built and saved by transformers (``Qwen3MoeForCausalLM``,
``MixtralForCausalLM``), loaded by graphtune, and run through prefill and decode steps: logits
close to transformers' full-sequence forward in float32, and greedy tokens equal through the
Engine with the eager runner and with the graph runner (which without CUDA runs the step eagerly
and records why). Both checkpoint layouts are read: per expert (what transformers 5 writes by
default and what the Hub holds) and fused (``save_original_format=False``).
"""

from __future__ import annotations

import pytest
import torch
from hf_weights import randomize

from graphtune.engine import DecodeStep, Engine, KVCache, load_checkpoint, prefill
from graphtune.errors import CheckpointError

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# head_dim 32 is not hidden / heads (16), as in Qwen3-30B-A3B (128 vs 64).
QWEN3_MOE = dict(
    intermediate_size=96,
    moe_intermediate_size=32,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)
MIXTRAL = dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
PROMPTS = [[5, 17, 99, 3, 250], [7, 3], [42, 1, 8, 8, 200, 13, 9]]


def build_hf(kind: str, tmp_path, *, seed: int = 0, original_format: bool = True, **overrides):
    """A random transformers model of ``kind`` saved with safetensors: ``(model, folder)``."""
    torch.manual_seed(seed)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**{**TINY, **QWEN3_MOE, **overrides})
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**{**TINY, **MIXTRAL, **overrides})
        model = transformers.MixtralForCausalLM(config)
    model.config._attn_implementation = "eager"
    model.set_experts_implementation("eager")  # transformers' loop over the selected experts
    randomize(model, seed)
    model.eval()
    folder = tmp_path / f"{kind}-{'hub' if original_format else 'fused'}"
    model.save_pretrained(folder, save_original_format=original_format)
    return model, folder


def compare(hf_model, folder, prompt_len: int = 7, decode_steps: int = 5, tol: float = 1e-4):
    """Prefill + decode logits of the engine vs transformers' full-sequence forward."""
    ours = load_checkpoint(folder, dtype=torch.float32)
    step = DecodeStep(ours, KVCache(ours.config, max_batch_size=3, max_seq_len=64))
    seq = torch.randint(
        0, 256, (prompt_len + decode_steps,), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = hf_model(seq[None]).logits[0].float()
    slot = 1
    with torch.inference_mode():
        got = prefill(step, seq[:prompt_len], slot, all_logits=True)
        torch.testing.assert_close(got, expected[:prompt_len], rtol=tol, atol=tol)
        for i in range(decode_steps):
            pos = prompt_len + i
            logits = step(seq[pos : pos + 1], torch.tensor([pos]), torch.tensor([slot]))
            torch.testing.assert_close(logits[0], expected[pos], rtol=tol, atol=tol)
    assert expected.std() > 0.1  # not near-constant logits
    return ours


def hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_moe_logits_and_greedy_tokens_match_transformers(kind, tmp_path):
    hf, folder = build_hf(kind, tmp_path)
    ours = compare(hf, folder)
    cfg = ours.config
    assert cfg.architecture == kind and cfg.num_experts == hf.config.num_experts
    assert all(layer.is_moe and layer.w_gate_up is None for layer in ours.layers)
    assert (ours.layers[0].q_norm is not None) == (kind == "qwen3_moe") == cfg.qk_norm
    want = [hf_greedy(hf, prompt, 6) for prompt in PROMPTS]
    # Eager only: on the CPU a graph runner's calls fall back to eager (the graphs of the MoE
    # step are checked in test_engine_moe_graph.py and tests/gpu/test_engine_moe.py).
    engine = Engine(ours, runner="eager", max_batch_size=3, max_seq_len=32)
    # Three requests decode together: the routing of several tokens per step.
    assert engine.generate(PROMPTS, 6, stop_token_ids=[]) == want


def test_qwen3_moe_dense_layers_follow_mlp_only_layers_and_decoder_sparse_step(tmp_path):
    # (i + 1) % 2 == 0 makes layers 1 and 3 sparse; mlp_only_layers takes layer 3 back.
    hf, folder = build_hf(
        "qwen3_moe", tmp_path, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]
    )
    ours = compare(hf, folder, decode_steps=3)
    assert [layer.is_moe for layer in ours.layers] == [False, True, False, False]
    assert ours.layers[0].w_gate_up.shape == (2 * 96, 64)


def test_qwen3_moe_without_renormalisation_matches_transformers(tmp_path):
    # norm_topk_prob=False: the top-k softmax probabilities are used as they are.
    compare(*build_hf("qwen3_moe", tmp_path, norm_topk_prob=False), decode_steps=3)


def test_mixtral_sliding_window_matches_transformers(tmp_path):
    hf, folder = build_hf("mixtral", tmp_path, sliding_window=4)
    assert compare(hf, folder, prompt_len=9, decode_steps=3).config.sliding_window == 4


def test_mixtral_sliding_layers_without_a_window_are_refused(tmp_path):
    # Read as full attention before: the refusal documented for Mixtral's sliding_window was
    # only Mistral's. MixtralConfig has no layer_types field but keeps it, and its cache fails.
    from graphtune.errors import ConfigError

    hf, folder = build_hf("mixtral", tmp_path, layer_types=["sliding_attention"] * 2)
    assert hf.config.sliding_window is None
    with pytest.raises(TypeError):  # the oracle: transformers' forward cannot run it
        hf(torch.arange(4)[None])
    with pytest.raises(ConfigError, match=r"config\.json: sliding_window=None is not implemented"):
        load_checkpoint(folder)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_fused_expert_layout_loads_the_same_weights(kind, tmp_path):
    hf, hub = build_hf(kind, tmp_path)
    _, fused = build_hf(kind, tmp_path, original_format=False)
    assert not any("experts.0." in p.name for p in fused.iterdir())
    a, b = load_checkpoint(hub), load_checkpoint(fused)
    for la, lb, hl in zip(a.layers, b.layers, hf.model.layers, strict=True):
        for name in ("router", "experts_gate_up", "experts_down"):
            assert torch.equal(getattr(la, name), getattr(lb, name)), name
        assert torch.equal(la.experts_gate_up, hl.mlp.experts.gate_up_proj)
        assert torch.equal(la.experts_down, hl.mlp.experts.down_proj)
        assert torch.equal(la.router, hl.mlp.gate.weight)


def test_a_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = build_hf("mixtral", tmp_path)
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.1\.block_sparse_moe\.experts\.2\.w3"):
        load_checkpoint(folder)
