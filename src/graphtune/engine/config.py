"""Model configuration for the reference decode engine: a frozen dataclass and the HF mapping.

Only the Llama family is supported (Llama 2/3 with Llama-3 RoPE scaling, Qwen2 with QKV bias,
Mistral with an optional sliding window, Qwen3 with per-head q/k RMSNorm), and its
mixture-of-experts relatives Qwen3-MoE (q/k RMSNorm and experts) and Mixtral: they share one
decoder layout and differ in a few fields. Which ``config.json`` fields are read, ignored or
refused is in :mod:`graphtune.engine.hf_fields` (the MoE fields' rules:
:mod:`graphtune.engine.moe_config`); named shapes are in :mod:`graphtune.engine.presets`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from graphtune.engine.hf_fields import (
    HF_ACTIVATIONS,
    HF_ROPE_THETA,
    hf_bool,
    hf_float,
    hf_int,
    layer_types,
    refuse_unimplemented,
    sliding_window,
    with_defaults,
)
from graphtune.engine.moe_config import MOE_ARCHITECTURES, check_moe_fields, moe_fields_from_hf
from graphtune.errors import CheckpointError, ConfigError, InputError
from graphtune.finite_json import brief, finite_float
from graphtune.ops.activation import GATED_ACTIVATIONS

logger = logging.getLogger(__name__)

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
#: Architectures whose attention normalises every query and key head before RoPE.
QK_NORM_ARCHITECTURES = ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face names it (``rope_type`` ``llama3`` or ``linear``).

    Attributes:
        rope_type: ``"llama3"`` (Llama 3.1+ smooth interpolation) or ``"linear"``.
        factor: Divisor applied to the low frequencies (all frequencies for ``linear``).
        low_freq_factor: Llama-3 only: wavelengths above ``original / low_freq_factor`` are scaled.
        high_freq_factor: Llama-3 only: wavelengths below ``original / high_freq_factor`` are kept.
        original_max_position_embeddings: Llama-3 only: the context length of pre-training.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("llama3", "linear"):
            raise ConfigError(
                f"rope_type {self.rope_type!r} is not supported; graphtune's engine implements "
                "'default', 'linear' and 'llama3' RoPE. Use a checkpoint with one of those."
            )
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            if not finite_float(getattr(self, name)):
                raise ConfigError(
                    f"RoPE scaling {name} must be a finite number, got {brief(getattr(self, name))}"
                )
        if self.factor <= 0:
            raise ConfigError(f"RoPE scaling factor must be > 0, got {brief(self.factor)}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError("llama3 RoPE scaling needs high_freq_factor > low_freq_factor")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Attributes:
        name: Label used in logs and benchmark output.
        architecture: ``"llama"``, ``"qwen2"``, ``"mistral"``, ``"qwen3"``, ``"qwen3_moe"`` or
            ``"mixtral"``.
        vocab_size: Rows of the embedding and the LM head.
        hidden_size: Model width.
        intermediate_size: SwiGLU inner width of the dense MLPs.
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (grouped-query attention when fewer than ``num_heads``).
        head_dim: Per-head width; ``None`` means ``hidden_size // num_heads``.
        rms_norm_eps: Epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: Optional frequency scaling (Llama 3.1+ checkpoints use ``llama3``).
        max_position_embeddings: Longest position the checkpoint was trained for.
        tie_word_embeddings: LM head shares the embedding matrix (Llama-3.2-1B, small Qwen2).
        attention_bias: Q, K and V projections have biases (Qwen2).
        sliding_window: Attend only to the last ``sliding_window`` keys (some Mistral); ``None``
            for full attention.
        bos_token_id: The checkpoint's BOS id, kept for reference only: the engine never adds
            it; a text prompt gets BOS from ``tokenizer.json``'s post-processor, as transformers'
            tokenizer does.
        eos_token_ids: Generation stops at any of these.
        hidden_act: The MLP's gated activation, a name of
            :data:`graphtune.ops.activation.GATED_ACTIVATIONS` (``"silu"``: SwiGLU; the experts
            of a mixture-of-experts layer are SwiGLU only).
        mlp_bias: Gate, up and down projections have biases (some Llama checkpoints).
        qk_norm: Per-head RMSNorm of queries and keys after the QKV projection, before RoPE
            (Qwen3, Qwen3-MoE), with one ``[head_dim]`` weight for the queries and one for the
            keys.
        num_experts: Experts of a mixture-of-experts MLP; 0 for a dense model.
        num_experts_per_tok: Experts each token is routed to (top-k).
        moe_intermediate_size: Width of one expert's SwiGLU.
        norm_topk_prob: Divide the top-k routing probabilities by their sum (Qwen3-MoE's flag;
            Mixtral always does).
        mlp_only_layers: Layers with a dense MLP in a mixture-of-experts model (Qwen3-MoE).
        decoder_sparse_step: Every ``decoder_sparse_step``-th layer is a mixture of experts
            (Qwen3-MoE); see :meth:`is_moe_layer`.
    """

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    hidden_act: str = "silu"
    mlp_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES.values():
            raise ConfigError(
                f"architecture {self.architecture!r} is not one of {sorted(ARCHITECTURES.values())}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(
                    f"ModelConfig.{name} must be > 0, got {brief(getattr(self, name))}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim is not None and self.head_dim <= 0:
            raise ConfigError(
                f"ModelConfig.head_dim must be > 0 or None, got {brief(self.head_dim)}"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ConfigError("hidden_size must be divisible by num_heads when head_dim is unset")
        if self.dim_per_head % 2:
            raise ConfigError(
                f"head_dim must be even for rotary embeddings, got {brief(self.dim_per_head)}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError("sliding_window must be > 0 or None")
        # transformers takes any eps, 0 too (a row of zeros then normalises to NaN, as there).
        if not (finite_float(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            raise ConfigError(
                f"ModelConfig.rms_norm_eps must be a finite number >= 0, "
                f"got {brief(self.rms_norm_eps)}"
            )
        if not (finite_float(self.rope_theta) and self.rope_theta > 0):
            raise ConfigError(
                f"ModelConfig.rope_theta must be a finite number > 0, got {brief(self.rope_theta)}"
            )
        if self.hidden_act not in GATED_ACTIVATIONS:
            raise ConfigError(
                f"ModelConfig.hidden_act={self.hidden_act!r} is not implemented; use one of "
                f"{sorted(GATED_ACTIVATIONS)}"
            )
        check_moe_fields(self)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` has a mixture-of-experts MLP (transformers' Qwen3-MoE rule:
        not in ``mlp_only_layers`` and ``(index + 1) % decoder_sparse_step == 0``)."""
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def router_weights_in_float32(self) -> bool:
        """Whether routing weights stay float32 (Mixtral) or are cast to the activations'
        dtype (Qwen3-MoE), as transformers' routers do."""
        return self.architecture == "mixtral"

    @property
    def dim_per_head(self) -> int:
        """The head width actually used (``head_dim`` or ``hidden_size // num_heads``)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        """Width of the query projection output."""
        return self.num_heads * self.dim_per_head

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection output."""
        return self.num_kv_heads * self.dim_per_head

    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once; every expert counted)."""
        d, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * (self.q_size + 2 * self.kv_size) + self.q_size * d
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.dim_per_head
        dense = 3 * d * i + (2 * i + d if self.mlp_bias else 0)
        moe = self.num_experts * (d + 3 * d * self.moe_intermediate_size)
        layers = sum(
            attn + 2 * d + (moe if self.is_moe_layer(index) else dense)
            for index in range(self.num_layers)
        )
        head = 0 if self.tie_word_embeddings else v * d
        return layers + v * d + head + d

    def replace(self, **changes: Any) -> ModelConfig:
        """Returns a copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def check_positions(self, tokens: int, what: str) -> None:
        """The one rule for sequence length: a request may use positions ``[0, tokens)`` only
        within ``max_position_embeddings``, the context the checkpoint was trained for (past it
        RoPE extrapolates and the output is not what the model was trained to give).

        Raises:
            InputError: ``tokens > max_position_embeddings``; the message starts with ``what``.
        """
        if tokens > self.max_position_embeddings:
            raise InputError(
                f"{what} needs {tokens} positions, more than {self.name}'s "
                f"max_position_embeddings={self.max_position_embeddings}; shorten it"
            )


def request_positions(prompt_len: int, max_new_tokens: int) -> int:
    """KV-cache positions a request of ``prompt_len`` tokens that generates ``max_new_tokens``
    uses: ``prompt_len + max_new_tokens - 1``, since its last generated token is returned and
    never fed back (transformers' ``generate`` runs such a request within the same bound). The
    one count that ``Engine.generate`` and ``graphtune generate`` check against
    ``max_seq_len`` and :meth:`ModelConfig.check_positions`."""
    return prompt_len + max_new_tokens - 1


def _rope_from_hf(cfg: Mapping[str, Any], default_theta: float) -> tuple[float, RopeScaling | None]:
    """RoPE's theta and scaling as transformers' configs standardise them: the legacy
    ``rope_scaling`` object, when present, replaces ``rope_parameters``; the object's own
    ``rope_theta`` wins over the top-level one; for llama3 a top-level
    ``original_max_position_embeddings`` wins over the object's, and ``max_position_embeddings``
    stands in when neither gives one. ``partial_rotary_factor`` (in the object or at the top
    level) is ignored with default RoPE, as the six models' default RoPE ignores it, and refused
    otherwise unless it is 1."""
    field_name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = cfg.get(field_name) or {}
    if not isinstance(params, Mapping):
        raise CheckpointError(
            f"config.json: {field_name}={params!r} must be an object (rope_type, factor, ...); "
            "fix the file"
        )
    nested = sorted(str(k) for k, v in params.items() if isinstance(v, Mapping))
    if nested:
        # Keyed by layer type (Gemma3's layout): the six models read one flat object, and
        # transformers' fail on this one (KeyError 'rope_type'); reading it flat would drop
        # the nested factor and theta.
        raise CheckpointError(
            f"config.json: {field_name} holds objects under {nested} (RoPE per layer type), "
            "which the six models graphtune loads do not read (transformers fails on it too); "
            'make it one object such as {"rope_type": "linear", "factor": 4.0, "rope_theta": '
            "500000.0}"
        )
    where = f"config.json {field_name}"
    theta_source = params if "rope_theta" in params else cfg
    theta = default_theta
    if "rope_theta" in theta_source:  # null too: transformers fails on it
        theta = hf_float(
            theta_source, "rope_theta", where if theta_source is params else "config.json"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if rope_type not in (None, "default") and partial not in (None, 1):
        # transformers' linear and llama3 RoPE would rotate only part of each head (and then
        # fail on the width); the engine rotates whole heads.
        raise ConfigError(
            f"config.json: partial_rotary_factor={partial!r} with rope_type={rope_type!r} is not "
            "implemented by graphtune's engine (it rotates whole heads; transformers fails on "
            "it too); use a checkpoint without it or with partial_rotary_factor 1"
        )
    try:
        if rope_type in (None, "default"):
            return theta, None
        if rope_type == "linear":
            return theta, RopeScaling("linear", hf_float(params, "factor", where))
        if rope_type == "llama3":
            key = "original_max_position_embeddings"
            source = cfg if key in cfg else params
            original = {key: source.get(key, cfg["max_position_embeddings"])}
            return theta, RopeScaling(
                "llama3",
                hf_float(params, "factor", where),
                hf_float(params, "low_freq_factor", where),
                hf_float(params, "high_freq_factor", where),
                hf_int(original, key, "config.json" if source is cfg else where),
            )
    except KeyError as exc:
        raise CheckpointError(
            f"{where} with rope_type={rope_type!r} is missing the key {exc}; fix the file"
        ) from None
    raise ConfigError(
        f"config.json: {field_name} rope_type={rope_type!r} is not implemented by graphtune's "
        "engine (it implements default, linear and llama3 RoPE); use a checkpoint without it"
    )


def eos_ids(value: Any, where: str = "config.json") -> tuple[int, ...]:
    """``eos_token_id`` of a config file (an int, a list of ints or null) as a tuple.

    Raises:
        CheckpointError: Anything else (``where`` names the file).
    """
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in values):
        raise CheckpointError(
            f"{where}: eos_token_id={value!r} must be a token id, a list of token ids or null; "
            "fix the file"
        )
    return tuple(values)


def from_hf_config(cfg: Mapping[str, Any], name: str = "checkpoint") -> ModelConfig:
    """Maps a Hugging Face ``config.json`` (as a dict) to a :class:`ModelConfig`.

    Fields left out take transformers' default for the architecture; which fields are read,
    ignored or refused is in :mod:`graphtune.engine.hf_fields`.

    Args:
        cfg: The parsed ``config.json``.
        name: Label for the resulting config.

    Returns:
        The equivalent config.

    Raises:
        CheckpointError: The architecture is not Llama, Qwen2, Mistral, Qwen3, Qwen3-MoE or
            Mixtral, or a field is missing.
        ConfigError: A field has a value the engine does not implement (the message names the
            field and the value).
    """
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise CheckpointError(
            f"config.json: architectures={archs!r} must be a list of class names, such as "
            '["LlamaForCausalLM"]; fix the file'
        )
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        model_type = cfg.get("model_type")
        if model_type in ARCHITECTURES.values() and not archs:
            arch = model_type
        else:
            raise CheckpointError(
                f"unsupported architecture {archs or model_type!r}: graphtune's engine loads "
                f"{sorted(ARCHITECTURES)}. Convert the checkpoint or use a preset."
            )
    model_type = cfg.get("model_type")
    if model_type is not None and model_type != arch:
        # transformers' Auto classes build the model that model_type names, whatever
        # architectures says: reading it as another family would compute another model.
        raise CheckpointError(
            f"config.json: architectures {archs} is graphtune's {arch!r} but model_type is "
            f"{model_type!r}, which transformers builds instead; make the two agree"
        )
    cfg = with_defaults(arch, cfg)
    layer_types(cfg)  # every class checks it, even those whose model ignores it
    refuse_unimplemented(arch, cfg)
    theta, scaling = _rope_from_hf(cfg, HF_ROPE_THETA.get(arch, 10000.0))
    moe = moe_fields_from_hf(cfg, arch) if arch in MOE_ARCHITECTURES else {}
    try:
        heads = hf_int(cfg, "num_attention_heads")
        return ModelConfig(
            name=name,
            architecture=arch,
            vocab_size=hf_int(cfg, "vocab_size"),
            hidden_size=hf_int(cfg, "hidden_size"),
            intermediate_size=hf_int(cfg, "intermediate_size"),
            num_layers=hf_int(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=heads
            if cfg.get("num_key_value_heads") is None
            else hf_int(cfg, "num_key_value_heads"),
            head_dim=None if cfg.get("head_dim") is None else hf_int(cfg, "head_dim"),
            rms_norm_eps=hf_float(cfg, "rms_norm_eps"),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf_int(cfg, "max_position_embeddings"),
            tie_word_embeddings=hf_bool(cfg, "tie_word_embeddings"),
            attention_bias=arch == "qwen2",
            sliding_window=sliding_window(arch, cfg),  # Qwen's are refused above
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids(cfg.get("eos_token_id")),
            hidden_act=HF_ACTIVATIONS[cfg["hidden_act"]],
            mlp_bias=arch == "llama" and hf_bool(cfg, "mlp_bias"),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            **moe,
        )
    except KeyError as exc:
        raise CheckpointError(f"config.json is missing the field {exc}") from None
    except CheckpointError:
        raise
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise CheckpointError(f"config.json describes an invalid model: {exc}") from None
        raise CheckpointError(f"config.json has a field of the wrong type: {exc}") from None
