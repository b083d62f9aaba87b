"""Weights for transformers models in the oracle tests (``test_engine_hf.py``,
``test_engine_moe_hf.py``)."""

from __future__ import annotations

import torch


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Larger weights than transformers' init (std 0.02, norms at 1, Qwen3-MoE routers at 0), which
    gives near-uniform logits: with these, the logits and the routing depend on every layer."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.1 if "norm" in name else 0.3 if "embed" in name else param.shape[-1] ** -0.5
            base = 1.0 if "norm" in name else 0.0
            param.copy_(base + scale * torch.randn(param.shape, generator=gen))
