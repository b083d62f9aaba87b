"""Weights and the tiny dense checkpoint shape for the transformers oracle tests
(``test_engine_hf.py``, ``test_engine_moe_hf.py``, ``test_engine_tp.py``)."""

from __future__ import annotations

import torch

# A tiny dense checkpoint (transformers config fields) whose heads and KV heads split over two
# tensor-parallel ranks.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Larger weights than transformers' init (std 0.02, norms at 1, Qwen3-MoE routers at 0), which
    gives near-uniform logits: with these, the logits and the routing depend on every layer."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.1 if "norm" in name else 0.3 if "embed" in name else param.shape[-1] ** -0.5
            base = 1.0 if "norm" in name else 0.0
            param.copy_(base + scale * torch.randn(param.shape, generator=gen))
