"""``config.json`` read the way transformers reads it where its rules are subtle: a file edited by
hand is loaded by transformers (``from_pretrained``, the oracle) and by graphtune from the same
folder, and their logits must agree, or graphtune must refuse the file in one line."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine_hf import LLAMA3_SCALING, TINY, build_hf, compare

from graphtune.engine import Engine, load_checkpoint, load_model
from graphtune.engine.config import from_hf_config
from graphtune.errors import CheckpointError, ConfigError, InputError

transformers = pytest.importorskip("transformers")


def _edit(folder, **changes) -> None:
    doc = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value
    (folder / "config.json").write_text(json.dumps(doc))


def _transformers(folder):
    """transformers' own reading of the folder, as a user's ``from_pretrained`` does it."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize("kind", ["full_attention", "sliding_attention"])
def test_mistral_layer_types_of_one_kind_match_transformers(tmp_path, kind):
    # transformers reads a Mistral file with layer_types as Ministral: each layer's type decides
    # whether the window applies.
    _, folder = build_hf("mistral", tmp_path, sliding_window=4)
    _edit(folder, layer_types=[kind] * TINY["num_hidden_layers"])
    window = load_checkpoint(folder).config.sliding_window
    assert window == (4 if kind == "sliding_attention" else None)
    compare(_transformers(folder), folder, prompt_len=9, decode_steps=4)


def test_mistral_with_both_layer_types_is_refused(tmp_path):
    _, folder = build_hf("mistral", tmp_path, sliding_window=4)
    _edit(folder, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ConfigError, match="layer_types=.*Ministral"):
        load_checkpoint(folder)


def test_a_mistral_file_without_num_key_value_heads_gets_transformers_default_of_8(tmp_path):
    # MistralConfig defaults to 8 KV heads, not num_attention_heads (16 here).
    shape = dict(hidden_size=128, num_attention_heads=16, num_key_value_heads=8)
    _, folder = build_hf("mistral", tmp_path, sliding_window=None, **shape)
    _edit(folder, num_key_value_heads=None)
    assert load_checkpoint(folder).config.num_kv_heads == 8
    compare(_transformers(folder), folder, prompt_len=9, decode_steps=4)


def test_a_tied_config_whose_file_has_another_lm_head_uses_that_head(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    _, folder = build_hf("llama", tmp_path, tie_word_embeddings=True)
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    tensors["lm_head.weight"] = torch.randn(TINY["vocab_size"], TINY["hidden_size"])
    save_file(tensors, file, metadata={"format": "pt"})
    model = load_checkpoint(folder)
    assert not model.config.tie_word_embeddings and model.lm_head is not model.embed
    assert "differs" in caplog.text
    compare(_transformers(folder), folder)


def test_a_tied_config_whose_file_repeats_the_embedding_keeps_one_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = build_hf("llama", tmp_path, tie_word_embeddings=True)
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    model = load_checkpoint(folder)
    assert model.config.tie_word_embeddings and model.lm_head is model.embed


def test_a_tied_config_whose_file_stores_only_the_head_uses_it_for_both(tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = build_hf("llama", tmp_path, tie_word_embeddings=True)
    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    model = load_checkpoint(folder)
    assert model.config.tie_word_embeddings and model.lm_head is model.embed
    compare(_transformers(folder), folder)


@pytest.mark.parametrize("written_as", ["qwen2", "mistral"])
def test_architectures_that_disagree_with_model_type_are_refused(tmp_path, written_as):
    # transformers builds the model model_type names; reading architectures instead dropped
    # Qwen2's q/k/v biases or Mistral's window.
    _, folder = build_hf(written_as, tmp_path, sliding_window=4)
    _edit(folder, architectures=["LlamaForCausalLM"])
    with pytest.raises(CheckpointError, match=f"model_type is '{written_as}'"):
        load_checkpoint(folder)


ROPE_FILES = {
    # A top-level original_max_position_embeddings wins over rope_parameters' own for llama3.
    "llama3 top-level original": dict(
        rope_parameters={"rope_theta": 500000.0, **LLAMA3_SCALING},
        original_max_position_embeddings=8,
    ),
    # Without one anywhere, max_position_embeddings stands in.
    "llama3 without original": dict(
        rope_parameters={
            "rope_theta": 500000.0,
            **{k: v for k, v in LLAMA3_SCALING.items() if k != "original_max_position_embeddings"},
        },
    ),
    # The legacy rope_scaling replaces rope_parameters, and its own theta wins.
    "rope_scaling with its theta": dict(
        rope_parameters=None,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 50.0},
    ),
    # Default RoPE in transformers' six models ignores partial_rotary_factor; so does the engine.
    "default with partial_rotary_factor": dict(partial_rotary_factor=0.5),
    "default with partial_rotary_factor inside": dict(
        rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5}
    ),
    "rope_scaling beside rope_parameters": dict(
        rope_parameters={"rope_type": "default", "rope_theta": 100.0},
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_theta=5000.0,
    ),
}


@pytest.mark.parametrize("case", sorted(ROPE_FILES))
def test_rope_fields_are_read_as_transformers_reads_them(tmp_path, case):
    _, folder = build_hf("llama", tmp_path)
    _edit(folder, **ROPE_FILES[case])
    compare(_transformers(folder), folder, prompt_len=20, decode_steps=4)


PARTIAL_ROTARY = {
    "linear, inside": dict(
        rope_parameters={
            "rope_type": "linear",
            "factor": 2.0,
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.5,
        }
    ),
    "linear, top level": dict(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        partial_rotary_factor=0.5,
    ),
    "llama3, inside": dict(
        rope_parameters={**LLAMA3_SCALING, "rope_theta": 1e4, "partial_rotary_factor": 0.25}
    ),
    "legacy rope_scaling": dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0}, partial_rotary_factor=0.5
    ),
}


@pytest.mark.parametrize("case", sorted(PARTIAL_ROTARY))
def test_partial_rotary_factor_with_scaled_rope_is_refused(tmp_path, case):
    # transformers rotates part of each head there and fails on the width; the engine rotates
    # whole heads, so it must refuse the file rather than compute another model.
    _, folder = build_hf("llama", tmp_path)
    _edit(folder, **PARTIAL_ROTARY[case])
    with pytest.raises(ConfigError, match=r"partial_rotary_factor=0\.\d+ with rope_type="):
        load_checkpoint(folder)
    with pytest.raises(RuntimeError):  # the oracle: transformers cannot run it either
        _transformers(folder)(torch.arange(4)[None])


WRONG_TYPES = [
    ("tie_word_embeddings", "false"),
    ("mlp_bias", 0),
    ("num_hidden_layers", 2.0),
    ("vocab_size", "256"),
    ("rms_norm_eps", "1e-6"),
    ("num_key_value_heads", True),
    ("head_dim", 0),
    ("architectures", "LlamaForCausalLM"),
    ("eos_token_id", "two"),
    ("rope_parameters", "default"),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 10000.0}),
    ("rope_parameters", {"rope_type": "linear", "factor": "2", "rope_theta": 10000.0}),
    ("rope_parameters", {"rope_type": "default", "rope_theta": None}),
]


@pytest.mark.parametrize("field,value", WRONG_TYPES)
def test_values_transformers_refuses_are_refused_in_one_line(field, value):
    doc = {**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama", field: value}
    with pytest.raises(CheckpointError) as info:
        from_hf_config(doc)
    assert "\n" not in str(info.value) and field in str(info.value) + str(value)


def test_moe_fields_of_the_wrong_type_are_refused():
    doc = dict(TINY, architectures=["Qwen3MoeForCausalLM"], num_experts=4, moe_intermediate_size=32)
    with pytest.raises(CheckpointError, match="norm_topk_prob='false' must be true or false"):
        from_hf_config({**doc, "norm_topk_prob": "false"})
    with pytest.raises(CheckpointError, match="num_experts_per_tok=2.0 must be an integer"):
        from_hf_config({**doc, "num_experts_per_tok": 2.0})


def test_generation_config_eos_of_the_wrong_type_names_the_file(tmp_path):
    _, folder = build_hf("llama", tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [None]}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id=\[None\]"):
        load_checkpoint(folder)


@pytest.mark.parametrize(
    "settings,named",
    [
        ({"repetition_penalty": 1.5, "temperature": 0.6}, ["repetition_penalty=1.5"]),
        (
            {"do_sample": True, "temperature": 0.6, "top_p": 0.9},
            ["do_sample=True", "temperature=0.6", "top_p=0.9"],
        ),
        ({"do_sample": False, "temperature": 1.0, "top_k": 50, "max_length": 4096}, []),
        ({"suppress_tokens": [], "bad_words_ids": []}, []),
    ],
)
def test_generation_settings_graphtune_does_not_read_are_warned_about(
    tmp_path, caplog, settings, named
):
    # transformers' generate() applies these to greedy or sampled decoding; graphtune reads only
    # eos_token_id, so its tokens would differ without a word.
    _, folder = build_hf("llama", tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **settings}))
    with caplog.at_level("WARNING", logger="graphtune.engine.loading"):
        load_checkpoint(folder)
    warned = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    if not named:
        assert warned == []
        return
    assert len(warned) == 1
    for text in named:
        assert text in warned[0]
    assert "temperature=0.6" not in warned[0] or settings.get("do_sample")


_SLIDING = dict(use_sliding_window=True, sliding_window=4)
MALFORMED_WINDOWS = [
    *((kind, "max_window_layers", v) for kind in ("qwen2", "qwen3") for v in (None, "x")),
    *((kind, "layer_types", v) for kind in ("qwen2", "qwen3", "mistral") for v in (7, [1, 2])),
]


@pytest.mark.parametrize("kind,field,value", MALFORMED_WINDOWS)
def test_malformed_window_fields_are_one_checkpoint_error_line(tmp_path, kind, field, value):
    _, folder = build_hf(kind, tmp_path)
    _edit(folder, layer_types=None, **(_SLIDING if field == "max_window_layers" else {}))
    doc = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**doc, field: value}))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(folder / "config.json"))
    assert f"{field}={value!r}" in message and "fix the file" in message


@pytest.mark.parametrize("value", [None, 3])
def test_an_index_entry_that_is_not_a_file_name_is_one_line(tmp_path, capsys, value):
    from graphtune.cli.main import main

    _, folder = build_hf("llama", tmp_path, max_shard_size="40KB")
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.embed_tokens.weight"] = value
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"index\.json: weight_map\['model\.embed_tokens"):
        load_checkpoint(folder)
    args = ["generate", "--model", str(folder), "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    assert main([*args, "--runner", "eager", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and f"={value}" in line


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("window", [dict(use_sliding_window=False), dict(sliding_window=None)])
def test_qwen_sliding_layer_types_without_a_window_are_refused(tmp_path, kind, window):
    # transformers keeps layer_types but drops the window, and then cannot run those layers.
    _, folder = build_hf(kind, tmp_path)
    doc = json.loads((folder / "config.json").read_text())
    doc.update(_SLIDING, layer_types=["sliding_attention", "full_attention"], **window)
    (folder / "config.json").write_text(json.dumps(doc))
    with pytest.raises(TypeError):  # the oracle
        _transformers(folder)(torch.arange(4)[None])
    with pytest.raises(ConfigError, match=r"config\.json: layer_types=\['sliding_attention'"):
        load_checkpoint(folder)


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_rope_parameters_keyed_by_layer_type_are_refused(tmp_path, kind):
    # Read flat, the nested linear factor and theta were dropped: default RoPE, another model.
    _, folder = build_hf(kind, tmp_path)
    nested = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}}
    _edit(folder, layer_types=["full_attention"] * TINY["num_hidden_layers"])
    _edit(folder, rope_parameters=nested, rope_theta=None, sliding_window=None)
    with pytest.raises(KeyError, match="rope_type"):  # the oracle
        _transformers(folder)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    message = str(info.value)
    assert (
        "\n" not in message and "rope_parameters holds objects under ['full_attention']" in message
    )


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_layer_types_of_another_length_than_the_layers_are_refused(tmp_path, kind):
    _, folder = build_hf(kind, tmp_path)
    _edit(folder, layer_types=["full_attention"] * (TINY["num_hidden_layers"] + 1))
    # The oracle (huggingface_hub's StrictDataclassClassValidationError wraps the ValueError).
    with pytest.raises(Exception, match="must be equal to the number of `layer_types`"):
        _transformers(folder)
    layers = TINY["num_hidden_layers"]
    with pytest.raises(CheckpointError, match=rf"layer_types has {layers + 1} entries but "):
        load_checkpoint(folder)


def test_mistral_sliding_layers_without_a_window_are_refused(tmp_path):
    # Read as full attention before; transformers' model fails on them.
    _, folder = build_hf("mistral", tmp_path, sliding_window=None)
    _edit(folder, layer_types=["sliding_attention"] * TINY["num_hidden_layers"])
    with pytest.raises(TypeError):  # the oracle: transformers' forward cannot run it
        _transformers(folder)(torch.arange(4)[None])
    with pytest.raises(ConfigError, match=r"config\.json: sliding_window=None is not implemented"):
        load_checkpoint(folder)


def test_requests_keep_to_the_callers_max_seq_len_not_the_caches():
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=1, max_seq_len=20)
    assert engine.max_seq_len == 32  # the cache rounds up to a multiple of 16
    assert len(engine.generate([[1] * 10], 11, stop_token_ids=[])[0]) == 11  # 20 positions
    with pytest.raises(InputError, match="need 21 positions.*max_seq_len=20"):
        engine.generate([[1] * 10], 12)


NON_FINITE = [
    ("rms_norm_eps", "NaN"),
    ("rope_theta", "Infinity"),
    ("rope_theta", "-Infinity"),
]


@pytest.mark.parametrize("field,constant", NON_FINITE)
def test_nan_or_infinity_in_config_json_is_one_line_naming_the_field(tmp_path, field, constant):
    # Python's json writes and reads NaN/Infinity; JSON has neither, and the engine would turn
    # them into non-finite logits blamed on the weights.
    _, folder = build_hf("llama", tmp_path)
    _edit(folder, **{field: float(constant.replace("Infinity", "inf"))})
    assert constant in (folder / "config.json").read_text()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(folder / "config.json"))
    assert message.count("config.json") == 1  # named once
    assert f"{field}={constant}" in message and "fix the file" in message


@pytest.mark.parametrize("field", ["rope_theta", "rms_norm_eps"])
def test_an_integer_too_large_for_a_float_is_one_line_naming_the_field(tmp_path, field, capsys):
    # float() of it raised OverflowError: a traceback from `graphtune generate --model DIR`.
    from graphtune.cli.main import main

    _, folder = build_hf("llama", tmp_path)
    _edit(folder, rope_parameters=None, **{field: 12345})
    doc = json.loads((folder / "config.json").read_text())
    text = json.dumps(doc).replace("12345", "1" + "0" * 400)
    (folder / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=rf"{field}=1000000000\.\.\. \(401 digits\) is"):
        load_checkpoint(folder)
    assert main(["generate", "--model", str(folder), "--prompt-ids", "1", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "too large for a float" in err and "Trace" not in err
    # A config built in Python never passes through parse_json.
    with pytest.raises(CheckpointError, match=f"{field}=an int of about 401 digits is too large"):
        from_hf_config({**doc, field: 10**400})


def test_rms_norm_eps_0_is_read_and_matches_transformers(tmp_path):
    # transformers takes any eps, 0 included; graphtune refused the folder.
    _, folder = build_hf("llama", tmp_path)
    _edit(folder, rms_norm_eps=0.0)
    assert load_checkpoint(folder).config.rms_norm_eps == 0.0
    compare(_transformers(folder), folder, prompt_len=5, decode_steps=2)
    with pytest.raises(ConfigError, match="rms_norm_eps must be a finite number >= 0"):
        from graphtune.engine.presets import PRESETS

        PRESETS["tiny"].replace(rms_norm_eps=-1e-6)


def test_nan_inside_rope_scaling_names_its_field(tmp_path):
    _, folder = build_hf("llama", tmp_path)
    _edit(folder, rope_scaling={**LLAMA3_SCALING, "factor": float("nan")})
    with pytest.raises(CheckpointError, match=r"config\.json: factor=NaN is not a finite number"):
        load_checkpoint(folder)


@pytest.mark.parametrize(
    "field", ["rms_norm_eps", "rope_theta", "factor", "low_freq_factor", "high_freq_factor"]
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 10**400], ids=["nan", "inf", "big"])
def test_every_float_field_must_be_finite(field, value):
    # A config built in Python never passes through read_json.
    from graphtune.engine.config import RopeScaling
    from graphtune.engine.presets import PRESETS

    with pytest.raises(ConfigError, match=f"{field} must be a finite number"):
        if field in ("rms_norm_eps", "rope_theta"):
            PRESETS["tiny"].replace(**{field: value})
        else:
            RopeScaling(**{**LLAMA3_SCALING, field: value})


def test_mixtral_expert_count_as_num_experts_matches_transformers(tmp_path):
    # MixtralConfig.attribute_map reads num_experts as num_local_experts (not its default 8).
    import test_engine_moe_hf as moe

    hf, folder = moe.build_hf("mixtral", tmp_path)
    doc = json.loads((folder / "config.json").read_text())
    doc["num_experts"] = doc.pop("num_local_experts")
    (folder / "config.json").write_text(json.dumps(doc))
    oracle = _transformers(folder)
    oracle.set_experts_implementation("eager")
    assert oracle.config.num_local_experts == 4
    assert moe.compare(oracle, folder, decode_steps=3).config.num_experts == 4
    _edit(folder, num_local_experts=6)
    with pytest.raises(ConfigError, match="num_local_experts=6: disagrees with num_experts=4"):
        load_checkpoint(folder)


@pytest.mark.parametrize("mlp_only", [[0, 5], [-1], [1, -1, 7]])
def test_qwen3_moe_mlp_only_layers_naming_no_layer_match_transformers(tmp_path, caplog, mlp_only):
    # transformers asks `layer_idx in mlp_only_layers`: 5 and -1 are no layer of the two.
    import test_engine_moe_hf as moe

    hf, folder = moe.build_hf("qwen3_moe", tmp_path, mlp_only_layers=mlp_only)
    ours = moe.compare(hf, folder, decode_steps=3)
    assert [layer.is_moe for layer in ours.layers] == [i not in mlp_only for i in range(2)]
    assert "name no layer" in caplog.text


def test_qwen3_moe_without_experts_is_dense_as_in_transformers(tmp_path):
    import test_engine_moe_hf as moe

    hf, folder = moe.build_hf("qwen3_moe", tmp_path, num_experts=0)
    ours = moe.compare(hf, folder, decode_steps=3)
    assert ours.config.num_experts == 0 and not any(layer.is_moe for layer in ours.layers)
