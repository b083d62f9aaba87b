"""The mixture-of-experts part of the model configuration: its rules and its ``config.json``.

:func:`check_moe_fields` holds the rules of ``ModelConfig``'s MoE fields (called on
construction).

:func:`~graphtune.engine.config.from_hf_config` maps the fields every architecture shares (sizes,
heads, RoPE, norms, embeddings, special tokens); for ``Qwen3MoeForCausalLM`` and
``MixtralForCausalLM`` it calls :func:`moe_fields_from_hf`, which accounts for every other field
of the file: each one is read (:data:`MOE_FIELDS`), listed as not changing inference math
(:data:`IGNORED_FIELDS`, with the reason), or refused with a :class:`~graphtune.errors.ConfigError`
naming the field and its value. A field graphtune does not know is refused too: a checkpoint whose
math depends on a field nobody read would otherwise give a silently wrong model.

The layer layout follows transformers' ``Qwen3MoeDecoderLayer``: layer ``i`` is a mixture of
experts when ``i`` is not in ``mlp_only_layers``, ``num_experts > 0`` and ``(i + 1) %
decoder_sparse_step == 0``; the other layers are dense SwiGLU MLPs of ``intermediate_size``.
Mixtral has no dense layers, and its ``intermediate_size`` is the expert width.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graphtune.errors import ConfigError

#: Architectures (``ModelConfig.architecture``) whose MLPs are mixtures of experts.
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")

#: Fields ``from_hf_config`` reads for every architecture.
SHARED_FIELDS = frozenset(
    {
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_parameters",
        "rope_theta",
        "rope_scaling",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "sliding_window",
        "bos_token_id",
        "eos_token_id",
    }
)

#: Fields read here, per architecture (``hidden_act`` must be ``silu``).
MOE_FIELDS: dict[str, frozenset[str]] = {
    "qwen3_moe": frozenset(
        {
            "hidden_act",
            "num_experts",
            "num_local_experts",  # transformers 5 writes num_experts under this name
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
            "use_sliding_window",
            "max_window_layers",  # only meaningful with use_sliding_window, which is refused
        }
    ),
    "mixtral": frozenset({"hidden_act", "num_local_experts", "num_experts_per_tok"}),
}

#: Fields that do not change inference math, with the reason.
IGNORED_FIELDS: dict[str, str] = {
    "attention_dropout": "dropout is off at inference",
    "router_jitter_noise": "Mixtral multiplies by jitter only in training",
    "router_aux_loss_coef": "weight of the load-balancing loss (training)",
    "output_router_logits": "asks for extra outputs, not different logits",
    "initializer_range": "initialisation of untrained weights",
    "use_cache": "transformers' generation option",
    "pad_token_id": "padding id of the tokenizer; no effect on logits",
    "torch_dtype": "the dtype is the caller's choice (load_model(dtype=...))",
    "dtype": "the dtype is the caller's choice (load_model(dtype=...))",
    "transformers_version": "metadata",
    "_name_or_path": "metadata",
    # transformers' generic config attributes (PreTrainedConfig.to_dict writes them all).
    "output_attentions": "asks for extra outputs",
    "output_hidden_states": "asks for extra outputs",
    "return_dict": "the type of transformers' outputs",
    "chunk_size_feed_forward": "transformers' memory option; the same numbers",
    "is_encoder_decoder": "transformers' model kind; both architectures are decoders",
    "problem_type": "for classification heads, not the LM head",
    "id2label": "for classification heads, not the LM head",
    "label2id": "for classification heads, not the LM head",
}


def check_moe_fields(config: Any) -> None:
    """Checks the MoE fields of a ``ModelConfig`` (``config``).

    Raises:
        ConfigError: Experts on a dense architecture (or none on Mixtral), ``num_experts_per_tok``
            outside ``[1, num_experts]``, a non-positive expert width or sparse step, Mixtral
            without renormalisation, or ``mlp_only_layers`` that are not layers.
    """
    name, arch, experts, top_k = (
        config.name,
        config.architecture,
        config.num_experts,
        config.num_experts_per_tok,
    )
    if experts == 0:
        if top_k or arch == "mixtral":
            raise ConfigError(
                f"ModelConfig {name!r}: num_experts=0 (dense) with num_experts_per_tok={top_k} "
                f"and architecture {arch!r}; a Mixtral or top-k model needs num_experts >= 1"
            )
        return
    if arch not in MOE_ARCHITECTURES:
        raise ConfigError(
            f"ModelConfig {name!r}: num_experts={experts} needs an MoE architecture "
            f"{MOE_ARCHITECTURES}, got {arch!r}"
        )
    if not 1 <= top_k <= experts:
        raise ConfigError(
            f"ModelConfig.num_experts_per_tok must be in [1, num_experts={experts}], got {top_k}"
        )
    if config.moe_intermediate_size <= 0 or config.decoder_sparse_step < 1:
        raise ConfigError(
            f"ModelConfig: moe_intermediate_size must be > 0 and decoder_sparse_step >= 1, got "
            f"{config.moe_intermediate_size} and {config.decoder_sparse_step}"
        )
    if arch == "mixtral" and not config.norm_topk_prob:
        raise ConfigError("ModelConfig: Mixtral always renormalises; set norm_topk_prob=True")
    bad = [i for i in config.mlp_only_layers if not 0 <= i < config.num_layers]
    if bad:
        raise ConfigError(
            f"ModelConfig.mlp_only_layers {bad} are not layers of [0, {config.num_layers})"
        )


def _refuse(field: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"config.json field {field}={value!r}: {rule}")


def _int(cfg: Mapping[str, Any], field: str, default: int | None = None) -> int:
    value = cfg.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(field, value, "must be an integer; fix config.json")
    return value


def moe_fields_from_hf(cfg: Mapping[str, Any], architecture: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a ``ModelConfig`` for a Qwen3-MoE or Mixtral file.

    Args:
        cfg: The parsed ``config.json``.
        architecture: ``"qwen3_moe"`` or ``"mixtral"``.

    Returns:
        Keyword arguments for ``ModelConfig``: ``num_experts``, ``num_experts_per_tok``,
        ``moe_intermediate_size``, ``norm_topk_prob``, ``mlp_only_layers``,
        ``decoder_sparse_step`` and ``qk_norm``.

    Raises:
        ConfigError: A field is unknown or has a value the engine does not implement (the
            message names the field and the value).
    """
    known = SHARED_FIELDS | MOE_FIELDS[architecture] | IGNORED_FIELDS.keys()
    for field, value in cfg.items():
        if field not in known:
            raise _refuse(
                field,
                value,
                f"graphtune's {architecture} mapping does not know this field, so it cannot "
                "tell whether the model's math depends on it; remove it if it does not",
            )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "the experts implement SwiGLU with silu only")
    if architecture == "mixtral":
        experts = _int(cfg, "num_local_experts", 8)
        return dict(
            num_experts=experts,
            num_experts_per_tok=_int(cfg, "num_experts_per_tok", 2),
            moe_intermediate_size=_int(cfg, "intermediate_size"),
            norm_topk_prob=True,  # Mixtral's router always renormalises the top-k weights
        )
    if cfg.get("use_sliding_window"):
        raise _refuse(
            "use_sliding_window",
            cfg["use_sliding_window"],
            "Qwen3-MoE's per-layer sliding window (max_window_layers) is not implemented",
        )
    if "num_experts" in cfg and "num_local_experts" in cfg:
        if cfg["num_experts"] != cfg["num_local_experts"]:
            raise _refuse(
                "num_local_experts",
                cfg["num_local_experts"],
                f"disagrees with num_experts={cfg['num_experts']!r}; keep one of them",
            )
    experts_field = "num_experts" if "num_experts" in cfg else "num_local_experts"
    mlp_only = cfg.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in mlp_only
    ):
        raise _refuse("mlp_only_layers", mlp_only, "must be a list of layer indices")
    return dict(
        num_experts=_int(cfg, experts_field, 128),
        num_experts_per_tok=_int(cfg, "num_experts_per_tok", 8),
        moe_intermediate_size=_int(cfg, "moe_intermediate_size", 768),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        mlp_only_layers=tuple(mlp_only),
        decoder_sparse_step=_int(cfg, "decoder_sparse_step", 1),
        qk_norm=True,  # Qwen3's attention normalises every query and key head
    )
