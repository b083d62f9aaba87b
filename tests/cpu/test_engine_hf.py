"""The engine's logits equal Hugging Face transformers' own models built from the same weights."""

from __future__ import annotations

import pytest
import torch
from hf_weights import TINY, randomize

from graphtune.engine import DecodeStep, KVCache, load_checkpoint, prefill
from graphtune.errors import CheckpointError

transformers = pytest.importorskip("transformers")

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def build_hf(kind: str, tmp_path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Builds a random HF model of ``kind``, saves it with safetensors, returns (model, folder)."""
    torch.manual_seed(seed)
    if kind == "llama":
        config = transformers.LlamaConfig(**{**TINY, **overrides})
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**{**TINY, **overrides})
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**{**TINY, **overrides})
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.MistralConfig(**{**TINY, **overrides})
        model = transformers.MistralForCausalLM(config)
    config._attn_implementation = "eager"
    randomize(model, seed)
    model.eval()
    folder = tmp_path / kind
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **extra)
    return model, folder


def compare(
    hf_model,
    folder,
    prompt_len: int = 7,
    decode_steps: int = 5,
    device: str = "cpu",
    tol: float = 1e-4,
):
    """Prefill + decode logits of our engine vs HF's full-sequence forward, in float32."""
    ours = load_checkpoint(folder, device=device, dtype=torch.float32)
    cache = KVCache(ours.config, max_batch_size=3, max_seq_len=64, device=device)
    step = DecodeStep(ours, cache)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, ours.config.vocab_size, (prompt_len + decode_steps,), generator=gen)
    hf_model = hf_model.to(device)
    with torch.no_grad():
        expected = hf_model(seq[None].to(device)).logits[0].float()
    slot = 1  # not slot 0, so slot indexing is exercised
    with torch.inference_mode():
        got_prefill = prefill(step, seq[:prompt_len].to(device), slot, all_logits=True)
        torch.testing.assert_close(got_prefill, expected[:prompt_len], rtol=tol, atol=tol)
        for i in range(decode_steps):
            pos = prompt_len + i
            logits = step(
                torch.tensor([seq[pos]], device=device),
                torch.tensor([pos], device=device),
                torch.tensor([slot], device=device),
            )
            torch.testing.assert_close(logits[0], expected[pos], rtol=tol, atol=tol)
    assert expected.std() > 0.1  # the comparison is not between near-constant logits


def test_llama_matches_hf(tmp_path):
    compare(*build_hf("llama", tmp_path))


def test_llama3_rope_scaling_and_tied_embeddings_match_hf(tmp_path):
    hf, folder = build_hf(
        "llama",
        tmp_path,
        rope_parameters={"rope_theta": 500000.0, **LLAMA3_SCALING},
        tie_word_embeddings=True,
    )
    cfg = load_checkpoint(folder).config
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3"
    assert cfg.tie_word_embeddings
    compare(hf, folder, prompt_len=20, decode_steps=6)


def test_qwen2_matches_hf(tmp_path):
    hf, folder = build_hf("qwen2", tmp_path)
    assert load_checkpoint(folder).layers[0].bqkv is not None
    compare(hf, folder)


def test_mistral_sliding_window_matches_hf(tmp_path):
    hf, folder = build_hf("mistral", tmp_path, sliding_window=4)
    assert load_checkpoint(folder).config.sliding_window == 4
    compare(hf, folder, prompt_len=9, decode_steps=4)


def test_sharded_checkpoint_loads(tmp_path):
    hf, folder = build_hf("llama", tmp_path, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").exists()
    assert len(list(folder.glob("*.safetensors"))) > 1
    compare(hf, folder, decode_steps=2)


def _tiny_folder(tmp_path):
    return build_hf("llama", tmp_path)[1]


def _rewrite(folder, drop=None, reshape=None):
    from safetensors.torch import load_file, save_file

    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    folder = _tiny_folder(tmp_path)
    _rewrite(folder, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(folder)


def test_shape_mismatch_is_named(tmp_path):
    folder = _tiny_folder(tmp_path)
    _rewrite(folder, reshape="model.layers.0.self_attn.k_proj.weight")
    name = r"model\.layers\.0\.self_attn\.k_proj\.weight"
    with pytest.raises(CheckpointError, match=name + ".*shape"):
        load_checkpoint(folder)
