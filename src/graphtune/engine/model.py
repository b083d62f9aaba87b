"""Weights of a Llama-family decoder and the small numeric building blocks it needs.

The weights are plain tensors in dataclasses, not ``nn.Module`` parameters: the engine only runs
inference, and a flat layout makes the decode step's hot loop a handful of attribute reads. Q, K
and V projections are fused into one matrix and gate/up into another at load time, so each layer
launches two GEMMs fewer per step.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from graphtune.engine.config import ModelConfig
from graphtune.engine.devices import as_torch_device, check_model_dtype
from graphtune.ops._triton import start_cache_key_warmup
from graphtune.ops.rotary import rotate

logger = logging.getLogger(__name__)


@dataclass
class LayerWeights:
    """One decoder layer.

    Attributes:
        attn_norm: ``[hidden]`` RMSNorm weight before attention.
        wqkv: ``[q_size + 2 * kv_size, hidden]`` fused Q, K, V projection.
        bqkv: Matching bias (Qwen2) or ``None``.
        wo: ``[hidden, q_size]`` attention output projection.
        mlp_norm: ``[hidden]`` RMSNorm weight before the MLP.
        w_gate_up: ``[2 * intermediate, hidden]`` fused gate and up projections (gate first);
            ``None`` in a mixture-of-experts layer.
        w_down: ``[hidden, intermediate]`` down projection; ``None`` in a mixture-of-experts layer.
        q_norm: ``[head_dim]`` RMSNorm weight of every query head (Qwen3, Qwen3-MoE), else
            ``None``.
        k_norm: ``[head_dim]`` RMSNorm weight of every key head (Qwen3, Qwen3-MoE), else ``None``.
        b_gate_up: ``[2 * intermediate]`` gate and up biases (``mlp_bias``), or ``None``.
        b_down: ``[hidden]`` down-projection bias (``mlp_bias``), or ``None``.
        router: ``[experts, hidden]`` router of a mixture-of-experts layer, else ``None``.
        experts_gate_up: ``[experts, 2 * moe_intermediate, hidden]``, each expert's gate rows then
            its up rows (the layout of ``graphtune.ops.fused_moe`` and transformers'
            ``gate_up_proj``), else ``None``.
        experts_down: ``[experts, hidden, moe_intermediate]``, else ``None``.
    """

    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor | None
    w_down: torch.Tensor | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    router: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None

    @property
    def is_moe(self) -> bool:
        """Whether the MLP is a mixture of experts."""
        return self.router is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the layer by attribute name (absent ones, ``None``, omitted)."""
        out = {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return out


@dataclass
class DecoderModel:
    """A loaded decoder: config, weights and an optional tokenizer.

    Attributes:
        config: The model shape.
        embed: ``[vocab, hidden]`` token embedding.
        layers: Per-layer weights.
        final_norm: ``[hidden]`` RMSNorm weight after the last layer.
        lm_head: ``[vocab, hidden]``; the same tensor object as ``embed`` when tied.
        tokenizer: A ``tokenizers.Tokenizer`` when the checkpoint folder had one, else ``None``.
        source: Where the weights came from (a folder, or ``"random:<preset>:seed<N>"``).
        extras: Free-form metadata.
        parallel: The :class:`~graphtune.engine.parallel.ParallelContext` of a tensor-parallel
            shard (then ``config`` is the per-rank shape), ``None`` for a whole model.
        global_config: The unsharded config of a shard, ``None`` for a whole model.
    """

    config: ModelConfig
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    tokenizer: Any = None
    source: str = ""
    extras: dict[str, Any] = field(default_factory=dict)
    parallel: Any = None
    global_config: ModelConfig | None = None

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        """Floating dtype of the weights."""
        return self.embed.dtype

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> DecoderModel:
        """Moves and casts every weight in place (keeps tied embeddings tied) and returns self.

        Raises:
            ConfigError: ``dtype`` is not a floating dtype a model can run in (checked before
                any weight changes).
        """
        check_model_dtype(dtype)
        tied = self.lm_head is self.embed

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype)

        self.embed = move(self.embed)
        self.lm_head = self.embed if tied else move(self.lm_head)
        self.final_norm = move(self.final_norm)
        for layer in self.layers:
            for name, tensor in layer.tensors().items():
                setattr(layer, name, move(tensor))
        return self

    def weight_bytes(self) -> int:
        """Bytes of all weights (untied embedding rows are negligible): what a dense decode step
        reads; a mixture-of-experts step reads only the experts its tokens select
        (:func:`graphtune.bench.moe_floor.step_weight_bytes`)."""
        total = self.lm_head.numel() * self.lm_head.element_size()
        total += self.final_norm.numel() * self.final_norm.element_size()
        for layer in self.layers:
            total += sum(t.numel() * t.element_size() for t in layer.tensors().values())
        return total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face's Llama computes it: float32 statistics, scaled by ``weight``.

    ``F.rms_norm`` accumulates in float32 for half-precision inputs and is one fused kernel on
    recent CUDA builds of torch (eight elementwise kernels otherwise). Hugging Face rounds the
    normalised value to the input dtype before multiplying by the weight; here the weight is
    applied before that single rounding, so bf16 results can differ in the last bit (float32
    results agree to rounding, which the transformers oracle tests check).
    """
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_inv_freq(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies ``[head_dim // 2]`` in float32, including Llama-3 scaling.

    The arithmetic follows ``transformers.modeling_rope_utils`` operation for operation so the
    tables match Hugging Face bit for bit in float32.
    """
    dim = config.dim_per_head
    base = config.rope_theta
    inv_freq = 1.0 / (
        base
        ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    factor = scaling.factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_tables(
    config: ModelConfig,
    max_seq_len: int,
    device: torch.device | str | None,
    dtype: torch.dtype,
    *,
    signed_sin: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Precomputed ``cos`` and ``sin`` tables ``[max_seq_len, head_dim]`` in ``dtype``.

    The decode step gathers rows by position instead of computing trigonometry per step; the
    values equal what Hugging Face computes per call (float32 product, then cast to the model
    dtype). With ``signed_sin`` the first half of ``sin`` is negated, which folds the sign of
    rotate-half into the table (see :func:`apply_rope_signed`).
    """
    inv_freq = rope_inv_freq(config, device)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    if signed_sin:
        sin[:, : sin.shape[-1] // 2].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the last dimension of ``x`` (the rotate-half convention of Hugging Face)."""
    return rotate(x, cos, sin, signed_sin=False)


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` with the rotate-half sign folded into ``signed_sin``: three kernels.

    Queries and keys can go through one call when they are viewed as one
    ``[B, heads + kv_heads, dim]`` tensor.
    """
    return rotate(x, cos, signed_sin, signed_sin=True)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for a fused ``[..., 2 * intermediate]`` projection output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def warm_triton_for(device: torch.device | str | None) -> None:
    """Starts importing Triton and hashing its installation in the background when a model is
    built on a GPU (:func:`graphtune.ops._triton.start_cache_key_warmup`), so both overlap the
    weights' creation instead of delaying the first kernel launch."""
    if device is not None and torch.device(device).type == "cuda":
        start_cache_key_warmup()


def random_model(
    config: ModelConfig,
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> DecoderModel:
    """Random weights for ``config``: scaled normal (never zeros), reproducible from ``seed``.

    Linear weights (routers and experts too) are ``N(0, 1/fan_in)`` so activations keep unit
    scale through the layers; norm weights are ``1 + N(0, 0.1)``; biases ``N(0, 0.02)``. Numbers
    are drawn in float32 on ``device`` (fast for 1B-parameter shapes on a GPU) and then cast.

    Args:
        config: Model shape.
        seed: Seed of the generator; the same seed and device give the same weights.
        device: Where to create the weights (default CPU).
        dtype: Weight dtype.

    Returns:
        The model, with ``source`` naming the preset and seed.

    Raises:
        ConfigError: ``device`` is unknown or not usable here (CUDA without CUDA).
    """
    device = as_torch_device(device or "cpu")
    warm_triton_for(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        return (t.mul_(std).add_(mean)).to(dtype)

    d, inter = config.hidden_size, config.intermediate_size
    qkv_out = config.q_size + 2 * config.kv_size
    experts, expert_inter = config.num_experts, config.moe_intermediate_size
    layers = []
    for index in range(config.num_layers):
        moe = config.is_moe_layer(index)
        layer = LayerWeights(
            attn_norm=normal((d,), 0.1, 1.0),
            wqkv=normal((qkv_out, d), d**-0.5),
            bqkv=normal((qkv_out,), 0.02) if config.attention_bias else None,
            wo=normal((d, config.q_size), config.q_size**-0.5),
            mlp_norm=normal((d,), 0.1, 1.0),
            w_gate_up=None if moe else normal((2 * inter, d), d**-0.5),
            w_down=None if moe else normal((d, inter), inter**-0.5),
        )
        if config.qk_norm:
            layer.q_norm = normal((config.dim_per_head,), 0.1, 1.0)
            layer.k_norm = normal((config.dim_per_head,), 0.1, 1.0)
        if config.mlp_bias and not moe:
            layer.b_gate_up = normal((2 * inter,), 0.02)
            layer.b_down = normal((d,), 0.02)
        if moe:
            layer.router = normal((experts, d), d**-0.5)
            layer.experts_gate_up = normal((experts, 2 * expert_inter, d), d**-0.5)
            layer.experts_down = normal((experts, d, expert_inter), expert_inter**-0.5)
        layers.append(layer)
    embed = normal((config.vocab_size, d), 1.0)
    lm_head = embed if config.tie_word_embeddings else normal((config.vocab_size, d), d**-0.5)
    return DecoderModel(
        config=config,
        embed=embed,
        layers=layers,
        final_norm=normal((d,), 0.1, 1.0),
        lm_head=lm_head,
        source=f"random:{config.name}:seed{seed}",
    )
