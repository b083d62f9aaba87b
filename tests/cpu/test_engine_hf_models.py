"""Model features checked against transformers: Qwen3, MLP biases, activations, generation EOS,
the weight dtype.

Each test builds a random tiny checkpoint with transformers, saves it, loads it with graphtune
and compares logits (prefill and decode, float32) and, where it matters, greedy tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_engine_hf import build_hf, compare

from graphtune.engine import Engine, load_checkpoint, load_model
from graphtune.engine.hf_fields import HF_ACTIVATIONS
from graphtune.errors import CheckpointError

transformers = pytest.importorskip("transformers")


def test_qwen3_matches_hf(tmp_path):
    # head_dim 32 with hidden 64 / 4 heads: q is wider than the hidden state, as in Qwen3.
    hf, folder = build_hf("qwen3", tmp_path, head_dim=32, tie_word_embeddings=True)
    model = load_checkpoint(folder)
    assert model.config.qk_norm and model.config.dim_per_head == 32
    assert model.layers[0].q_norm is not None and model.layers[0].bqkv is None
    compare(hf, folder, prompt_len=9, decode_steps=5)


def test_qwen3_default_head_dim_is_transformers_default(tmp_path):
    # Qwen3Config's head_dim default is 128, not hidden_size // heads.
    hf, folder = build_hf("qwen3", tmp_path, head_dim=128)
    doc = json.loads((folder / "config.json").read_text())
    doc.pop("head_dim")
    (folder / "config.json").write_text(json.dumps(doc))
    assert load_checkpoint(folder).config.dim_per_head == 128
    compare(hf, folder, prompt_len=5, decode_steps=2)


def test_llama_mlp_bias_matches_hf(tmp_path):
    hf, folder = build_hf("llama", tmp_path, mlp_bias=True)
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        gen = torch.Generator().manual_seed(3)
        for name, param in hf.named_parameters():
            if name.endswith(".bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
    hf.save_pretrained(folder, safe_serialization=True)
    model = load_checkpoint(folder)
    assert model.config.mlp_bias and model.layers[0].b_down is not None
    compare(hf, folder)


@pytest.mark.parametrize("act", sorted(set(HF_ACTIVATIONS) - {"silu"}))
def test_llama_hidden_act_matches_hf(tmp_path, act):
    hf, folder = build_hf("llama", tmp_path, hidden_act=act)
    assert load_checkpoint(folder).config.hidden_act == HF_ACTIVATIONS[act]
    compare(hf, folder, prompt_len=5, decode_steps=2)


def _hf_greedy(hf, prompt: list[int], new: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, **kwargs)
    return out[0, len(prompt) :].tolist()


def test_eos_from_generation_config_stops_like_transformers(tmp_path):
    hf, folder = build_hf("llama", tmp_path)
    prompt = [5, 17, 42, 3]
    free = _hf_greedy(hf, prompt, 12, eos_token_id=None)
    stop = next(t for t in free[2:] if t not in free[:2])  # a token first generated at step >= 2
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [250, stop]}))
    hf_stopped = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = _hf_greedy(hf_stopped, prompt, 12)
    assert expected[-1] == stop and len(expected) < 12  # transformers stopped at it
    model = load_model(folder, device="cpu", dtype=torch.float32)
    assert model.config.eos_token_ids == (250, stop)
    engine = Engine(model, runner="eager", max_batch_size=1, max_seq_len=32)
    assert engine.generate([prompt], 12) == [expected]


def test_qwen3_preset_shape_and_tiny_step_run():
    from graphtune.engine.presets import get_preset

    shape = get_preset("qwen3-1.7b-shape")
    assert shape.qk_norm and shape.q_size == 2048 and shape.kv_size == 1024
    engine = Engine(load_model("qwen3-tiny"), runner="eager", max_batch_size=2, max_seq_len=32)
    outputs = engine.generate([[1, 2, 3], [4]], 4, stop_token_ids=[])
    assert [len(o) for o in outputs] == [4, 4]


@pytest.mark.parametrize("generation", [{"do_sample": False}, {"eos_token_id": None}])
def test_a_generation_config_without_eos_means_no_eos_as_in_transformers(tmp_path, generation):
    # transformers' generate reads generation_config.json alone when it exists: config.json's
    # eos_token_id does not stop it then.
    hf, folder = build_hf("llama", tmp_path)
    prompt = [5, 17, 42, 3]
    free = _hf_greedy(hf, prompt, 12, eos_token_id=None)
    stop = next(t for t in free[2:] if t not in free[:2])
    doc = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**doc, "eos_token_id": stop}))
    (folder / "generation_config.json").write_text(json.dumps(generation))
    expected = _hf_greedy(transformers.AutoModelForCausalLM.from_pretrained(folder), prompt, 12)
    assert expected == free  # the oracle: transformers did not stop at config.json's EOS
    model = load_model(folder, device="cpu", dtype=torch.float32)
    assert model.config.eos_token_ids == ()
    engine = Engine(model, runner="eager", max_batch_size=1, max_seq_len=32)
    assert engine.generate([prompt], 12) == [expected]


def _mixed_dtypes(folder, config_dtype: dict) -> None:
    """Rewrites ``folder``'s weights as bfloat16 but for a float32 LM head and final norm, and
    sets ``config.json``'s dtype fields (``None``: removed)."""
    from safetensors.torch import load_file, save_file

    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    keep = ("lm_head.weight", "model.norm.weight")
    tensors = {k: v if k in keep else v.to(torch.bfloat16) for k, v in tensors.items()}
    save_file(tensors, file, metadata={"format": "pt"})
    doc = json.loads((folder / "config.json").read_text())
    doc.pop("dtype", None)
    doc.pop("torch_dtype", None)
    doc.update({k: v for k, v in config_dtype.items() if v is not None})
    (folder / "config.json").write_text(json.dumps(doc))


DTYPE_FIELDS = {
    "dtype": ({"dtype": "bfloat16", "torch_dtype": "float16"}, torch.bfloat16),
    "torch_dtype": ({"dtype": None, "torch_dtype": "float32"}, torch.float32),
    # Neither field: the first floating-point tensor of the file in its (sorted) key order, here
    # the float32 lm_head.weight, not the bfloat16 embedding (save_pretrained writes dtype).
    "neither": ({}, torch.float32),
}


@pytest.mark.parametrize("case", sorted(DTYPE_FIELDS))
def test_dtype_none_loads_every_tensor_in_one_dtype_as_transformers(tmp_path, case):
    fields, dtype = DTYPE_FIELDS[case]
    hf, folder = build_hf("llama", tmp_path)
    _mixed_dtypes(folder, fields)
    auto = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert {p.dtype for p in auto.parameters()} == {dtype}  # the oracle: dtype="auto"
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    model = load_model(folder, device="cpu")
    tensors = [model.embed, model.lm_head, model.final_norm]
    tensors += [t for layer in model.layers for t in vars(layer).values()]
    assert {t.dtype for t in tensors if isinstance(t, torch.Tensor)} == {dtype}
    engine = Engine(model, runner="eager", max_batch_size=1, max_seq_len=32)
    prompt = [5, 17, 42, 3]
    assert engine.generate([prompt], 6, stop_token_ids=[]) == [_hf_greedy(hf, prompt, 6)]


def test_an_explicit_dtype_wins_and_a_bad_config_dtype_is_one_line(tmp_path):
    _, folder = build_hf("llama", tmp_path)
    _mixed_dtypes(folder, {"dtype": "int8"})
    assert load_model(folder, device="cpu", dtype=torch.float16).dtype == torch.float16
    with pytest.raises(CheckpointError, match=r"config\.json: dtype='int8' is not a weight dtype"):
        load_model(folder, device="cpu")


@pytest.mark.parametrize("metadata", [None, "bfloat16"])
def test_dtype_none_of_a_sharded_checkpoint_is_the_index_metadata_else_the_first_shard(
    tmp_path, metadata
):
    from safetensors.torch import load_file, save_file

    _, folder = build_hf("llama", tmp_path, max_shard_size="40KB")
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    # The first shard float16, the others float32: which one the dtype comes from shows.
    first = load_file(folder / shards[0])
    save_file({k: v.half() for k, v in first.items()}, folder / shards[0], {"format": "pt"})
    index["metadata"].pop("dtype", None)
    if metadata is not None:
        index["metadata"]["dtype"] = metadata
    index_file.write_text(json.dumps(index))
    doc = json.loads((folder / "config.json").read_text())
    doc.pop("dtype", None)
    doc.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(doc))
    auto = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = getattr(torch, metadata) if metadata else torch.float16
    assert {p.dtype for p in auto.parameters()} == {expected}  # the oracle: dtype="auto"
    assert load_model(folder, device="cpu").dtype == expected
