"""The decode step's plain GEMVs: an output projection with its residual add, and a norm + linear.

* ``add_projection(x, a, weight)``: ``x += a @ weight.T`` in place (``x.addmm_(a, weight.t())``,
  the O-projection and the down projection of a layer). Runner 0
  (:class:`UnfusedAddProjection`) is ``gemm(a, weight, residual=x, inplace=True)`` with its own
  pick; :class:`TritonAddProjection` is the fused GEMV in plain mode with the residual read and
  written by the program that computes it.
* ``norm_linear(x, norm_weight, eps, weight, bias)``: ``F.linear(rms_norm(x), weight, bias)``
  (the final norm and the LM head). Runner 0 (:class:`UnfusedNormLinear`) is
  ``fused_add_rms_norm`` then ``gemm``; :class:`TritonNormLinearInLoop`, the op's Triton runner,
  applies the norm in the GEMV's main loop (``x * norm_weight`` with the stream, the row's
  ``rsqrt(mean(x^2) + eps)`` in the epilogue). :class:`TritonNormLinear`, not offered by the op
  any more, recomputes the row statistics in every program before its first product and rounds
  the normalised row to the dtype, as the unfused norm's output is.

Both kernels stream the weight with one chunk in flight ahead and, under PDL, load their first
chunk before waiting for the previous kernel (``graphtune.ops._pdl``). Buckets above 16 rows get
no fused tactics.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from graphtune.autotuner.calls import CallRecord
from graphtune.autotuner.config import ConstraintSpec, DynamicTensorSpec, TuningConfig
from graphtune.autotuner.runner import TunableRunner
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import InputError
from graphtune.ops import _pruned
from graphtune.ops._aliasing import check_written_apart
from graphtune.ops._rows import as_rows, from_rows
from graphtune.ops.fused._base import (
    NormPlacement,
    UnfusedRunner,
    resolve,
    rows_config,
    unfused_then_triton,
)
from graphtune.ops.fused_gemv import FusedTritonRunner
from graphtune.ops.fused_gemv.family import (
    PLAIN,
    GemvShape,
    fused_gemv_tactics,
    fused_supports,
    launch_fused_gemv,
    norm_weight_supported,
)
from graphtune.ops.gemm import gemm
from graphtune.ops.registry import register_op
from graphtune.ops.rmsnorm import check_eps, fused_add_rms_norm, torch_rms_norm

ADD_PROJECTION = "graphtune.add_projection"
NORM_LINEAR = "graphtune.norm_linear"


class _PlainTriton(FusedTritonRunner):
    """What both plain fused runners share: the tactic list."""

    def plain_tactics(
        self, x: torch.Tensor, weight: torch.Tensor, *, split_k: bool = True
    ) -> list[Any]:
        """See :func:`graphtune.ops.fused_gemv.family.fused_gemv_tactics`."""
        shape = GemvShape(PLAIN, x.shape[0], weight.shape[0], 1, x.shape[1], weight.element_size())
        sms = self.sm_count_for(x.device)
        return fused_gemv_tactics(shape, sm_count=sms, split_k=split_k)


# --- add_projection ---------------------------------------------------------------------------


def _unpack_add(inputs: list[Any]) -> list[Any]:
    x, a, weight = inputs
    if a.dim() != 2 or weight.dim() != 2 or a.shape[1] != weight.shape[1]:
        raise InputError(
            f"add_projection: need a [M, K] and weight [N, K], got a {tuple(a.shape)} and weight "
            f"{tuple(weight.shape)}."
        )
    if tuple(x.shape) != (a.shape[0], weight.shape[0]) or not x.is_contiguous():
        raise InputError(
            f"add_projection: x must be a contiguous [M, N] = [{a.shape[0]}, {weight.shape[0]}] "
            f"tensor (updated in place), got {tuple(x.shape)}."
        )
    return inputs


class UnfusedAddProjection(UnfusedRunner):
    """Runner 0: ``gemm(a, weight, residual=x, inplace=True)`` with its own pick."""

    def unfused(self, inputs: list[Any]) -> torch.Tensor:
        """The tunable GEMM with the residual folded in, through :attr:`tuner`."""
        x, a, weight = _unpack_add(inputs)
        return gemm(
            a,
            weight,
            residual=x,
            inplace=True,
            tuner=self.tuner,
            max_m=self.max_m,
            cold_l2=self.cold_l2,
        )


class TritonAddProjection(_PlainTriton):
    """The fused GEMV with the in-place residual add; tactic ``-1`` is ``x.addmm_``."""

    source_modules = (*_PlainTriton.source_modules, "graphtune.ops._pruned")

    def supports(self, inputs: list[Any]) -> bool:
        """Unit last strides, one float dtype, a Triton device."""
        x, a, weight = _unpack_add(inputs)
        return fused_supports(a, weight, x)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """Plain-mode tactics for ``a`` and ``weight``; none below
        :data:`graphtune.ops._pruned.ADD_PROJECTION_MIN_ROWS` rows (measured losers)."""
        if inputs[1].shape[0] < _pruned.ADD_PROJECTION_MIN_ROWS:
            return []
        return self.plain_tactics(inputs[1], inputs[2])

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """``x.addmm_(a, weight.t())``."""
        x, a, weight = _unpack_add(inputs)
        return x.addmm_(a, weight.t())

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs the fused kernel into ``x``; returns ``x``."""
        x, a, weight = _unpack_add(inputs)
        if a.shape[0] == 0:
            return x
        launch_fused_gemv(
            PLAIN, tactic, x=a, weight=weight, out=x, n=weight.shape[0], residual=x, warmup=warmup
        )
        return x


def add_projection_runners(
    *, tuner: AutoTuner | None = None, max_m: int | None = None, cold_l2: bool = False
) -> tuple[TunableRunner, ...]:
    """The runners for one tuner: unfused first (fallback), then Triton when importable."""
    return unfused_then_triton(
        tuner,
        ADD_PROJECTION,
        UnfusedAddProjection,
        lambda _tuner, _max_m: (TritonAddProjection(),),
        max_m,
        cold_l2,
    )


def _rows_of_a(shapes: Any) -> int:
    return int(shapes[1][0])


@functools.lru_cache(maxsize=16)
def add_projection_config(max_m: int | None = None, cold_l2: bool = False) -> TuningConfig:
    """Rows of ``a`` (input 1) bucketed; ``x``'s rows follow; ``cold_l2`` as for the GEMM."""
    return TuningConfig(
        dynamic_specs=(DynamicTensorSpec(1, 0),),
        constraint_specs=(ConstraintSpec(0, 0, _rows_of_a),),
        max_value=max_m,
        cold_l2=cold_l2,
    )


def add_projection(
    x: torch.Tensor,
    a: torch.Tensor,
    weight: torch.Tensor,
    *,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    runners: tuple[TunableRunner, ...] | None = None,
    cold_l2: bool = False,
) -> torch.Tensor:
    """``x += a @ weight.T`` in place (float32 sum, one rounding), through the tuner's pick.

    Args:
        x: ``[M, N]`` contiguous residual stream, updated in place.
        a: ``[M, K]`` activations.
        weight: ``[N, K]``.
        tuner: Tuner to ask; the process default when ``None``.
        max_m: Largest tuned row count (``None``: up to the live rows).
        runners: Runners to choose from; :func:`add_projection_runners` when ``None``.
        cold_l2: Tune with cold-L2 rotation (this op and the unfused GEMM), and look up the
            picks so tuned.

    Returns:
        ``x``.
    """
    check_written_apart("add_projection", "x", x, a=a, weight=weight)
    tuner = resolve(tuner)
    inputs = [x, a, weight]
    chosen = runners
    if chosen is None:
        chosen = add_projection_runners(tuner=tuner, max_m=max_m, cold_l2=cold_l2)
    config = add_projection_config(max_m, cold_l2)
    runner, tactic = tuner.choose_one(ADD_PROJECTION, chosen, config, inputs)
    runner.forward(inputs, tactic=tactic)
    return x


# --- norm_linear ------------------------------------------------------------------------------


def _unpack_norm(inputs: list[Any]) -> list[Any]:
    x, norm_weight, weight, bias, eps = inputs
    if x.dim() != 2 or norm_weight.shape != (x.shape[1],):
        raise InputError(
            f"norm_linear: need x [M, K] and norm_weight [K], got x {tuple(x.shape)} and "
            f"norm_weight {tuple(norm_weight.shape)}."
        )
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise InputError(
            f"norm_linear: weight must be [N, K={x.shape[1]}], got {tuple(weight.shape)}."
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise InputError(f"norm_linear: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}.")
    return inputs


class UnfusedNormLinear(UnfusedRunner):
    """Runner 0: ``fused_add_rms_norm`` then ``gemm``, each with its own pick."""

    def unfused(self, inputs: list[Any]) -> torch.Tensor:
        """The two tunable ops, through :attr:`tuner`."""
        x, norm_weight, weight, bias, eps = _unpack_norm(inputs)
        h, _ = fused_add_rms_norm(x, norm_weight, eps, tuner=self.tuner, max_m=self.max_m)
        return gemm(h, weight, bias, tuner=self.tuner, max_m=self.max_m, cold_l2=self.cold_l2)


class TritonNormLinear(NormPlacement, _PlainTriton):
    """The fused GEMV with the RMSNorm prologue; tactic ``-1`` is the unfused torch code."""

    def supports(self, inputs: list[Any]) -> bool:
        """Unit last strides, one float dtype (the norm weight may differ; its one dim of unit
        stride), a Triton device."""
        x, norm_weight, weight, bias, _ = _unpack_norm(inputs)
        return norm_weight_supported(norm_weight) and fused_supports(x, weight, bias)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """Plain-mode tactics for ``x`` and ``weight``."""
        return self.plain_tactics(inputs[0], inputs[2], split_k=not self.norm_in_loop)

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """``F.linear(rms_norm(x), weight, bias)``."""
        x, norm_weight, weight, bias, eps = _unpack_norm(inputs)
        return F.linear(torch_rms_norm(x, norm_weight, eps)[0], weight, bias)

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs the fused kernel; returns ``[M, N]``."""
        x, norm_weight, weight, bias, eps = _unpack_norm(inputs)
        out = torch.empty((x.shape[0], weight.shape[0]), device=x.device, dtype=x.dtype)
        if x.shape[0] == 0:
            return out
        launch_fused_gemv(
            PLAIN,
            tactic,
            x=x,
            weight=weight,
            out=out,
            n=weight.shape[0],
            norm_weight=norm_weight,
            eps=eps,
            bias=bias,
            norm_in_loop=self.norm_in_loop,
            warmup=warmup,
        )
        return out


class TritonNormLinearInLoop(TritonNormLinear):
    """The fused GEMV with the RMSNorm in its main loop (see
    :class:`graphtune.ops.fused.qkv.TritonQkvRopeNormInLoop`); tactic ``-1`` is the unfused torch
    code."""

    norm_in_loop = True
    source_modules = (*TritonNormLinear.source_modules, "graphtune.ops._pruned")

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """The plain-mode tactics; none below
        :data:`graphtune.ops._pruned.NORM_LINEAR_IN_LOOP_MIN_ROWS` rows (measured losers)."""
        if inputs[0].shape[0] < _pruned.NORM_LINEAR_IN_LOOP_MIN_ROWS:
            return []
        return super().tactics_for(inputs)


def norm_linear_runners(
    *, tuner: AutoTuner | None = None, max_m: int | None = None, cold_l2: bool = False
) -> tuple[TunableRunner, ...]:
    """The runners for one tuner: unfused first (fallback), then the fused GEMV with the norm in
    its loop when Triton is importable."""
    return unfused_then_triton(
        tuner,
        NORM_LINEAR,
        UnfusedNormLinear,
        lambda _tuner, _max_m: (TritonNormLinearInLoop(),),
        max_m,
        cold_l2,
    )


def norm_linear_config(max_m: int | None = None, cold_l2: bool = False) -> TuningConfig:
    """Rows of ``x`` bucketed (:func:`graphtune.ops.fused._base.rows_config`)."""
    return rows_config(max_m, cold_l2)


def norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    runners: tuple[TunableRunner, ...] | None = None,
    cold_l2: bool = False,
) -> torch.Tensor:
    """``F.linear(rms_norm(x, norm_weight, eps), weight, bias)`` through the tuner's pick.

    Args:
        x: ``[..., K]`` (not normalised).
        norm_weight: ``[K]``.
        eps: RMSNorm epsilon.
        weight: ``[N, K]`` (e.g. the LM head).
        bias: Optional ``[N]``.
        tuner: Tuner to ask (for this op and the unfused path's inner ops); the process default
            when ``None``.
        max_m: Largest tuned row count (``None``: up to the live rows).
        runners: Runners to choose from; :func:`norm_linear_runners` when ``None``.
        cold_l2: Tune with cold-L2 rotation (this op and the unfused GEMM), and look up the
            picks so tuned.

    Returns:
        ``[..., N]`` in ``x``'s dtype.
    """
    eps = check_eps("norm_linear", eps)
    tuner = resolve(tuner)
    lead = x.shape[:-1]
    inputs = [as_rows(x), norm_weight, weight, bias, float(eps)]
    chosen = runners
    if chosen is None:
        chosen = norm_linear_runners(tuner=tuner, max_m=max_m, cold_l2=cold_l2)
    config = norm_linear_config(max_m, cold_l2)
    runner, tactic = tuner.choose_one(NORM_LINEAR, chosen, config, inputs)
    return from_rows(runner.forward(inputs, tactic=tactic), lead, weight.shape[0])


def _rebuild_add(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    max_m, cold = record.config["max_value"], bool(record.config.get("cold_l2", False))
    runners = add_projection_runners(tuner=tuner, max_m=max_m, cold_l2=cold)
    return runners, add_projection_config(max_m, cold)


def _rebuild_norm(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    max_m, cold = record.config["max_value"], bool(record.config.get("cold_l2", False))
    return norm_linear_runners(tuner=tuner, max_m=max_m, cold_l2=cold), norm_linear_config(
        max_m, cold
    )


register_op(ADD_PROJECTION, _rebuild_add)
register_op(NORM_LINEAR, _rebuild_norm)
