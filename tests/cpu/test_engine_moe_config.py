"""The MoE model configuration: config.json fields read, ignored or refused; the presets' shapes;
the rules of ModelConfig's MoE fields; random MoE weights; tensor parallelism refused."""

from __future__ import annotations

import pytest
import torch

from graphtune.engine import get_preset, random_model
from graphtune.engine.config import ModelConfig, from_hf_config
from graphtune.engine.hf_fields import IGNORED_FIELDS
from graphtune.engine.parallel import check_shardable
from graphtune.errors import CheckpointError, ConfigError

# The config.json files of Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1 as published.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}


@pytest.mark.parametrize(
    ("hf", "preset", "params"),
    [
        (QWEN3_30B_A3B, "qwen3-30b-a3b-shape", 30.53e9),
        (MIXTRAL_8X7B, "mixtral-8x7b-shape", 46.70e9),
    ],
)
def test_published_configs_map_to_the_shape_presets(hf, preset, params):
    want = get_preset(preset)
    assert from_hf_config(hf, name=preset) == want
    assert abs(want.num_parameters() - params) < 0.01e9  # 30.5 B and 46.7 B as published


def test_transformers_5_names_and_default_config_classes_map_too():
    transformers = pytest.importorskip("transformers")
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts and rope_parameters.
    qwen = transformers.Qwen3MoeConfig(head_dim=128, num_hidden_layers=48, norm_topk_prob=True)
    cfg = from_hf_config({**qwen.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
    assert cfg.qk_norm and cfg.sliding_window is None and cfg.rope_theta == 10000.0
    mixtral = transformers.MixtralConfig()
    cfg = from_hf_config({**mixtral.to_dict(), "architectures": ["MixtralForCausalLM"]})
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 14336)
    assert cfg.norm_topk_prob and not cfg.qk_norm and cfg.router_weights_in_float32


@pytest.mark.parametrize(
    ("base", "change", "message"),
    [
        (QWEN3_30B_A3B, {"quantization_config": {"bits": 4}}, r"quantization_config is set"),
        (QWEN3_30B_A3B, {"shared_expert_intermediate_size": 512}, "shared_expert_intermediate"),
        (QWEN3_30B_A3B, {"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
        (QWEN3_30B_A3B, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (QWEN3_30B_A3B, {"num_local_experts": 64}, "num_local_experts=64.*num_experts=128"),
        (QWEN3_30B_A3B, {"mlp_only_layers": [0, "1"]}, "mlp_only_layers"),
        (QWEN3_30B_A3B, {"num_experts_per_tok": 8.0}, "num_experts_per_tok=8.0"),
        (MIXTRAL_8X7B, {"hidden_act": "relu"}, "hidden_act='relu'"),
    ],
)
def test_fields_that_change_the_math_are_refused_by_name_and_value(base, change, message):
    # A value of the wrong type is a broken file (CheckpointError); a value the engine does not
    # implement is a ConfigError.
    with pytest.raises((ConfigError, CheckpointError), match=message):
        from_hf_config({**base, **change})


def test_qwen3_moe_sliding_window_flag_without_a_window_is_full_attention():
    # transformers keeps sliding_window None, so its model attends to every key, as here.
    plain = from_hf_config(QWEN3_30B_A3B)
    flagged = from_hf_config({**QWEN3_30B_A3B, "use_sliding_window": True, "sliding_window": None})
    assert flagged == plain and flagged.sliding_window is None
    without = {k: v for k, v in QWEN3_30B_A3B.items() if k != "sliding_window"}
    with pytest.raises(ConfigError, match="use_sliding_window"):  # transformers' 4096 applies
        from_hf_config({**without, "use_sliding_window": True})


def test_ignored_fields_do_not_change_the_model():
    plain = from_hf_config(MIXTRAL_8X7B)
    changed = {**MIXTRAL_8X7B, "router_jitter_noise": 0.1, "output_router_logits": True}
    assert from_hf_config(changed) == plain
    # MixtralConfig has no norm_topk_prob: transformers' Mixtral renormalises whatever it says.
    assert from_hf_config({**MIXTRAL_8X7B, "norm_topk_prob": False}) == plain
    assert {"router_aux_loss_coef", "router_jitter_noise", "attention_dropout"} <= set(
        IGNORED_FIELDS
    )


def test_moe_layer_rule_and_field_rules():
    base = get_preset("qwen3-moe-tiny")
    layers = base.replace(num_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [layers.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert not get_preset("tiny").is_moe_layer(0)
    bad = [
        (dict(num_experts_per_tok=9), "num_experts_per_tok must be in"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size must be > 0"),
        (dict(mlp_only_layers=(2,)), r"mlp_only_layers \[2\]"),
        (dict(num_experts=0), "num_experts=0"),
        (dict(architecture="llama"), "needs an MoE architecture"),
    ]
    for change, message in bad:
        with pytest.raises(ConfigError, match=message):
            base.replace(**change)
    with pytest.raises(ConfigError, match="Mixtral always renormalises"):
        get_preset("mixtral-tiny").replace(norm_topk_prob=False)


def test_random_moe_weights_have_the_fused_moe_layout():
    cfg = get_preset("qwen3-moe-tiny").replace(num_layers=3, mlp_only_layers=(1,))
    model = random_model(cfg, seed=2, dtype=torch.bfloat16)
    moe, dense = model.layers[0], model.layers[1]
    assert moe.is_moe and moe.w_gate_up is None and not dense.is_moe
    assert moe.router.shape == (8, 64) and moe.experts_gate_up.shape == (8, 64, 64)
    assert moe.experts_down.shape == (8, 64, 32) and moe.q_norm.shape == (32,)
    assert dense.w_gate_up.shape == (256, 64) and dense.router is None
    assert moe.experts_gate_up.dtype == torch.bfloat16
    params = sum(t.numel() for layer in model.layers for t in layer.tensors().values())
    params += model.embed.numel() + model.lm_head.numel() + model.final_norm.numel()
    assert params == cfg.num_parameters()
    again = random_model(cfg, seed=2, dtype=torch.bfloat16)
    assert torch.equal(again.layers[2].experts_down, model.layers[2].experts_down)


def test_tensor_parallel_moe_is_refused():
    with pytest.raises(ConfigError, match="tensor parallelism of experts is not implemented"):
        check_shardable(get_preset("mixtral-8x7b-shape"), 2)
    check_shardable(get_preset("mixtral-8x7b-shape"), 1)


def test_dense_configs_are_unchanged():
    cfg = ModelConfig("d", "llama", 256, 64, 128, 2, 4, 2)
    assert cfg.num_experts == 0 and not cfg.qk_norm and not cfg.is_moe_layer(0)
