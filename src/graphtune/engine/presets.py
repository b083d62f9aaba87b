"""Named model shapes (presets): tiny models for CPU tests and the shapes of real checkpoints.

A preset is a :class:`~graphtune.engine.config.ModelConfig`; ``load_model(name)`` builds it with
random weights (:func:`~graphtune.engine.model.random_model`). The ``*-shape`` presets copy the
sizes of published checkpoints (their ``config.json``) for benchmarks.
"""

from __future__ import annotations

from typing import Any

from graphtune.engine.config import ModelConfig, RopeScaling
from graphtune.errors import ConfigError

_LLAMA3_SCALING = RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)


def _tiny(name: str, architecture: str, **fields: Any) -> ModelConfig:
    """A model for CPU tests: 2 layers of width 64 (MLP 128), 4 heads, a vocabulary of 256 and
    end-of-sequence id 2, unless ``fields`` says otherwise."""
    tiny: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "max_position_embeddings": 2048,
        "eos_token_ids": (2,),
    }
    return ModelConfig(name=name, architecture=architecture, **{**tiny, **fields})


PRESETS: dict[str, ModelConfig] = {
    "tiny": _tiny(
        "tiny",
        "llama",
        num_kv_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
    ),
    "qwen2-tiny": _tiny(
        "qwen2-tiny",
        "qwen2",
        num_kv_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        attention_bias=True,
    ),
    "mistral-tiny": _tiny(
        "mistral-tiny",
        "mistral",
        num_kv_heads=1,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        sliding_window=32,
        bos_token_id=1,
    ),
    "qwen3-tiny": _tiny(
        "qwen3-tiny",
        "qwen3",
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        qk_norm=True,
    ),
    # The shape of Llama-3.2-1B: 16 layers, GQA 32/8, tied embeddings, Llama-3 RoPE scaling.
    "llama-1b-shape": ModelConfig(
        name="llama-1b-shape",
        architecture="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_SCALING,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    # The shape of Qwen3-1.7B: 28 layers, GQA 16/8 with head_dim 128 (q is wider than the hidden
    # state), per-head q/k norms, tied embeddings, a 152k vocabulary.
    "qwen3-1.7b-shape": ModelConfig(
        name="qwen3-1.7b-shape",
        architecture="qwen3",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_ids=(151645, 151643),
        qk_norm=True,
    ),
    # The shape of Meta-Llama-3-8B: 32 layers, GQA 32/8, untied 128256-token head.
    "llama-3-8b-shape": ModelConfig(
        name="llama-3-8b-shape",
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        bos_token_id=128000,
        eos_token_ids=(128001,),
    ),
    # The shape of Qwen2.5-7B: 28 layers, GQA 28/4, head_dim 128, QKV bias, 152064-token head.
    "qwen2.5-7b-shape": ModelConfig(
        name="qwen2.5-7b-shape",
        architecture="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        attention_bias=True,
        eos_token_ids=(151643,),
    ),
    # Mixture-of-experts models for CPU tests: Qwen3-MoE (q/k norm, a head_dim that is not
    # hidden / heads) and Mixtral.
    "qwen3-moe-tiny": _tiny(
        "qwen3-moe-tiny",
        "qwen3_moe",
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        qk_norm=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    "mixtral-tiny": _tiny(
        "mixtral-tiny",
        "mixtral",
        intermediate_size=64,
        num_kv_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        bos_token_id=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
    # The shape of Qwen3-30B-A3B (its config.json): 48 layers of 128 experts (top 8, width
    # 768, renormalised), GQA 32/4 with head_dim 128 (not hidden / heads) and q/k RMSNorm.
    "qwen3-30b-a3b-shape": ModelConfig(
        name="qwen3-30b-a3b-shape",
        architecture="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_ids=(151645,),
        qk_norm=True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    # The shape of Mixtral-8x7B (its config.json): 32 layers of 8 experts (top 2, width 14336).
    "mixtral-8x7b-shape": ModelConfig(
        name="mixtral-8x7b-shape",
        architecture="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        bos_token_id=1,
        eos_token_ids=(2,),
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=14336,
        norm_topk_prob=True,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """Returns the named preset.

    Raises:
        ConfigError: ``name`` is not a preset (the message lists them).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; presets are {sorted(PRESETS)} "
            "(or pass a folder with config.json and *.safetensors)"
        ) from None


def fewer_layers(name: str, layers: int) -> ModelConfig:
    """Preset ``name`` cut to its first ``layers`` layers, named so (quick benchmark runs:
    ``bench decode --layers``).

    Raises:
        ConfigError: ``name`` is not a preset, or it has fewer than ``layers`` layers.
    """
    if name not in PRESETS:
        raise ConfigError(f"--layers cuts a preset; {name!r} is not one of {sorted(PRESETS)}")
    config = PRESETS[name]
    if layers > config.num_layers:
        raise ConfigError(f"--layers {layers}: {name} has only {config.num_layers} layers")
    kept = tuple(i for i in config.mlp_only_layers if i < layers)
    return config.replace(
        name=f"{name}[{layers} of {config.num_layers} layers]",
        num_layers=layers,
        mlp_only_layers=kept,
    )
