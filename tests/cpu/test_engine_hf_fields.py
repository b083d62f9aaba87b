"""Every field of each supported transformers config class is handled (with a test against
transformers), ignored (it does not change the math) or refused with a one-line error."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import test_engine_hf
import test_engine_hf_config_reading
import test_engine_hf_models
import test_engine_moe_config
import test_engine_moe_hf

from graphtune.engine.config import ARCHITECTURES, from_hf_config
from graphtune.engine.hf_fields import (
    HANDLED_FIELDS,
    HF_DEFAULTS,
    HF_LAYER_TYPES,
    HF_ROPE_THETA,
    IGNORED_FIELDS,
    REFUSALS,
    REFUSED_EXTRAS,
)
from graphtune.errors import CheckpointError, ConfigError, InputError

transformers = pytest.importorskip("transformers")

CLASSES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "mistral": transformers.MistralConfig,
    "qwen3": transformers.Qwen3Config,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "mixtral": transformers.MixtralConfig,
}
TINY = dict(test_engine_hf.TINY)

#: The tests that check each handled field against transformers' model (or, for the fields that
#: only bound a request, against the rule that uses them).
ORACLES = {
    "architectures": [
        "test_llama_matches_hf",
        "test_qwen2_matches_hf",
        "test_qwen3_matches_hf",
        "test_moe_logits_and_greedy_tokens_match_transformers",
    ],
    "model_type": [
        "test_model_type_alone_selects_the_architecture",
        "test_architectures_that_disagree_with_model_type_are_refused",
    ],
    "vocab_size": ["test_llama_matches_hf"],
    "hidden_size": ["test_llama_matches_hf"],
    "intermediate_size": ["test_llama_matches_hf"],
    "num_hidden_layers": ["test_llama_matches_hf"],
    "num_attention_heads": ["test_llama_matches_hf"],
    "num_key_value_heads": [
        "test_llama_matches_hf",
        "test_mistral_sliding_window_matches_hf",
        "test_a_mistral_file_without_num_key_value_heads_gets_transformers_default_of_8",
    ],
    "head_dim": ["test_qwen3_matches_hf", "test_qwen3_default_head_dim_is_transformers_default"],
    "hidden_act": ["test_llama_hidden_act_matches_hf", "test_hidden_act_of_every_architecture"],
    "rms_norm_eps": ["test_llama_matches_hf", "test_qwen2_matches_hf"],
    "rope_parameters": [
        "test_llama3_rope_scaling_and_tied_embeddings_match_hf",
        "test_rope_fields_are_read_as_transformers_reads_them",
    ],
    "max_position_embeddings": ["test_max_position_embeddings_bounds_a_request"],
    "tie_word_embeddings": [
        "test_llama3_rope_scaling_and_tied_embeddings_match_hf",
        "test_a_tied_config_whose_file_has_another_lm_head_uses_that_head",
    ],
    "eos_token_id": [
        "test_eos_from_generation_config_stops_like_transformers",
        "test_a_generation_config_without_eos_means_no_eos_as_in_transformers",
    ],
    "dtype": ["test_dtype_none_loads_every_tensor_in_one_dtype_as_transformers"],
    "torch_dtype": ["test_dtype_none_loads_every_tensor_in_one_dtype_as_transformers"],
    "mlp_bias": ["test_llama_mlp_bias_matches_hf"],
    "attention_bias": ["test_llama_matches_hf", "test_qwen3_matches_hf"],
    "sliding_window": [
        "test_mistral_sliding_window_matches_hf",
        "test_qwen2_matches_hf",
        "test_mixtral_sliding_window_matches_transformers",
    ],
    "use_sliding_window": ["test_qwen2_matches_hf", "test_qwen3_matches_hf"],
    "max_window_layers": ["test_qwen2_matches_hf", "test_qwen3_matches_hf"],
    "layer_types": [
        "test_qwen2_matches_hf",
        "test_qwen3_matches_hf",
        "test_mistral_layer_types_of_one_kind_match_transformers",
    ],
    # The experts of Qwen3-MoE and Mixtral (tests/cpu/test_engine_moe_hf.py, _moe_config.py).
    "num_experts": [
        "test_moe_logits_and_greedy_tokens_match_transformers",
        "test_mixtral_expert_count_as_num_experts_matches_transformers",
        "test_qwen3_moe_without_experts_is_dense_as_in_transformers",
    ],
    "num_local_experts": [
        "test_moe_logits_and_greedy_tokens_match_transformers",
        "test_transformers_5_names_and_default_config_classes_map_too",
    ],
    "num_experts_per_tok": ["test_moe_logits_and_greedy_tokens_match_transformers"],
    "moe_intermediate_size": ["test_moe_logits_and_greedy_tokens_match_transformers"],
    "norm_topk_prob": ["test_qwen3_moe_without_renormalisation_matches_transformers"],
    "decoder_sparse_step": [
        "test_qwen3_moe_dense_layers_follow_mlp_only_layers_and_decoder_sparse_step"
    ],
    "mlp_only_layers": [
        "test_qwen3_moe_dense_layers_follow_mlp_only_layers_and_decoder_sparse_step",
        "test_qwen3_moe_mlp_only_layers_naming_no_layer_match_transformers",
    ],
}
TEST_MODULES = (
    test_engine_hf,
    test_engine_hf_config_reading,
    test_engine_hf_models,
    test_engine_moe_hf,
    test_engine_moe_config,
    sys.modules[__name__],
)

#: Values beside a refused example that make it take effect (a window needs a size and layers).
REFUSAL_CONTEXT = {
    "use_sliding_window": {
        "sliding_window": 8,
        "max_window_layers": 0,
        "layer_types": ["sliding_attention"] * TINY["num_hidden_layers"],
    },
    "sliding_window": {"layer_types": ["sliding_attention"] * TINY["num_hidden_layers"]},
}


def _fields(cls) -> set[str]:
    names = set(cls().to_dict())
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    names |= {k for k in vars(cls()) if not k.startswith("_")}
    return names


def _tiny_dict(arch: str, **changes) -> dict:
    doc = CLASSES[arch](**TINY).to_dict()
    doc["architectures"] = [next(k for k, v in ARCHITECTURES.items() if v == arch)]
    doc.update(changes)
    return json.loads(json.dumps(doc))  # what config.json holds


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_every_field_is_handled_ignored_or_refused(arch):
    handled = set(HANDLED_FIELDS[arch])
    unclassified = _fields(CLASSES[arch]) - handled - set(IGNORED_FIELDS)
    assert not unclassified, f"{arch}: classify {sorted(unclassified)} in engine/hf_fields.py"
    assert not handled & set(IGNORED_FIELDS)
    assert set(REFUSALS[arch]) <= handled  # a refused value is of a field that is read
    for field in handled:
        tests = ORACLES.get(field)
        assert tests, f"{arch}.{field} is handled but no test checks it against transformers"
        for name in tests:
            assert any(hasattr(m, name) for m in TEST_MODULES), f"{name} does not exist"


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_defaults_are_transformers_defaults(arch):
    defaults = {f.name: f.default for f in dataclasses.fields(CLASSES[arch])}
    for field, value in HF_DEFAULTS[arch].items():
        assert defaults[field] == value, f"{arch}.{field}: transformers' default {defaults[field]}"
    assert getattr(CLASSES[arch], "default_theta", 10000.0) == HF_ROPE_THETA.get(arch, 10000.0)
    # A config.json that leaves every optional field out reads like the full default one.
    required = {k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size")}
    required.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    architectures = _tiny_dict(arch)["architectures"]
    full = CLASSES[arch](**required).to_dict()
    full["architectures"] = architectures
    assert from_hf_config({"architectures": architectures, **required}) == from_hf_config(
        json.loads(json.dumps(full))
    )


#: (architecture, field, a value the engine does not implement): written here, not read from
#: REFUSALS, so a refusal dropped from engine/hf_fields.py fails this test.
REFUSED = [
    ("llama", "attention_bias", True),
    ("qwen3", "attention_bias", True),
    ("qwen2", "use_sliding_window", True),
    ("qwen3", "use_sliding_window", True),
    ("qwen2", "layer_types", ["full_attention", "chunked_attention"]),
    ("qwen3", "layer_types", ["full_attention", "chunked_attention"]),
    ("mistral", "layer_types", ["full_attention", "sliding_attention"]),
    ("mistral", "sliding_window", None),
    ("mixtral", "sliding_window", None),
    ("qwen3_moe", "attention_bias", True),
    ("qwen3_moe", "use_sliding_window", True),
    *((arch, "hidden_act", "xielu") for arch in sorted(CLASSES)),
]


def test_every_refusal_is_tested():
    assert {(arch, field) for arch, field, _ in REFUSED} == {
        (arch, field) for arch in REFUSALS for field in REFUSALS[arch]
    }


@pytest.mark.parametrize("arch,field,value", REFUSED)
def test_refused_values_raise_one_line_naming_field_and_value(arch, field, value):
    doc = _tiny_dict(arch, **REFUSAL_CONTEXT.get(field, {}), **{field: value})
    with pytest.raises(ConfigError) as info:
        from_hf_config(doc)
    message = str(info.value)
    assert "\n" not in message and f"{field}=" in message and repr(value)[:40] in message
    from_hf_config(_tiny_dict(arch))  # the default value is accepted


def test_unimplemented_rope_and_quantized_checkpoints_are_refused():
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match=r"rope_type='yarn'"):
        from_hf_config(_tiny_dict("llama", rope_parameters=yarn))
    for field in REFUSED_EXTRAS:
        with pytest.raises(ConfigError, match=field):
            from_hf_config(_tiny_dict("llama", **{field: {"quant_method": "gptq", "bits": 4}}))


def test_layer_types_names_are_transformers_names():
    from transformers import configuration_utils as hf

    assert set(hf.ALLOWED_ATTN_LAYER_TYPES) | set(hf._LEGACY_LAYER_TYPE_REMAP) == HF_LAYER_TYPES


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_a_layer_type_transformers_does_not_know_is_one_checkpoint_error_line(arch):
    # Accepted before (llama, qwen3_moe, mixtral ignored the field), or refused as unimplemented.
    types = ["full_attention", "bogus"]
    with pytest.raises(Exception, match="The `layer_types` entries must be in"):
        CLASSES[arch](**TINY, layer_types=types)  # the oracle
    with pytest.raises(CheckpointError) as info:
        from_hf_config(_tiny_dict(arch, layer_types=types))
    message = str(info.value)
    assert "\n" not in message and "layer_types holds ['bogus']" in message


def test_model_type_alone_selects_the_architecture():
    doc = _tiny_dict("qwen3")
    doc.pop("architectures")
    assert from_hf_config(doc).architecture == "qwen3" and from_hf_config(doc).qk_norm


def test_max_position_embeddings_bounds_a_request():
    config = from_hf_config(_tiny_dict("llama", max_position_embeddings=16))
    config.check_positions(16, "a request")
    with pytest.raises(InputError, match="max_position_embeddings=16"):
        config.check_positions(17, "a request")


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "qwen3"])
def test_hidden_act_of_every_architecture(tmp_path, arch):
    hf, folder = test_engine_hf.build_hf(arch, tmp_path, hidden_act="gelu_pytorch_tanh")
    test_engine_hf.compare(hf, folder, prompt_len=4, decode_steps=2)
