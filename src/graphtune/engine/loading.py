"""Loading a model: a local Hugging Face checkpoint folder or random weights for a preset.

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Tensors are read with ``safetensors``; Q/K/V and gate/up are
concatenated into the fused matrices the decode step uses. A ``tokenizer.json`` next to them is
loaded with ``tokenizers`` when that package is installed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from graphtune.engine.config import PRESETS, ModelConfig, from_hf_config, get_preset
from graphtune.engine.model import DecoderModel, LayerWeights, random_model
from graphtune.errors import CheckpointError

if TYPE_CHECKING:
    from graphtune.engine.parallel import ParallelContext

logger = logging.getLogger(__name__)


class _TensorSource:
    """Reads named tensors from one or more safetensors files, checking names and shapes."""

    def __init__(self, folder: Path) -> None:
        try:
            from safetensors import safe_open
        except ImportError as exc:
            raise CheckpointError(
                "loading a checkpoint needs the 'safetensors' package: "
                "pip install 'graphtune[models]'"
            ) from exc
        self._safe_open = safe_open
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: folder / file for name, file in weight_map.items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(
                    f"{folder} has no *.safetensors files (graphtune does not read .bin/.pt "
                    "checkpoints; re-save with safe_serialization=True)"
                )
            self.files = {}
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():
                        self.files[name] = file
        self._handles: dict[Path, Any] = {}

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Returns tensor ``name`` after checking it exists and has ``shape``."""
        file = self.files.get(name)
        if file is None:
            raise CheckpointError(f"checkpoint is missing the tensor {name!r} (expected {shape})")
        handle = self._handles.get(file)
        if handle is None:
            handle = self._safe_open(str(file), framework="pt")
            self._handles[file] = handle
        try:
            tensor = handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types; keep the cause.
            raise CheckpointError(f"could not read tensor {name!r} from {file}: {exc}") from exc
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)} but config.json implies "
                f"{tuple(shape)}; the config and the weights do not belong together"
            )
        return tensor


def load_checkpoint(
    folder: str | Path,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> DecoderModel:
    """Loads a Hugging Face Llama / Qwen2 / Mistral checkpoint folder.

    Args:
        folder: Directory with ``config.json`` and safetensors weights (sharded or not).
        device: Where to put the weights (default CPU).
        dtype: Weight dtype; ``None`` keeps the checkpoint's.

    Returns:
        The model, with a tokenizer attached when ``tokenizer.json`` exists.

    Raises:
        CheckpointError: Missing files, unknown architecture, a missing tensor or a shape mismatch
            (the message names the tensor).
    """
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{folder} has no config.json; is it a Hugging Face model folder?")
    config = from_hf_config(json.loads(config_file.read_text()), name=folder.name)
    source = _TensorSource(folder)
    d, inter = config.hidden_size, config.intermediate_size

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return source.get(name, shape).to(device=device, dtype=dtype)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        wqkv = torch.cat([
            get(attn + "q_proj.weight", (config.q_size, d)),
            get(attn + "k_proj.weight", (config.kv_size, d)),
            get(attn + "v_proj.weight", (config.kv_size, d)),
        ])
        bqkv = None
        if config.attention_bias:
            bqkv = torch.cat([
                get(attn + "q_proj.bias", (config.q_size,)),
                get(attn + "k_proj.bias", (config.kv_size,)),
                get(attn + "v_proj.bias", (config.kv_size,)),
            ])
        layers.append(
            LayerWeights(
                attn_norm=get(p + "input_layernorm.weight", (d,)),
                wqkv=wqkv,
                bqkv=bqkv,
                wo=get(attn + "o_proj.weight", (d, config.q_size)),
                mlp_norm=get(p + "post_attention_layernorm.weight", (d,)),
                w_gate_up=torch.cat([
                    get(p + "mlp.gate_proj.weight", (inter, d)),
                    get(p + "mlp.up_proj.weight", (inter, d)),
                ]),
                w_down=get(p + "mlp.down_proj.weight", (d, inter)),
            )
        )
    embed = get("model.embed_tokens.weight", (config.vocab_size, d))
    if config.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = get("lm_head.weight", (config.vocab_size, d))
    model = DecoderModel(
        config=config,
        embed=embed,
        layers=layers,
        final_norm=get("model.norm.weight", (d,)),
        lm_head=lm_head,
        tokenizer=load_tokenizer(folder),
        source=str(folder),
    )
    logger.info("loaded %s (%s, %d layers) from %s", config.name, config.architecture,
                config.num_layers, folder)
    return model


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
    return Tokenizer.from_file(str(path))


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
        dtype: Weight dtype (presets default to float32).
        seed: Seed for random weights.
        parallel: Tensor parallelism: return this rank's shard (see
            :func:`graphtune.engine.parallel.shard_model`). Random weights are drawn whole on
            ``device`` with ``seed`` (so every rank, and a ``tp=1`` run, sees the same model)
            and then sliced; a checkpoint is read on the CPU, sliced, and only the shard moves
            to ``device``. ``None`` or ``world_size == 1``: the whole model.

    Raises:
        ConfigError: ``spec`` is neither an existing folder nor a preset, or the model does not
            split evenly over ``parallel.world_size`` ranks.
        CheckpointError: The folder cannot be loaded.
    """
    if parallel is not None and parallel.world_size > 1:
        from graphtune.engine.parallel import check_shardable, shard_model

        if isinstance(spec, ModelConfig):
            check_shardable(spec, parallel.world_size)
        elif str(spec) in PRESETS:
            check_shardable(PRESETS[str(spec)], parallel.world_size)
        on_cpu = Path(spec).is_dir() if not isinstance(spec, ModelConfig) else False
        whole = load_model(spec, device="cpu" if on_cpu else device, dtype=dtype, seed=seed)
        shard = shard_model(whole, parallel)
        return shard.to(device) if on_cpu else shard
    if isinstance(spec, ModelConfig):
        return random_model(spec, seed=seed, device=device, dtype=dtype or torch.float32)
    path = Path(spec)
    if path.is_dir():
        return load_checkpoint(path, device=device, dtype=dtype)
    if str(spec) in PRESETS or not path.exists():
        return random_model(get_preset(str(spec)), seed=seed, device=device,
                            dtype=dtype or torch.float32)
    raise CheckpointError(f"{spec} is not a folder; pass a checkpoint folder or a preset name")
