"""Every field of a supported transformers config: read, ignored, or refused with its value.

A Hugging Face ``config.json`` field either changes what the model computes or it does not. The
rule (checked field by field against transformers' own config classes in
``tests/cpu/test_engine_hf_fields.py``): a field that changes the math is read into
:class:`~graphtune.engine.config.ModelConfig` (:data:`HANDLED_FIELDS`, each covered by a test
against transformers' model), or, for values the engine does not implement, refused with a
one-line :class:`~graphtune.errors.ConfigError` naming the field and its value
(:func:`refuse_unimplemented`); a field that does not change the math is listed in
:data:`IGNORED_FIELDS` with the reason. Fields transformers' class does not define are ignored by
transformers' model too, so they are ignored here (logged), except :data:`REFUSED_EXTRAS`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from graphtune.errors import CheckpointError, ConfigError
from graphtune.finite_json import brief, finite_float

logger = logging.getLogger(__name__)

#: transformers' ``hidden_act`` names the engine implements, and the gated activation each is
#: (:data:`graphtune.ops.activation.GATED_ACTIVATIONS`). ``gelu_new``, ``gelu_fast`` and
#: ``gelu_python_tanh`` are formulas of the tanh approximation, as ``gelu_pytorch_tanh`` is.
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "relu": "relu",
    "relu2": "relu2",
    "quick_gelu": "quick_gelu",
}

#: transformers' RoPE theta when ``config.json`` gives none, where it is not 10000 (the config
#: class's ``default_theta``).
HF_ROPE_THETA = {"mixtral": 1000000.0}

#: Fields that do not change what the model computes for a request, and why.
IGNORED_FIELDS = {
    "_name_or_path": "a label",
    "transformers_version": "a label",
    "use_cache": "the engine always decodes with a KV cache (the math is the same)",
    "output_attentions": "what transformers returns besides the logits",
    "output_hidden_states": "what transformers returns besides the logits",
    "return_dict": "what transformers returns besides the logits",
    "initializer_range": "random initialisation only; loaded weights replace it",
    "attention_dropout": "dropout is off at inference",
    "pad_token_id": "padding tokens are not part of an unpadded request",
    "chunk_size_feed_forward": "these decoders do not chunk their MLP in transformers either",
    "is_encoder_decoder": "the causal-LM classes do not read it",
    "id2label": "sequence-classification heads only",
    "label2id": "sequence-classification heads only",
    "problem_type": "sequence-classification heads only",
    "pretraining_tp": "transformers' Llama no longer reads it (sliced projections sum the same)",
    "bos_token_id": "kept as ModelConfig.bos_token_id; the tokenizer adds BOS, not the model",
    "router_aux_loss_coef": "weight of the experts' load-balancing loss (training)",
    "router_jitter_noise": "Mixtral multiplies the router input by jitter only in training",
    "output_router_logits": "what transformers returns besides the logits",
}

_COMMON = {
    "architectures": "ModelConfig.architecture",
    "model_type": "ModelConfig.architecture (when architectures is absent)",
    "vocab_size": "ModelConfig.vocab_size",
    "hidden_size": "ModelConfig.hidden_size",
    "intermediate_size": "ModelConfig.intermediate_size",
    "num_hidden_layers": "ModelConfig.num_layers",
    "num_attention_heads": "ModelConfig.num_heads",
    "num_key_value_heads": "ModelConfig.num_kv_heads",
    "head_dim": "ModelConfig.head_dim",
    "hidden_act": "ModelConfig.hidden_act (names in HF_ACTIVATIONS; others refused)",
    "rms_norm_eps": "ModelConfig.rms_norm_eps",
    "rope_parameters": "ModelConfig.rope_theta and rope_scaling (default, linear, llama3); one "
    "object per layer type refused",
    "max_position_embeddings": "ModelConfig.max_position_embeddings (the longest request)",
    "tie_word_embeddings": "ModelConfig.tie_word_embeddings",
    "eos_token_id": "ModelConfig.eos_token_ids; when generation_config.json exists, its "
    "eos_token_id replaces it (missing or null there: no EOS), as in transformers' generate",
    "dtype": "every weight's dtype when load_model's dtype is None (transformers' "
    'dtype="auto"; without it or torch_dtype, the index\'s metadata dtype, else the first '
    "floating-point tensor's dtype in the first weights file)",
    "torch_dtype": "as dtype, when dtype is absent or null (transformers' older name)",
}
_QWEN_WINDOWS = {
    "use_sliding_window": "sliding layers refused (see layer_types)",
    "sliding_window": "sliding layers refused (see layer_types)",
    "max_window_layers": "sliding layers refused (see layer_types)",
    "layer_types": "full attention in every layer; sliding layers refused",
}

#: Per architecture, the fields read into ModelConfig and what each becomes.
HANDLED_FIELDS: dict[str, dict[str, str]] = {
    "llama": {
        **_COMMON,
        "mlp_bias": "ModelConfig.mlp_bias (biases on gate, up and down)",
        "attention_bias": "false; true (biases on q/k/v/o) refused",
    },
    "qwen2": {**_COMMON, **_QWEN_WINDOWS},
    "mistral": {
        **_COMMON,
        "sliding_window": "ModelConfig.sliding_window; null with sliding_attention layers refused",
        "layer_types": "all full_attention: no window; all sliding_attention: the window in "
        "every layer; a mix (what transformers reads as Ministral) refused",
    },
    "qwen3": {
        **_COMMON,
        **_QWEN_WINDOWS,
        "attention_bias": "false; true (biases on q/k/v/o) refused",
    },
    "qwen3_moe": {
        **_COMMON,
        "attention_bias": "false; true (biases on q/k/v/o) refused",
        "use_sliding_window": "false; true (sliding-window layers) refused",
        "sliding_window": "unused: use_sliding_window is refused",
        "num_experts": "ModelConfig.num_experts",
        "num_local_experts": "ModelConfig.num_experts (transformers 5's name for it)",
        "num_experts_per_tok": "ModelConfig.num_experts_per_tok",
        "moe_intermediate_size": "ModelConfig.moe_intermediate_size",
        "norm_topk_prob": "ModelConfig.norm_topk_prob",
        "decoder_sparse_step": "ModelConfig.decoder_sparse_step",
        "mlp_only_layers": "ModelConfig.mlp_only_layers",
    },
    "mixtral": {
        **_COMMON,
        "intermediate_size": "ModelConfig.moe_intermediate_size (the experts' width)",
        "sliding_window": "ModelConfig.sliding_window; null with sliding_attention layers refused",
        "num_local_experts": "ModelConfig.num_experts",
        "num_experts": "ModelConfig.num_experts (MixtralConfig.attribute_map's alias)",
        "num_experts_per_tok": "ModelConfig.num_experts_per_tok",
    },
}

#: transformers' defaults of the fields read, per architecture (the class's value when
#: ``config.json`` leaves a field out). ``head_dim`` ``None``: ``hidden_size // heads``;
#: ``num_key_value_heads`` ``None``: ``num_attention_heads`` (as the classes' own fallback).
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "num_key_value_heads": None,
        "head_dim": None,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen2": {
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "mistral": {
        "num_key_value_heads": 8,
        "head_dim": None,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": 4096,
    },
    "qwen3": {
        "num_key_value_heads": 32,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3_moe": {
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": None,
    },
    "mixtral": {
        "num_key_value_heads": 8,
        "head_dim": None,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": None,
        "num_experts_per_tok": 2,
    },
}


@dataclass(frozen=True)
class Refusal:
    """A rule for values of one field the engine does not implement.

    Attributes:
        allowed: Whether a value (the field's value after defaults, given the whole config) is
            implemented.
        why: What the refused values would need, for the message.
        fix: What the user can do instead, for the message.
    """

    allowed: Callable[[Any, Mapping[str, Any]], bool]
    why: str
    fix: str = "use a checkpoint without it"


def sliding_layers(cfg: Mapping[str, Any]) -> list[int]:
    """Layers of a Qwen2/Qwen3 config that attend through a sliding window, as transformers
    decides: ``use_sliding_window`` with a window, and ``layer_types`` (or, without it, every
    layer from ``max_window_layers`` on) marking the layer ``sliding_attention``."""
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
        return []
    types = layer_types(cfg)
    if types is None:
        start = hf_int(cfg, "max_window_layers")
        return list(
            range(start, hf_int(cfg, "num_hidden_layers") if "num_hidden_layers" in cfg else 0)
        )
    return [i for i, kind in enumerate(types) if kind == "sliding_attention"]


#: The ``layer_types`` entries transformers' configs accept: ``ALLOWED_ATTN_LAYER_TYPES`` in
#: transformers/configuration_utils.py (5.25; ``PreTrainedConfig.validate_layer_type`` refuses
#: others), and the keys of ``_LEGACY_LAYER_TYPE_REMAP`` there, renamed before that check.
#: transformers is optional, so the names are written here; which the engine runs is decided
#: per architecture (:data:`REFUSALS`).
HF_LAYER_TYPES = frozenset(
    "full_attention sliding_attention chunked_attention window_attention indexed_attention "
    "compressed_sparse_attention heavily_compressed_attention minimax_m3_sparse conv moe hybrid "
    "hybrid_sliding reference_sliding_attention linear_attention "
    "mamba attention deepseek_sparse_attention qwen_sparse_attention".split()
)


def layer_types(cfg: Mapping[str, Any]) -> list[str] | None:
    """``cfg["layer_types"]``: ``None`` or a list of names of :data:`HF_LAYER_TYPES`, one per
    layer (a ``num_hidden_layers`` that is not an int is refused elsewhere), as transformers
    requires.

    Raises:
        CheckpointError: Another type, another name, or another length.
    """
    value = cfg.get("layer_types")
    if value is not None and not (
        isinstance(value, list) and all(isinstance(k, str) for k in value)
    ):
        raise CheckpointError(
            f"config.json: layer_types={brief(value, 80)} must be a list of layer types such as "
            '["full_attention", "full_attention"], one per layer, or null (transformers refuses '
            "it too); fix the file"
        )
    unknown = sorted(set(value or ()) - HF_LAYER_TYPES)
    if unknown:
        raise CheckpointError(
            f"config.json: layer_types holds {brief(unknown, 80)}, which are no layer types "
            "(transformers refuses them too; full_attention, sliding_attention, ...): fix the file"
        )
    layers = cfg.get("num_hidden_layers")
    if value is not None and isinstance(layers, int) and len(value) != layers:
        raise CheckpointError(
            f"config.json: layer_types has {len(value)} entries but num_hidden_layers is "
            f"{layers}; it needs one per layer (transformers refuses it too): fix the file"
        )
    return value


_NO_BIAS = Refusal(lambda value, cfg: not value, "biases on the q, k, v and o projections")
_NO_SLIDING = Refusal(
    lambda value, cfg: not sliding_layers(cfg),
    "sliding-window layers (with use_sliding_window, from max_window_layers or layer_types)",
)
_ACTIVATION = Refusal(
    lambda value, cfg: isinstance(value, str) and value in HF_ACTIVATIONS,
    f"an activation other than {sorted(HF_ACTIVATIONS)}",
)
_EXPERT_ACTIVATION = Refusal(
    lambda value, cfg: isinstance(value, str) and HF_ACTIVATIONS.get(value) == "silu",
    "experts with an activation other than SiLU (the MoE kernels are SwiGLU)",
)
_NO_QWEN3_MOE_WINDOW = Refusal(
    # A window of null makes transformers' model attend to every key (the flag alone changes
    # nothing); a missing one is transformers' default of 4096.
    lambda value, cfg: not value or ("sliding_window" in cfg and cfg["sliding_window"] is None),
    "Qwen3-MoE's sliding-window layers",
)
_LAYER_KINDS = Refusal(
    lambda value, cfg: all(
        kind in ("full_attention", "sliding_attention") for kind in layer_types(cfg) or ()
    ),
    "a layer type other than full_attention and sliding_attention",
)
_QWEN_LAYER_KINDS = Refusal(
    # transformers drops the window unless use_sliding_window is on, and its sliding_attention
    # layers then fail; with the window on, _NO_SLIDING refuses them.
    lambda value, cfg: (
        _LAYER_KINDS.allowed(value, cfg)
        and ("sliding_attention" not in (value or ()) or bool(sliding_layers(cfg)))
    ),
    "a layer type other than full_attention and sliding_attention, or sliding_attention "
    "layers without use_sliding_window=true and a sliding_window, which transformers' model "
    "cannot run either",
    "use a checkpoint whose layer_types are all full_attention",
)

_ONE_LAYER_KIND = Refusal(
    lambda value, cfg: _LAYER_KINDS.allowed(value, cfg) and len(set(value or ())) <= 1,
    "full_attention in some layers and sliding_attention in others (Ministral's layout)",
)


def sliding_window(arch: str, cfg: Mapping[str, Any]) -> int | None:
    """The window of a Mistral or Mixtral file's layers (``None``: full attention), after
    :func:`refuse_unimplemented`: Mistral's ``layer_types``, when present, are all one kind."""
    if arch not in ("mistral", "mixtral") or cfg.get("sliding_window") is None:
        return None
    kinds = cfg.get("layer_types") if arch == "mistral" else None
    if kinds and "sliding_attention" not in kinds:
        return None
    return hf_int(cfg, "sliding_window")


_MISTRAL_WINDOW = Refusal(
    # Without a window transformers' mask for sliding_attention layers fails in the forward;
    # reading them as full attention would run another model than the file describes.
    lambda value, cfg: value is not None or "sliding_attention" not in (layer_types(cfg) or ()),
    "sliding_attention layers without a window, which transformers' model cannot run either",
    "set sliding_window to the window or make layer_types full_attention",
)

#: Per architecture, the fields with values the engine refuses.
REFUSALS: dict[str, dict[str, Refusal]] = {
    "llama": {"hidden_act": _ACTIVATION, "attention_bias": _NO_BIAS},
    "qwen2": {
        "hidden_act": _ACTIVATION,
        "use_sliding_window": _NO_SLIDING,
        "layer_types": _QWEN_LAYER_KINDS,
    },
    "mistral": {
        "hidden_act": _ACTIVATION,
        "layer_types": _ONE_LAYER_KIND,
        "sliding_window": _MISTRAL_WINDOW,
    },
    "qwen3": {
        "hidden_act": _ACTIVATION,
        "attention_bias": _NO_BIAS,
        "use_sliding_window": _NO_SLIDING,
        "layer_types": _QWEN_LAYER_KINDS,
    },
    "qwen3_moe": {
        "hidden_act": _EXPERT_ACTIVATION,
        "attention_bias": _NO_BIAS,
        "use_sliding_window": _NO_QWEN3_MOE_WINDOW,
    },
    # MixtralConfig defines no layer_types, but keeps one given and transformers' cache reads
    # it: its sliding_attention layers fail there without a window (_MISTRAL_WINDOW reads
    # layer_types from the whole config, so it sees them).
    "mixtral": {"hidden_act": _EXPERT_ACTIVATION, "sliding_window": _MISTRAL_WINDOW},
}

#: Fields outside transformers' config classes that change how weights are read, refused.
REFUSED_EXTRAS = {
    "quantization_config": "quantized weights (load a bf16/fp16/fp32 checkpoint)",
    "shared_expert_intermediate_size": "shared experts (Qwen2-MoE's), beside the routed ones",
}


def hf_int(cfg: Mapping[str, Any], field: str, where: str = "config.json") -> int:
    """``cfg[field]`` as transformers' strict config classes take an int field: an int, not a
    bool or a float such as ``2.0`` (``where`` names the file or the field holding ``cfg``).

    Raises:
        KeyError: The field is missing (the caller names it).
        CheckpointError: Another type.
    """
    value = cfg[field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(where, field, value, "an integer")
    return value


def hf_float(cfg: Mapping[str, Any], field: str, where: str = "config.json") -> float:
    """``cfg[field]`` as a float: an int or a float, not a bool or a string (see :func:`hf_int`),
    nor an int too large for a float (a ``cfg`` built in Python; JSON text refuses one when
    parsed, :func:`graphtune.finite_json.parse_json`).

    Raises:
        KeyError: The field is missing (the caller names it).
        CheckpointError: Another type, or an int beyond a float's range.
    """
    value = cfg[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(where, field, value, "a number")
    if isinstance(value, int) and not finite_float(value):
        raise CheckpointError(
            f"{where}: {field}={brief(value, 80)} is too large for a float; fix the file"
        )
    return float(value)


def hf_bool(cfg: Mapping[str, Any], field: str, where: str = "config.json") -> bool:
    """``cfg[field]`` as a bool: ``true`` or ``false`` only, as transformers requires (``bool()``
    would make the string ``"false"`` true; see :func:`hf_int`)."""
    value = cfg[field]
    if not isinstance(value, bool):
        raise _wrong_type(where, field, value, "true or false")
    return value


def _wrong_type(where: str, field: str, value: Any, kind: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: {field}={brief(value, 80)} must be {kind} (transformers refuses it too); fix "
        "the file"
    )


def with_defaults(arch: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with transformers' default for every field of :data:`HF_DEFAULTS` it leaves out
    (an explicit ``null`` stays ``None``)."""
    return {**HF_DEFAULTS[arch], **cfg}


def refuse_unimplemented(arch: str, cfg: Mapping[str, Any], source: str = "config.json") -> None:
    """Raises for the first field of ``cfg`` whose value the engine does not implement; logs
    the fields it does not know (transformers' model does not read them either).

    Args:
        arch: A ``ModelConfig.architecture`` (a key of :data:`HANDLED_FIELDS`).
        cfg: The parsed config, with defaults (:func:`with_defaults`).
        source: Where ``cfg`` came from, for the message.

    Raises:
        ConfigError: One line naming the field, its value and what it would need.
    """
    for field, why in REFUSED_EXTRAS.items():
        if cfg.get(field) is not None:
            raise ConfigError(
                f"{source}: {field} is set ({brief(cfg[field], 80)}); graphtune's engine does not "
                f"implement {why}"
            )
    for field, rule in REFUSALS[arch].items():
        value = cfg.get(field)
        if not rule.allowed(value, cfg):
            raise ConfigError(
                f"{source}: {field}={brief(value, 80)} is not implemented by graphtune's {arch} "
                f"engine ({rule.why}); {rule.fix}"
            )
    known = set(HANDLED_FIELDS[arch]) | set(IGNORED_FIELDS) | set(REFUSED_EXTRAS)
    unknown = sorted(set(cfg) - known - _LEGACY_FIELDS)
    if unknown:
        logger.info(
            "%s: fields transformers' %s config class does not define, ignored as transformers "
            "ignores them: %s",
            source,
            arch,
            ", ".join(unknown),
        )


#: Older spellings that transformers still maps onto ``rope_parameters``.
_LEGACY_FIELDS = {"rope_theta", "rope_scaling"}
