"""The head layout the ``norm_qkv_rope`` runners share: their identity, the op's input checks
and its unfused torch code (:mod:`graphtune.ops.fused.qkv` builds the runners on it)."""

from __future__ import annotations

from typing import Any

import torch

from graphtune.errors import ConfigError, InputError, wrong_device_error
from graphtune.ops._rope_inputs import check_rope_operands
from graphtune.ops.rmsnorm import torch_rms_norm
from graphtune.ops.rotary import torch_rope_kv_cache

# Input order: x, norm_weight, wqkv, bqkv, positions, cos, sin, k_cache, v_cache, write_rows, eps,
# head_norm (and, for the unfused runner only, the step's RopeRows as a thirteenth input).
QKV_INPUTS = 12
_WEIGHTS = ("norm_weight", "wqkv", "bqkv", "head_norm")


class QkvLayout:
    """Head layout shared by both runners (part of their identity)."""

    num_heads: int
    num_kv_heads: int
    signed_sin: bool

    def _init_layout(self, num_heads: int, num_kv_heads: int, signed_sin: bool) -> None:
        for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"norm_qkv_rope: {name} must be an int >= 1, got {value!r}.")
        self.num_heads, self.num_kv_heads, self.signed_sin = num_heads, num_kv_heads, signed_sin

    def cache_key_extras(self) -> tuple[Any, ...]:
        """Head counts are not implied by the weight's shape."""
        return (self.num_heads, self.num_kv_heads, self.signed_sin)

    def unpack(self, inputs: list[Any]) -> list[Any]:
        """Checks the inputs' shapes, and the RoPE operands' dtypes and devices as
        ``rope_kv_cache`` does (metadata only: it runs inside CUDA graph capture); returns the
        twelve op inputs (without a ``RopeRows``).

        Raises:
            InputError: An input the kernel would read or write out of bounds with.
        """
        inputs = inputs[:QKV_INPUTS]
        if len(inputs) != QKV_INPUTS:
            raise InputError(
                f"norm_qkv_rope: a runner takes {QKV_INPUTS} inputs (x, norm_weight, wqkv, bqkv, "
                "positions, cos, sin, k_cache, v_cache, write_rows, eps, head_norm), got "
                f"{len(inputs)}; pass head_norm=None when the model has no q/k norm."
            )
        x, norm_weight, wqkv, bqkv, _, cos, *_, head_norm = inputs
        dim = cos.shape[-1]
        rows = (self.num_heads + 2 * self.num_kv_heads) * dim
        if x.dim() != 2 or norm_weight.shape != (x.shape[1],) or dim % 2:
            raise InputError(
                f"norm_qkv_rope: need x [B, hidden], norm_weight [hidden] and an even head_dim, "
                f"got x {tuple(x.shape)}, norm_weight {tuple(norm_weight.shape)}, D={dim}."
            )
        if tuple(wqkv.shape) != (rows, x.shape[1]) or (bqkv is not None and bqkv.shape != (rows,)):
            raise InputError(
                f"norm_qkv_rope: wqkv must be [(heads + 2 * kv_heads) * D, hidden] = "
                f"[{rows}, {x.shape[1]}] (bqkv [{rows}]) for {self.num_heads}/{self.num_kv_heads} "
                f"heads, got {tuple(wqkv.shape)}."
            )
        # The kernel indexes the caches and tables by these alone: rope_kv_cache's checks.
        check_rope_operands("norm_qkv_rope", "x", x, inputs[4:10], self.num_kv_heads)
        if (
            norm_weight.device != x.device
            or wqkv.device != x.device
            or (bqkv is not None and bqkv.device != x.device)
            or (head_norm is not None and head_norm.device != x.device)
        ):
            named = zip(_WEIGHTS, (norm_weight, wqkv, bqkv, head_norm), strict=True)
            raise wrong_device_error("norm_qkv_rope", "x", x.device, named)
        heads = (self.num_heads + self.num_kv_heads, dim)
        if head_norm is not None and tuple(head_norm.shape) != heads:
            raise InputError(
                f"norm_qkv_rope: head_norm must be [heads + kv_heads, D] = {list(heads)} (the "
                f"q heads' norm weight rows, then the k heads'), got {tuple(head_norm.shape)}."
            )
        return inputs

    def torch_composition(self, inputs: list[Any]) -> torch.Tensor:
        """The unfused torch code (no tuner): ``rms_norm``, ``F.linear``, RoPE + cache write."""
        x, norm_weight, wqkv, bqkv, positions, cos, sin, k_cache, v_cache, rows, eps, hn = inputs
        h, _ = torch_rms_norm(x, norm_weight, eps)
        qkv = torch.nn.functional.linear(h, wqkv, bqkv)
        return torch_rope_kv_cache(
            qkv,
            positions,
            cos,
            sin,
            k_cache,
            v_cache,
            rows,
            self.num_heads,
            self.num_kv_heads,
            self.signed_sin,
            head_norm=hn,
            head_norm_eps=eps,
        )
