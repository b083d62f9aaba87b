"""Tunable fused RMSNorm with an optional residual add.

``out, new_residual = fused_add_rms_norm(x, weight, eps, residual)`` computes, per row,

    new_residual = x + residual            (rounded to the dtype, as ``x = x + ...`` in torch)
    out = to_dtype(s * rsqrt(mean(s^2) + eps) * weight),  s = float32(new_residual)

which is ``engine.model.rms_norm(x + residual, weight, eps)`` (``F.rms_norm``: float32 statistics
and weight product, one rounding) in one kernel instead of two or more. Without a residual,
``new_residual`` is ``x`` itself. The unfused torch code is the fallback tactic ``-1``; Triton
tactics are ``{"block", "warps"}``: a block at least as wide as the row normalises in one pass, a
narrower block walks the row twice.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from graphtune.autotuner.calls import CallRecord
from graphtune.autotuner.config import ConstraintSpec, DynamicTensorSpec, TuningConfig
from graphtune.autotuner.config import next_power_of_two as _np2
from graphtune.autotuner.context import get_tuner
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import ConfigError, InputError, describe_tensor, wrong_device_error
from graphtune.finite_json import brief, finite_float
from graphtune.ops import _pruned
from graphtune.ops._rows import as_rows, from_rows
from graphtune.ops._triton import (
    KERNELS_SOURCES,
    MIN_ELEMENTWISE_BLOCK,
    check_block_tactic,
    device_supported,
    elementwise_tactics,
    kernels,
    run_kernel,
    triton_available,
)
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.registry import is_tensor, register_op

OP_NAME = "graphtune.rms_norm"
MAX_ONE_PASS_BLOCK = 16384  # wider rows use the two-pass loop (register pressure)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused reference: a residual add, then ``engine.model.rms_norm`` (``F.rms_norm``)."""
    s = x + residual if residual is not None else x
    if hasattr(F, "rms_norm"):  # torch >= 2.4
        return F.rms_norm(s, (s.shape[-1],), weight, eps), s
    # F.rms_norm's composite: float32 statistics and weight product, one rounding at the end.
    xf = s.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight
    return out.to(s.dtype), s


def _unpack(inputs: list[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
    x, weight, residual, eps = inputs
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise InputError(
            f"rms_norm needs x [M, H] and weight [H], got x {tuple(x.shape)} and weight "
            f"{tuple(weight.shape)}; fused_add_rms_norm() flattens leading dims."
        )
    if not x.dtype.is_floating_point:
        raise InputError(f"rms_norm needs a float x, got {x.dtype}.")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise InputError(
            f"rms_norm residual must have x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
            f"{tuple(residual.shape)} {residual.dtype}; cast it with .to(x.dtype)."
        )
    device = x.device
    if weight.device != device or (residual is not None and residual.device != device):
        raise wrong_device_error(
            "rms_norm", "x", device, (("weight", weight), ("residual", residual))
        )
    return x, weight, residual, float(eps)


def check_eps(op: str, eps: Any) -> float:
    """``eps`` of a norm as a float: a finite number >= 0 (a NaN makes every output NaN, an
    infinity every output 0).

    Raises:
        ConfigError: Anything else; the message names ``op``.
    """
    if not (finite_float(eps) and eps >= 0):  # an int beyond a float's range is no float
        raise ConfigError(
            f"{op}: eps must be a finite float >= 0 such as 1e-6, got {brief(eps)}; "
            "check the argument order."
        )
    return float(eps)


def rms_norm_tactics(hidden: int) -> list[dict[str, int]]:
    """Block/warp tactics for rows of ``hidden`` elements.

    Blocks: the whole row (one pass) when it fits :data:`MAX_ONE_PASS_BLOCK`, and one or two
    narrower power-of-two blocks (two passes, fewer registers) when the row is longer than
    :data:`graphtune.ops._pruned.RMS_NORM_ONE_PASS_UP_TO` (measured losers up to there).
    """
    full = max(_np2(hidden), MIN_ELEMENTWISE_BLOCK)  # rows of a few elements: one small block
    blocks = [full] if full <= MAX_ONE_PASS_BLOCK else []
    if hidden > _pruned.RMS_NORM_ONE_PASS_UP_TO or not blocks:
        blocks += [b for b in (full // 2, full // 4) if b >= 512 and b < full]
    if not blocks:
        blocks = [MAX_ONE_PASS_BLOCK]
    return elementwise_tactics(sorted(set(blocks), reverse=True), per_thread=(2, 16))


class TorchRMSNormRunner(TunableRunner):
    """The unfused torch code (``engine.model.rms_norm`` after a residual add)."""

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC, **kwargs: Any) -> Any:
        """Returns ``(out, new_residual)``."""
        x, weight, residual, eps = _unpack(inputs)
        return torch_rms_norm(x, weight, eps, residual)


class TritonRMSNormRunner(TritonRunner):
    """Fused residual add + RMSNorm in one Triton kernel (one program per row)."""

    source_modules = (*KERNELS_SOURCES, "graphtune.ops._pruned")

    def supports(self, inputs: list[Any]) -> bool:
        """Float16/bfloat16/float32 rows with a unit last stride, on a Triton device."""
        x, weight, residual, _ = _unpack(inputs)
        if x.dtype not in _DTYPES or weight.dtype not in _DTYPES or x.stride(-1) != 1:
            return False
        if residual is not None and (residual.dtype != x.dtype or residual.stride(-1) != 1):
            return False
        return device_supported(x.device)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`rms_norm_tactics`."""
        return list(rms_norm_tactics(inputs[0].shape[1]))

    def torch_forward(self, inputs: list[Any]) -> Any:
        """The unfused torch code."""
        x, weight, residual, eps = _unpack(inputs)
        return torch_rms_norm(x, weight, eps, residual)

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> Any:
        """Runs the fused kernel; returns ``(out, new_residual)``."""
        x, weight, residual, eps = _unpack(inputs)
        check_block_tactic("TritonRMSNormRunner", tactic)
        rows, hidden = x.shape
        out = torch.empty_like(x)
        res_out = torch.empty_like(x) if residual is not None else x
        if rows == 0:
            return out, res_out
        block = tactic["block"]
        args = (
            x,
            residual if residual is not None else x,
            weight.contiguous(),
            out,
            res_out,
            hidden,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            res_out.stride(0),
            eps,
        )
        meta = dict(
            HAS_RES=residual is not None,
            BLOCK=block,
            ONE_PASS=block >= hidden,
            num_warps=tactic["warps"],
        )
        run_kernel(kernels().rms_norm_kernel, (rows,), args, meta, warmup)
        return out, res_out


@functools.lru_cache(maxsize=1)
def rms_norm_runners() -> tuple[TunableRunner, ...]:
    """The process-wide runners: torch first (fallback), Triton when importable."""
    runners: list[TunableRunner] = [TorchRMSNormRunner()]
    if triton_available():
        runners.append(TritonRMSNormRunner())
    return tuple(runners)


def _rows_of_x(shapes: Any) -> int:
    return int(shapes[0][0])


@functools.lru_cache(maxsize=64)
def rms_norm_config(max_m: int | None = None, residual: bool = False) -> TuningConfig:
    """Tuning config: rows of ``x`` (input 0) bucketed; the residual's rows follow ``x``."""
    constraints = (ConstraintSpec(2, 0, _rows_of_x),) if residual else ()
    return TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0),),
        constraint_specs=constraints,
        max_value=max_m,
    )


def _rebuild(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    return rms_norm_runners(), rms_norm_config(record.config["max_value"], is_tensor(record, 2))


register_op(OP_NAME, _rebuild)


def fused_add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    runners: tuple[TunableRunner, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(x + residual)`` and ``x + residual`` through the tuner's pick.

    Args:
        x: ``[..., H]``.
        weight: ``[H]`` norm weight.
        eps: Added to the mean square.
        residual: Optional ``[..., H]`` added to ``x`` first (same shape and dtype).
        tuner: Tuner to ask; the process default when ``None``.
        max_m: Largest tuned row count (``None``: up to the live rows).
        runners: Runners to choose from; :func:`rms_norm_runners` when ``None``.

    Returns:
        ``(out, new_residual)``, both shaped and typed like ``x``; ``new_residual`` is ``x``
        itself when ``residual`` is ``None``.

    Raises:
        InputError: ``x`` is 0-d or ``residual`` is not of ``x``'s shape.
    """
    eps = check_eps("fused_add_rms_norm", eps)
    shape = x.shape
    if not shape:  # as_rows needs a last dim
        raise InputError(
            f"fused_add_rms_norm: x must be [..., H] with at least one dim, got "
            f"{describe_tensor(x)}; normalise a 1-D [H] row at least."
        )
    if residual is not None and getattr(residual, "shape", None) != shape:
        # as_rows would take any residual of x's numel, added in another element order.
        raise InputError(
            f"fused_add_rms_norm: residual must have x's shape {tuple(shape)}, got "
            f"{describe_tensor(residual)}."
        )
    x2 = as_rows(x)
    r2 = as_rows(residual) if residual is not None else None
    inputs = [x2, weight, r2, eps]
    chosen = runners if runners is not None else rms_norm_runners()
    config = rms_norm_config(max_m, residual is not None)
    runner, tactic = (tuner or get_tuner()).choose_one(OP_NAME, chosen, config, inputs)
    out, new_residual = runner.forward(inputs, tactic=tactic)
    lead, hidden = shape[:-1], shape[-1]
    if residual is None:
        return from_rows(out, lead, hidden), x
    return from_rows(out, lead, hidden), from_rows(new_residual, lead, hidden)


def head_norm_weights(
    q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int, num_kv_heads: int
) -> torch.Tensor:
    """``[heads + kv_heads, D]``: ``q_weight`` for every query head, then ``k_weight`` for every
    key head; the rows :func:`head_rms_norm_` scales by (build them once per model, not per step).

    Raises:
        InputError: A weight is not ``[D]`` or the two differ in shape.
    """
    dim = q_weight.shape[0] if q_weight.dim() == 1 else -1
    if dim < 1 or q_weight.shape != (dim,) or k_weight.shape != (dim,):
        raise InputError(
            f"head_norm_weights needs q and k weights [D] of one D; got {tuple(q_weight.shape)} "
            f"and {tuple(k_weight.shape)} (the checkpoint's q_norm / k_norm weights)."
        )
    return torch.cat([q_weight.expand(num_heads, -1), k_weight.expand(num_kv_heads, -1)])


def _qk_heads(qkv: torch.Tensor, weights: torch.Tensor, name: str) -> torch.Tensor:
    """The ``[rows, heads + kv_heads, D]`` view of ``qkv``'s query and key heads."""
    heads, dim = weights.shape if weights.dim() == 2 else (0, 0)
    # qkv holds heads + kv_heads query/key heads and kv_heads value heads of D features each:
    # kv_heads is what the width leaves after the weight rows, and the query heads a multiple.
    # (D = 0 or a qkv that is not 2-D fails here, before a division by D or a missing dim.)
    kv_heads = qkv.shape[1] // dim - heads if dim and qkv.dim() == 2 else 0
    layout_ok = (
        kv_heads > 0
        and qkv.shape[1] % dim == 0
        and 1 <= kv_heads < heads
        and (heads - kv_heads) % kv_heads == 0
    )
    if not layout_ok or qkv.stride(1) != 1:
        raise InputError(
            f"{name} needs qkv [rows, (heads + 2 kv_heads) * D] with contiguous rows and "
            f"weights [heads + kv_heads, D]; got qkv {tuple(qkv.shape)} (strides "
            f"{qkv.stride()}) and weights {tuple(weights.shape)}."
        )
    if weights.device != qkv.device:
        raise wrong_device_error(name, "qkv", qkv.device, (("weights", weights),))
    return qkv[:, : heads * dim].unflatten(-1, (heads, dim))


def head_rms_norm(qkv: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`head_rms_norm_` out of place: returns the normalised query and key heads as a new
    ``[rows, heads + kv_heads, D]`` tensor of ``qkv``'s dtype and leaves ``qkv`` as it is (same
    two torch ops, same roundings).

    Raises:
        InputError, ConfigError: As :func:`head_rms_norm_`.
    """
    eps = check_eps("head_rms_norm", eps)
    qk = _qk_heads(qkv, weights, "head_rms_norm")
    out = torch.mul(F.rms_norm(qk, (weights.shape[1],), eps=eps), weights)
    # Weights of a wider dtype promote the product; the in-place form rounds it to qkv's dtype
    # when it writes back, so round here too (compared first: even a no-op .to() dispatches).
    return out if out.dtype == qkv.dtype else out.to(qkv.dtype)


def head_rms_norm_(qkv: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of the queries and keys of a fused QKV output, in place (Qwen3's and
    Qwen3-MoE's ``q_norm`` / ``k_norm``, applied before RoPE); the value heads are untouched.

    ``qkv`` is ``[rows, (H + 2 KV) * D]`` with the query heads, then the key heads, then the value
    heads; ``weights`` is ``[H + KV, D]`` (:func:`head_norm_weights`). Every query and key head is
    normalised over its ``D`` features with float32 statistics, rounded to the dtype and then
    multiplied by its weight row in the dtype: the order of transformers' ``Qwen3RMSNorm``. The
    query and key heads are adjacent, so this is two torch ops (the norm, the scaled write back)
    and no host synchronisation.

    Returns:
        ``qkv`` itself.

    Raises:
        InputError: ``qkv`` is not 2-D or narrower than the heads ``weights`` describes, its
            rows are not contiguous, or ``weights`` is on another device.
        ConfigError: ``eps`` is not a finite number >= 0 (:func:`check_eps`).
    """
    eps = check_eps("head_rms_norm_", eps)
    qk = _qk_heads(qkv, weights, "head_rms_norm_")
    torch.mul(F.rms_norm(qk, (weights.shape[1],), eps=eps), weights, out=qk)
    return qkv
