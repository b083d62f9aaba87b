"""Loading a model: a local Hugging Face checkpoint folder or random weights for a preset.

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, chosen as transformers chooses them
(:mod:`graphtune.engine.safetensors_source`). Tensors are read with ``safetensors``; Q/K/V and
gate/up are concatenated into the fused matrices the decode step uses. A ``tokenizer.json`` next
to them is loaded with ``tokenizers`` when that package is installed, and when a
``generation_config.json`` exists its ``eos_token_id`` (missing or null: no EOS) replaces
``config.json``'s, as transformers' ``generate`` does (its other settings are not read; those
that change transformers' tokens are named in one warning). Every file that cannot be read or
parsed is a :class:`~graphtune.errors.CheckpointError` naming it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from graphtune.engine.config import ModelConfig, eos_ids, from_hf_config
from graphtune.engine.devices import MODEL_DTYPES, as_torch_device, check_model_dtype
from graphtune.engine.model import DecoderModel, LayerWeights, random_model, warm_triton_for
from graphtune.engine.moe_loading import load_moe_layer
from graphtune.engine.presets import PRESETS, get_preset
from graphtune.engine.safetensors_source import TensorSource, read_json
from graphtune.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from graphtune.engine.parallel import ParallelContext

logger = logging.getLogger(__name__)


def load_config(spec: str | Path) -> ModelConfig:
    """The shapes of a model without its weights: a preset name, or a Hugging Face checkpoint
    folder whose ``config.json`` is read (when a ``generation_config.json`` exists, its
    ``eos_token_id``, missing or null meaning no EOS, replaces ``config.json``'s as in
    transformers' ``generate``; Llama-3-Instruct checkpoints list their end-of-turn token only
    there). Checks a request before loading.

    Raises:
        ConfigError: ``spec`` is neither an existing folder nor a preset, or a field has a value
            the engine does not implement.
        CheckpointError: The folder's config cannot be read or parsed, or names an unsupported
            architecture.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        return _folder_config(path, _config_doc(path))
    if str(spec) in PRESETS:
        return PRESETS[str(spec)]
    raise _not_a_model(spec)


def _config_doc(folder: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint folder (read once per load: the config, the
    weights file and the dtype all come from it)."""
    config_file = folder / "config.json"
    if config_file.is_dir():
        raise CheckpointError(
            f"{config_file} is a folder, not a file; a Hugging Face model folder holds its "
            "config.json as a file: put the model's config.json there"
        )
    if not config_file.is_file():
        raise CheckpointError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    return read_json(config_file)  # its errors name the file already


def _folder_config(folder: Path, doc: dict[str, Any]) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint folder whose ``config.json`` is ``doc`` (see
    :func:`load_config`)."""
    config_file = folder / "config.json"
    try:
        config = from_hf_config(doc, name=folder.name)
    except (CheckpointError, ConfigError) as exc:
        # from_hf_config sees the parsed fields only; the user needs to know which folder.
        text = str(exc).removeprefix("config.json")
        raise type(exc)(f"{config_file}{text if text[:1] in ':,; ' else ': ' + text}") from None
    generation = folder / "generation_config.json"
    if generation.is_file():
        # transformers' generate reads this file alone: no eos_token_id there (or null) is no
        # EOS, whatever config.json says.
        generation_doc = read_json(generation)
        eos = generation_doc.get("eos_token_id")
        config = config.replace(eos_token_ids=eos_ids(eos, str(generation)))
        ignored = ignored_generation_settings(generation_doc)
        if ignored:
            logger.warning(
                "%s sets %s, which graphtune does not read (only eos_token_id): generate decodes "
                "greedily unless given SamplingParams, so its tokens differ from transformers' "
                "generate() on this folder; pass SamplingParams(temperature=, top_k=, top_p=) "
                "to sample",
                generation,
                ", ".join(f"{key}={generation_doc[key]!r}" for key in ignored),
            )
    return config


#: ``generation_config.json`` settings that change which tokens transformers' ``generate()``
#: returns, with transformers' default: a file that sets one to another value is warned about.
#: Length limits are left out: callers pass ``max_new_tokens`` to both.
GENERATION_DEFAULTS: dict[str, Any] = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "min_p": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "min_new_tokens": None,
    "min_length": 0,
    "num_beams": 1,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "renormalize_logits": False,
    "exponential_decay_length_penalty": None,
}


def ignored_generation_settings(doc: dict[str, Any]) -> list[str]:
    """The keys of a ``generation_config.json`` document that change transformers' tokens and
    that graphtune does not read. Sampling knobs (temperature, top-k, top-p) only count when
    the file samples (``do_sample``), since transformers ignores them otherwise."""
    sampling_knobs = {"temperature", "top_k", "top_p", "min_p", "typical_p"}
    sampling_knobs |= {"epsilon_cutoff", "eta_cutoff"}
    samples = bool(doc.get("do_sample", False))
    return [
        key
        for key, default in GENERATION_DEFAULTS.items()
        if key in doc
        and doc[key] != default
        and not (key == "min_length" and doc[key] is None)
        and not (default is None and doc[key] in ([], {}))  # an empty list suppresses nothing
        and (samples or key not in sampling_knobs)
    ]


def _not_a_model(spec: str | Path) -> ConfigError:
    path = Path(spec).expanduser()
    what = "is a file, not a folder" if path.exists() else "is not an existing folder"
    return ConfigError(
        f"model {str(spec)!r} {what} and not a preset (presets: {', '.join(sorted(PRESETS))}); "
        "pass a Hugging Face checkpoint folder (config.json and *.safetensors) or a preset name"
    )


def load_checkpoint(
    folder: str | Path,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    parallel: ParallelContext | None = None,
) -> DecoderModel:
    """Loads a Hugging Face Llama / Qwen2 / Mistral / Qwen3 / Qwen3-MoE / Mixtral checkpoint
    folder.

    Args:
        folder: Directory with ``config.json`` and safetensors weights (sharded or not).
        device: Where to put the weights (default CPU).
        dtype: Weight dtype of every tensor; ``None``: ``config.json``'s ``dtype`` (or
            ``torch_dtype``), else the weights' (the index's metadata ``dtype``, else the first
            floating-point tensor of the first file), as transformers' ``dtype="auto"``.
        parallel: Tensor parallelism with ``world_size > 1``: read only this rank's slices of
            the sharded projections (see :mod:`graphtune.engine.parallel`); replicated tensors
            are read whole.

    Returns:
        The model, with a tokenizer attached when ``tokenizer.json`` exists.

    Raises:
        ConfigError: ``device`` is unknown or not usable here (CUDA without CUDA).
        CheckpointError: Missing files, unknown architecture, a missing tensor or a shape mismatch
            (the message names the tensor).
    """
    folder = Path(folder)
    device = None if device is None else as_torch_device(device)
    doc = _config_doc(folder)
    config = _folder_config(folder, doc)
    warm_triton_for(device)
    tp = parallel.world_size if parallel is not None else 1
    if tp > 1:
        from graphtune.engine.parallel import check_shardable

        check_shardable(config, tp)
    source = TensorSource(folder, doc)
    if dtype is None:
        dtype = _auto_dtype(folder / "config.json", doc, source)
    d, inter = config.hidden_size, config.intermediate_size
    rows = (0, parallel.rank, tp) if parallel is not None and tp > 1 else None
    cols = (1, parallel.rank, tp) if parallel is not None and tp > 1 else None

    def get(
        name: str, shape: tuple[int, ...], part: tuple[int, int, int] | None = None
    ) -> torch.Tensor:
        return source.get(name, shape, part).to(device=device, dtype=dtype)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        wqkv = torch.cat(
            [
                get(attn + "q_proj.weight", (config.q_size, d), rows),
                get(attn + "k_proj.weight", (config.kv_size, d), rows),
                get(attn + "v_proj.weight", (config.kv_size, d), rows),
            ]
        )
        bqkv = None
        if config.attention_bias:
            bqkv = torch.cat(
                [
                    get(attn + "q_proj.bias", (config.q_size,), rows),
                    get(attn + "k_proj.bias", (config.kv_size,), rows),
                    get(attn + "v_proj.bias", (config.kv_size,), rows),
                ]
            )
        moe = config.is_moe_layer(i)
        layer = LayerWeights(
            attn_norm=get(p + "input_layernorm.weight", (d,)),
            wqkv=wqkv,
            bqkv=bqkv,
            wo=get(attn + "o_proj.weight", (d, config.q_size), cols),
            mlp_norm=get(p + "post_attention_layernorm.weight", (d,)),
            w_gate_up=None
            if moe
            else torch.cat(
                [
                    get(p + "mlp.gate_proj.weight", (inter, d), rows),
                    get(p + "mlp.up_proj.weight", (inter, d), rows),
                ]
            ),
            w_down=None if moe else get(p + "mlp.down_proj.weight", (d, inter), cols),
            **_optional_layer_tensors(config, p, get, rows, moe),
        )
        if moe:
            layer.router, layer.experts_gate_up, layer.experts_down = load_moe_layer(
                get, source.has, p, config
            )
        layers.append(layer)
    embed_name = "model.embed_tokens.weight"
    if config.tie_word_embeddings and not source.has(embed_name) and source.has("lm_head.weight"):
        # transformers ties a file that stores only the head: the embedding is the head.
        embed_name = "lm_head.weight"
    embed = get(embed_name, (config.vocab_size, d))
    lm_head = embed
    if not config.tie_word_embeddings or source.has("lm_head.weight"):
        lm_head = get("lm_head.weight", (config.vocab_size, d))
    if config.tie_word_embeddings and torch.equal(lm_head, embed):
        lm_head = embed  # one tensor, as tied
    elif config.tie_word_embeddings:
        # transformers keeps a file's own head that differs from the embedding, tie or not.
        logger.warning(
            "%s: config.json ties the LM head to the embedding, but the file's lm_head.weight "
            "differs from it; using lm_head.weight, as transformers does",
            folder,
        )
        config = config.replace(tie_word_embeddings=False)
    model = DecoderModel(
        config=config,
        embed=embed,
        layers=layers,
        final_norm=get("model.norm.weight", (d,)),
        lm_head=lm_head,
        tokenizer=load_tokenizer(folder),
        source=str(folder),
    )
    model.extras["weights_mark"] = source.mark()
    _warn_unread(source, folder)
    if rows is not None:
        from graphtune.engine.parallel import shard_config

        model.config = shard_config(config, tp)
        model.global_config = config
        model.parallel = parallel
        model.source = f"{folder} [tp rank {parallel.rank}/{tp}]"
    logger.info(
        "loaded %s (%s, %d layers) from %s",
        config.name,
        config.architecture,
        config.num_layers,
        folder,
    )
    return model


def _auto_dtype(config_file: Path, doc: dict[str, Any], source: TensorSource) -> torch.dtype:
    """The one dtype transformers' ``dtype="auto"`` loads every tensor in: ``config_file``'s
    (parsed: ``doc``) ``dtype`` (``torch_dtype`` when ``dtype`` is absent or null), else the
    weights' (:meth:`TensorSource.auto_dtype`: the index's metadata, else the first file's
    first floating-point tensor), never one tensor chosen by name."""
    field = "dtype" if doc.get("dtype") is not None else "torch_dtype"
    name = doc.get(field)
    where = f"{config_file}: {field}={name!r}"
    if name is None:
        name, origin = source.auto_dtype()
        where = f"{config_file.parent}: with no dtype in config.json, {name!r}, from {origin},"
    dtype = getattr(torch, name, None) if isinstance(name, str) else name
    if not isinstance(dtype, torch.dtype) or dtype not in MODEL_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in MODEL_DTYPES)
        raise CheckpointError(
            f"{where} is not a weight dtype graphtune loads ({names}); "
            "fix the file or pass dtype= (--dtype) to choose one"
        )
    return dtype


def _optional_layer_tensors(
    config: ModelConfig,
    prefix: str,
    get: Any,
    rows: tuple[int, int, int] | None,
    moe: bool,
) -> dict[str, torch.Tensor]:
    """The layer tensors only some configs have: Qwen3's q/k norms, Llama's MLP biases (never
    on a mixture-of-experts layer, ``moe``)."""
    out = {}
    if config.qk_norm:
        head = (config.dim_per_head,)
        out["q_norm"] = get(prefix + "self_attn.q_norm.weight", head)
        out["k_norm"] = get(prefix + "self_attn.k_norm.weight", head)
    if config.mlp_bias and not moe:
        inter = (config.intermediate_size,)
        out["b_gate_up"] = torch.cat(
            [
                get(prefix + "mlp.gate_proj.bias", inter, rows),
                get(prefix + "mlp.up_proj.bias", inter, rows),
            ]
        )
        out["b_down"] = get(prefix + "mlp.down_proj.bias", (config.hidden_size,))
    return out


def _warn_unread(source: TensorSource, folder: Path) -> None:
    # transformers drops these too: RoPE tables some old checkpoints saved.
    unread = [name for name in source.unread() if not name.endswith("rotary_emb.inv_freq")]
    if unread:
        logger.warning(
            "%s: %d tensors of the checkpoint are not used, as config.json describes the model "
            "(transformers ignores them too): %s",
            folder,
            len(unread),
            ", ".join(unread[:5]) + (", ..." if len(unread) > 5 else ""),
        )


def load_tokenizer(folder: Path) -> Any:
    """Returns a ``tokenizers.Tokenizer`` for ``folder/tokenizer.json``, or ``None``.

    A missing file or a missing ``tokenizers`` package means token ids in and out (logged).
    """
    path = folder / "tokenizer.json"
    if not path.exists():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        logger.warning("%s exists but 'tokenizers' is not installed; using token ids", path)
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own exception type; keep the cause.
        raise CheckpointError(
            f"{path} cannot be loaded by tokenizers ({exc}); it may be truncated or from a newer "
            "tokenizers version: download it again or upgrade tokenizers"
        ) from None


def load_model(
    spec: str | Path | ModelConfig,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    parallel: ParallelContext | None = None,
) -> DecoderModel:
    """Loads a checkpoint folder, or builds random weights for a preset name or config.

    Args:
        spec: A folder path, a preset name (see ``PRESETS``) or a :class:`ModelConfig`.
        device: Target device.
        dtype: Weight dtype (presets default to float32; a folder to its config's dtype, see
            :func:`load_checkpoint`).
        seed: Seed for random weights.
        parallel: Tensor parallelism: return this rank's shard (see
            :func:`graphtune.engine.parallel.shard_model`). Random weights are drawn whole on
            ``device`` with ``seed`` (so every rank, and a ``tp=1`` run, sees the same model)
            and then sliced; from a checkpoint only this rank's slices of the sharded
            projections are read. ``None`` or ``world_size == 1``: the whole model.

    Raises:
        ConfigError: ``spec`` is neither an existing folder nor a preset, the model does not
            split evenly over ``parallel.world_size`` ranks, or ``device`` is unknown or not
            usable here (CUDA without CUDA).
        CheckpointError: The folder cannot be loaded.
    """
    check_model_dtype(dtype)
    if parallel is not None and parallel.world_size > 1:
        from graphtune.engine.parallel import check_shardable, shard_model

        if isinstance(spec, ModelConfig):
            check_shardable(spec, parallel.world_size)
        elif str(spec) in PRESETS:
            check_shardable(PRESETS[str(spec)], parallel.world_size)
        if not isinstance(spec, ModelConfig) and Path(spec).is_dir():
            return load_checkpoint(spec, device=device, dtype=dtype, parallel=parallel)
        return shard_model(load_model(spec, device=device, dtype=dtype, seed=seed), parallel)
    if isinstance(spec, ModelConfig):
        return random_model(spec, seed=seed, device=device, dtype=dtype or torch.float32)
    path = Path(spec)
    if path.is_dir():
        return load_checkpoint(path, device=device, dtype=dtype)
    if str(spec) in PRESETS:
        return random_model(
            get_preset(str(spec)), seed=seed, device=device, dtype=dtype or torch.float32
        )
    raise _not_a_model(spec)
