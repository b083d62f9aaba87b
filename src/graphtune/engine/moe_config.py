"""The mixture-of-experts part of the model configuration: its rules and its ``config.json``.

:func:`check_moe_fields` holds the rules of ``ModelConfig``'s MoE fields (called on
construction). :func:`moe_fields_from_hf` reads the MoE fields of a Qwen3-MoE or Mixtral
``config.json`` for :func:`~graphtune.engine.config.from_hf_config`, checking their types and
that the two spellings of the expert count agree; which fields of those files are read,
ignored or refused is in :mod:`graphtune.engine.hf_fields`, as for every architecture.

The layer layout follows transformers' ``Qwen3MoeDecoderLayer``: layer ``i`` is a mixture of
experts when ``i`` is not in ``mlp_only_layers``, ``num_experts > 0`` and ``(i + 1) %
decoder_sparse_step == 0``; the other layers are dense SwiGLU MLPs of ``intermediate_size``.
Entries of ``mlp_only_layers`` that name no layer (``-1`` included) are dropped with a warning, as
they change nothing there; ``num_experts: 0`` makes every layer dense.
Mixtral has no dense layers, and its ``intermediate_size`` is the expert width.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from graphtune.engine.hf_fields import hf_bool, hf_int
from graphtune.errors import ConfigError

logger = logging.getLogger(__name__)

#: Architectures (``ModelConfig.architecture``) whose MLPs are mixtures of experts.
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")


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
    if config.hidden_act != "silu" or config.mlp_bias:
        raise ConfigError(
            f"ModelConfig {name!r}: the experts are SwiGLU without biases; got hidden_act="
            f"{config.hidden_act!r}, mlp_bias={config.mlp_bias}"
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
    return hf_int(cfg if field in cfg or default is None else {field: default}, field)


def _expert_count(cfg: Mapping[str, Any], default: int) -> int:
    """The expert count under either of its names: both configs' ``attribute_map`` makes
    ``num_experts`` and ``num_local_experts`` one field (two that disagree are refused); neither:
    transformers' ``default``."""
    if "num_experts" in cfg and "num_local_experts" in cfg:
        if cfg["num_experts"] != cfg["num_local_experts"]:
            raise _refuse(
                "num_local_experts",
                cfg["num_local_experts"],
                f"disagrees with num_experts={cfg['num_experts']!r}; keep one of them",
            )
    return _int(cfg, "num_experts" if "num_experts" in cfg else "num_local_experts", default)


def moe_fields_from_hf(cfg: Mapping[str, Any], architecture: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a ``ModelConfig`` for a Qwen3-MoE or Mixtral file.

    Args:
        cfg: The parsed ``config.json`` with transformers' defaults
            (:func:`graphtune.engine.hf_fields.with_defaults`).
        architecture: ``"qwen3_moe"`` or ``"mixtral"``.

    Returns:
        Keyword arguments for ``ModelConfig``: ``num_experts``, ``num_experts_per_tok``,
        ``moe_intermediate_size``, ``norm_topk_prob``, ``mlp_only_layers`` and
        ``decoder_sparse_step``.

    Raises:
        ConfigError: A field has a value of the wrong type, or ``num_experts`` and
            ``num_local_experts`` disagree (the message names the field and the value).
    """
    if architecture == "mixtral":
        return dict(
            num_experts=_expert_count(cfg, 8),
            num_experts_per_tok=_int(cfg, "num_experts_per_tok"),
            moe_intermediate_size=_int(cfg, "intermediate_size"),
            norm_topk_prob=True,  # Mixtral's router always renormalises the top-k weights
        )
    mlp_only = cfg.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in mlp_only
    ):
        raise _refuse("mlp_only_layers", mlp_only, "must be a list of layer indices")
    layers = cfg.get("num_hidden_layers")
    if isinstance(layers, int) and any(not 0 <= i < layers for i in mlp_only):
        # transformers only asks `layer_idx in mlp_only_layers`: -1 is no layer, not the last.
        logger.warning(
            "config.json: mlp_only_layers=%s: %s name no layer of [0, %d) and have no effect, "
            "as in transformers",
            mlp_only,
            sorted({i for i in mlp_only if not 0 <= i < layers}),
            layers,
        )
        mlp_only = [i for i in mlp_only if 0 <= i < layers]
    experts = _expert_count(cfg, 128)
    return dict(
        num_experts=experts,
        # No experts: transformers makes every layer dense, and the top-k is never used.
        num_experts_per_tok=_int(cfg, "num_experts_per_tok") if experts else 0,
        moe_intermediate_size=_int(cfg, "moe_intermediate_size"),
        norm_topk_prob=hf_bool(cfg, "norm_topk_prob"),
        mlp_only_layers=tuple(mlp_only),
        decoder_sparse_step=_int(cfg, "decoder_sparse_step"),
    )
