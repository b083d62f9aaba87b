"""Fused RMSNorm + QKV projection (+ bias) + RoPE + K/V cache write of one decode layer.

``q = norm_qkv_rope(x, norm_weight, eps, wqkv, bqkv, positions, cos, sin, k_cache, v_cache,
write_rows, num_heads=H, num_kv_heads=KV, head_norm=None)`` is, exactly, the unfused sequence

    h, _ = fused_add_rms_norm(x, norm_weight, eps)
    qkv = gemm(h, wqkv, bqkv)
    q = rope_kv_cache(qkv, positions, cos, sin, k_cache, v_cache, write_rows, ...,
                      head_norm=head_norm, head_norm_eps=eps)

which is runner 0 (:class:`UnfusedNormQkvRope`, tactic ``-1``): three tunable ops, each with its
own pick. :class:`TritonNormQkvRope` does it in one kernel (``graphtune.ops.fused_gemv._kernels``
in RoPE mode): every program recomputes the row statistics, streams the weight rows of half a
head's columns ``j`` and their partners ``HALF + j`` (so it holds both halves of the rotation),
and writes rotated q, rotated k and v where the unfused ops write them. With ``head_norm``
(Qwen3's per-head q/k RMSNorm before RoPE) its tiles hold whole heads and are split in ``K``
instead (``fused_gemv_tactics(..., whole_columns=True)``), and the epilogue normalises each q and
k head before rotating it.
:class:`TritonQkvRopeNormInLoop` applies the norm inside the kernel's main loop instead of a
prologue, and :class:`TritonQkvRopeAfterNorm` runs the tunable RMSNorm op first and the kernel
without any norm (no per-program pass over ``x`` in either). The tuner decides per batch bucket;
buckets above 16 rows get no fused tactics.

Tuning keys: as for ``rope_kv_cache``, the tables and caches are pinned to
``graphtune.ops.rope_config.TABLE_ROWS`` / ``CACHE_ROWS`` rows (more cache rows only where a
bucket writes more: ``canonical_cache_rows``), so a pick holds for any cache size. A step's
:class:`~graphtune.ops.rotary.RopeRows` (``rows=``) reaches the unfused path's ``rope_kv_cache``
as a twelfth input, outside the key, as ``rope_kv_cache`` takes it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from graphtune.autotuner.calls import CallRecord
from graphtune.autotuner.config import ConstraintSpec, DynamicTensorSpec, TuningConfig
from graphtune.autotuner.runner import TunableRunner
from graphtune.autotuner.tuner import AutoTuner
from graphtune.ops import _pruned
from graphtune.ops._triton import triton_available
from graphtune.ops.fused._base import (
    AfterNormOp,
    NormPlacement,
    UnfusedRunner,
    resolve,
    runners_for,
)
from graphtune.ops.fused._qkv_layout import QKV_INPUTS, QkvLayout
from graphtune.ops.fused_gemv import FusedTritonRunner
from graphtune.ops.fused_gemv.family import (
    ROPE,
    GemvShape,
    fused_gemv_tactics,
    fused_supports,
    launch_fused_gemv,
    norm_weight_supported,
)
from graphtune.ops.gemm import gemm
from graphtune.ops.registry import register_op, runner_extras
from graphtune.ops.rmsnorm import check_eps, fused_add_rms_norm
from graphtune.ops.rope_config import TABLE_ROWS, canonical_cache_rows, canonical_rope_indices
from graphtune.ops.rotary import RopeRows, rope_kv_cache

OP_NAME = "graphtune.norm_qkv_rope"
# Indices of the inputs, in the order of graphtune.ops.fused._qkv_layout.QKV_INPUTS.
_X, _POS, _COS, _SIN, _KC, _VC, _ROWS, _HEAD_NORM = 0, 4, 5, 6, 7, 8, 9, 11


class UnfusedNormQkvRope(QkvLayout, UnfusedRunner):
    """Runner 0: ``fused_add_rms_norm``, ``gemm`` and ``rope_kv_cache`` with their own picks."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        signed_sin: bool = False,
        *,
        tuner: AutoTuner | None = None,
        max_m: int | None = None,
        cold_l2: bool = False,
    ) -> None:
        UnfusedRunner.__init__(self, tuner, max_m, cold_l2)
        self._init_layout(num_heads, num_kv_heads, signed_sin)

    def unfused(self, inputs: list[Any]) -> torch.Tensor:
        """The three tunable ops, through :attr:`tuner` (RoPE with the step's rows if given)."""
        rope_rows = inputs[QKV_INPUTS] if len(inputs) > QKV_INPUTS else None
        x, norm_weight, wqkv, bqkv, positions, cos, sin, k_cache, v_cache, rows, eps, hn = (
            self.unpack(inputs)
        )
        tuner, max_m = self.tuner, self.max_m
        h, _ = fused_add_rms_norm(x, norm_weight, eps, tuner=tuner, max_m=max_m)
        qkv = gemm(h, wqkv, bqkv, tuner=tuner, max_m=max_m, cold_l2=self.cold_l2)
        return rope_kv_cache(
            qkv,
            positions,
            cos,
            sin,
            k_cache,
            v_cache,
            rows,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            signed_sin=self.signed_sin,
            rows=rope_rows,
            head_norm=hn,
            head_norm_eps=eps,
            tuner=tuner,
            max_m=max_m,
        )


class TritonNormQkvRope(QkvLayout, NormPlacement, FusedTritonRunner):
    """The fused kernel; tactic ``-1`` is the unfused torch code.

    Args:
        sm_count: Override the device's SM count (tests, or to tune for another GPU).
        compile_workers: Threads for ahead-of-time compilation.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        signed_sin: bool = False,
        *,
        sm_count: int | None = None,
        compile_workers: int | None = None,
    ) -> None:
        FusedTritonRunner.__init__(self, sm_count=sm_count, compile_workers=compile_workers)
        self._init_layout(num_heads, num_kv_heads, signed_sin)

    def cache_key_extras(self) -> tuple[Any, ...]:
        """The head layout, and an SM-count override (it changes the candidates)."""
        return (*QkvLayout.cache_key_extras(self), *FusedTritonRunner.cache_key_extras(self))

    def supports(self, inputs: list[Any]) -> bool:
        """Unit last strides, one float dtype (the norm weight may differ; its one dim of unit
        stride), a Triton device; a head norm's weight rows, the positions and the cache rows
        contiguous (the kernel indexes them by row alone)."""
        x, norm_weight, wqkv, bqkv, positions, cos, sin, k_cache, v_cache, rows, _, hn = (
            self.unpack(inputs)
        )
        if positions.dtype.is_floating_point or rows.dtype.is_floating_point:
            return False
        if not (positions.is_contiguous() and rows.is_contiguous()):
            return False
        if not norm_weight_supported(norm_weight):
            return False
        if hn is not None and not (hn.dtype.is_floating_point and hn.is_contiguous()):
            return False
        return fused_supports(x, wqkv, bqkv, cos, sin, k_cache, v_cache)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`graphtune.ops.fused_gemv.family.fused_gemv_tactics` (RoPE tiles; whole
        heads with a head norm)."""
        x, wqkv, cos = inputs[_X], inputs[2], inputs[_COS]
        shape = GemvShape(
            ROPE,
            x.shape[0],
            cos.shape[-1] // 2,
            self.num_heads + 2 * self.num_kv_heads,
            x.shape[1],
            wqkv.element_size(),
        )
        sms = self.sm_count_for(x.device)
        return fused_gemv_tactics(
            shape,
            sm_count=sms,
            split_k=not self.norm_in_loop,
            whole_columns=inputs[_HEAD_NORM] is not None,
        )

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """The unfused torch code."""
        return self.torch_composition(self.unpack(inputs))

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs the fused kernel; returns ``q [B, heads, D]``."""
        x, norm_weight, wqkv, bqkv, positions, cos, sin, k_cache, v_cache, rows, eps, hn = (
            self.unpack(inputs)
        )
        dim = cos.shape[-1]
        q = torch.empty((x.shape[0], self.num_heads, dim), device=x.device, dtype=x.dtype)
        if x.shape[0] == 0:
            return q
        rows_in, kernel_norm = self.kernel_rows(x, norm_weight, eps, warmup)
        rope = (positions, cos, sin, rows, k_cache, v_cache)
        launch_fused_gemv(
            ROPE,
            tactic,
            x=rows_in,
            weight=wqkv,
            out=q,
            n=0,
            norm_weight=kernel_norm,
            eps=eps,
            bias=bqkv,
            rope=(*rope, self.num_heads, self.num_kv_heads, self.signed_sin),
            norm_in_loop=self.norm_in_loop,
            head_norm=hn,
            warmup=warmup,
        )
        return q


class TritonQkvRopeNormInLoop(TritonNormQkvRope):
    """The fused kernel with the RMSNorm in its main loop: ``x * norm_weight`` streams with the
    weight and the row's ``rsqrt(mean(x^2) + eps)`` scales the sums in the epilogue, so neither a
    norm kernel nor a per-program pass over ``x`` precedes the stream. Tactic ``-1`` is the
    unfused torch code.

    Args: as :class:`TritonNormQkvRope`.
    """

    norm_in_loop = True


class TritonQkvRopeAfterNorm(AfterNormOp, TritonNormQkvRope):
    """The tunable RMSNorm op, then the fused kernel without a norm (see
    :class:`~graphtune.ops.fused._base.AfterNormOp`): QKV projection, RoPE and the K/V write stay
    one pass over the weight. Tactic ``-1`` is the unfused torch code.

    Args:
        num_heads, num_kv_heads, signed_sin: The head layout.
        tuner: The tuner the RMSNorm op asks (weakly held; ``None``: the process default).
        max_m: ``max_m`` passed to the RMSNorm op.
        sm_count, compile_workers: As for :class:`TritonNormQkvRope`.
    """

    source_modules = (*TritonNormQkvRope.source_modules, "graphtune.ops._pruned")

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        signed_sin: bool = False,
        *,
        tuner: AutoTuner | None = None,
        max_m: int | None = None,
        sm_count: int | None = None,
        compile_workers: int | None = None,
    ) -> None:
        TritonNormQkvRope.__init__(
            self,
            num_heads,
            num_kv_heads,
            signed_sin,
            sm_count=sm_count,
            compile_workers=compile_workers,
        )
        self._hold_tuner(tuner, max_m, False)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """The fused kernel's tactics; none below
        :data:`graphtune.ops._pruned.QKV_AFTER_NORM_MIN_ROWS` rows (measured losers)."""
        if inputs[_X].shape[0] < _pruned.QKV_AFTER_NORM_MIN_ROWS:
            return []
        return super().tactics_for(inputs)


def norm_qkv_rope_runners(
    num_heads: int,
    num_kv_heads: int,
    signed_sin: bool = False,
    *,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    cold_l2: bool = False,
) -> tuple[TunableRunner, ...]:
    """The runners for one head layout and tuner: unfused first (fallback), then the fused
    kernel with the norm in its loop and after the RMSNorm op. (The prologue form,
    :class:`TritonNormQkvRope`, is not offered: no step measured it faster than these.)"""
    tuner = resolve(tuner)

    def build() -> tuple[TunableRunner, ...]:
        first = UnfusedNormQkvRope(
            num_heads, num_kv_heads, signed_sin, tuner=tuner, max_m=max_m, cold_l2=cold_l2
        )
        if not triton_available():
            return (first,)
        in_loop = TritonQkvRopeNormInLoop(num_heads, num_kv_heads, signed_sin)
        after_norm = TritonQkvRopeAfterNorm(
            num_heads, num_kv_heads, signed_sin, tuner=tuner, max_m=max_m
        )
        return (first, in_loop, after_norm)

    key = (OP_NAME, num_heads, num_kv_heads, signed_sin, max_m, cold_l2)
    return runners_for(tuner, key, build)


def _canonical_inputs(inputs: list[Any]) -> list[Any]:
    out = list(inputs)
    out[_POS], out[_ROWS] = canonical_rope_indices(
        inputs[_POS], inputs[_ROWS], inputs[_COS].shape[0], inputs[_KC].shape[0]
    )
    return out


@functools.lru_cache(maxsize=16)
def norm_qkv_rope_config(
    num_kv_heads: int, max_m: int | None = None, cold_l2: bool = False
) -> TuningConfig:
    """Rows of ``x`` bucketed; positions and write rows follow; tables and caches pinned;
    ``cold_l2`` as for the GEMM."""

    def batch(shapes: Any) -> int:
        return int(shapes[_X][0])

    def rows(shapes: Any) -> int:
        return int(shapes[_X][0]) * num_kv_heads

    def table(shapes: Any) -> int:
        return TABLE_ROWS

    def cache(shapes: Any) -> int:
        return canonical_cache_rows(rows(shapes))

    return TuningConfig(
        dynamic_specs=(DynamicTensorSpec(_X, 0),),
        constraint_specs=(
            ConstraintSpec(_POS, 0, batch),
            ConstraintSpec(_COS, 0, table),
            ConstraintSpec(_SIN, 0, table),
            ConstraintSpec(_KC, 0, cache),
            ConstraintSpec(_VC, 0, cache),
            ConstraintSpec(_ROWS, 0, rows),
        ),
        max_value=max_m,
        inputs_pre_hook=_canonical_inputs,
        cold_l2=cold_l2,
    )


def norm_qkv_rope(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    wqkv: torch.Tensor,
    bqkv: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_rows: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    signed_sin: bool = False,
    head_norm: torch.Tensor | None = None,
    rows: RopeRows | None = None,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    runners: tuple[TunableRunner, ...] | None = None,
    cold_l2: bool = False,
) -> torch.Tensor:
    """RMSNorm, QKV projection, RoPE and the K/V cache write of one token per row.

    Args:
        x: ``[B, hidden]`` residual stream (not normalised).
        norm_weight: ``[hidden]`` the layer's attention-norm weight.
        eps: RMSNorm epsilon.
        wqkv: ``[(num_heads + 2 * num_kv_heads) * D, hidden]`` fused projection weight.
        bqkv: Optional ``[(num_heads + 2 * num_kv_heads) * D]`` bias (Qwen2).
        positions, cos, sin, k_cache, v_cache, write_rows: As for
            :func:`graphtune.ops.rotary.rope_kv_cache`.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        signed_sin: ``sin``'s first half holds ``-sin`` (the engine's tables).
        head_norm: ``[num_heads + num_kv_heads, D]`` weight rows of a per-head RMSNorm of q and k
            between the projection and RoPE, with ``eps`` (Qwen3's q/k norm,
            :func:`graphtune.ops.rmsnorm.head_norm_weights`); ``None``: none.
        rows: The step's :class:`~graphtune.ops.rotary.RopeRows` of ``positions``: the unfused
            path's RoPE reuses its gathered rows (not part of the tuning key).
        tuner: Tuner to ask (for this op and, in the unfused path, for the inner ops); the
            process default when ``None``.
        max_m: Largest tuned batch (``None``: up to the live batch).
        runners: Runners to choose from; :func:`norm_qkv_rope_runners` when ``None``.
        cold_l2: Tune with cold-L2 rotation (this op and the unfused GEMM), and look up the
            picks so tuned.

    Returns:
        ``q`` rotated, ``[B, num_heads, D]``; k (rotated) and v are written to the caches.
    """
    eps = check_eps("norm_qkv_rope", eps)
    tuner = resolve(tuner)
    inputs = [x, norm_weight, wqkv, bqkv, positions, cos, sin, k_cache, v_cache, write_rows]
    inputs += [float(eps), head_norm]
    chosen = runners
    if chosen is None:
        chosen = norm_qkv_rope_runners(
            num_heads, num_kv_heads, signed_sin, tuner=tuner, max_m=max_m, cold_l2=cold_l2
        )
    config = norm_qkv_rope_config(num_kv_heads, max_m, cold_l2)
    runner, tactic = tuner.choose_one(OP_NAME, chosen, config, inputs)
    return runner.forward(inputs if rows is None else [*inputs, rows], tactic=tactic)


def _rebuild(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    heads, kv_heads, signed_sin = runner_extras(record.runners[0])
    max_m, cold = record.config["max_value"], bool(record.config.get("cold_l2", False))
    runners = norm_qkv_rope_runners(
        int(heads), int(kv_heads), bool(signed_sin), tuner=tuner, max_m=max_m, cold_l2=cold
    )
    return runners, norm_qkv_rope_config(int(kv_heads), max_m, cold)


register_op(OP_NAME, _rebuild)
