"""The ``graphtune.gemm`` op: :func:`gemm`, its config and runners, and :class:`TunableLinear`."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphtune.autotuner.calls import CallRecord
from graphtune.autotuner.config import ConstraintSpec, DynamicTensorSpec, TuningConfig
from graphtune.autotuner.context import get_tuner
from graphtune.autotuner.runner import TunableRunner
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import ConfigError, InputError, describe_tensor, wrong_device_error
from graphtune.ops._aliasing import check_written_apart, overlaps
from graphtune.ops._rows import as_rows, from_rows
from graphtune.ops._triton import triton_available
from graphtune.ops.gemm.common import TorchGemmRunner
from graphtune.ops.gemm.gemv import TritonGemvRunner
from graphtune.ops.gemm.skinny import TritonSkinnyGemmRunner
from graphtune.ops.gemm.tiled import TritonGemmRunner
from graphtune.ops.registry import is_tensor, register_op

OP_NAME = "graphtune.gemm"


@functools.lru_cache(maxsize=1)
def gemm_runners() -> tuple[TunableRunner, ...]:
    """The process-wide GEMM runners: torch first (fallback), Triton when importable.

    Order matters: ``runners[0]`` is the untuned fallback and ties in tuning go to the earlier
    runner, so the tiled Triton GEMM comes before the skinny-``M`` GEMV (which offers tactics
    only for buckets of ``M <= 2``; see :mod:`graphtune.ops.gemm.gemv`), and the swapped-operand
    tensor-core GEMM (:class:`graphtune.ops.gemm.TritonSkinnyGemmRunner`, buckets of
    ``2 <= M <= 16``, where the tiled GEMM offers none: :mod:`graphtune.ops._pruned`) comes
    last.
    """
    runners: list[TunableRunner] = [TorchGemmRunner()]
    if triton_available():
        runners += [TritonGemmRunner(), TritonGemvRunner(), TritonSkinnyGemmRunner()]
    return tuple(runners)


def _rows_of_a(shapes: Any) -> int:
    return int(shapes[0][0])


@functools.lru_cache(maxsize=64)
def gemm_config(
    max_m: int | None = None, residual: bool = False, cold_l2: bool = False
) -> TuningConfig:
    """Tuning config of the GEMM op: ``M`` (input 0, dim 0) in power-of-two buckets.

    Args:
        max_m: Largest ``M`` tuned and looked up (``None``: buckets up to the live ``M``, and a
            larger live ``M`` is a miss that falls back to cuBLAS).
        residual: Whether input 3 (the residual) is a tensor, whose rows then follow ``M``.
        cold_l2: Time with cold-L2 rotation (``TuningConfig.cold_l2``); such picks are keyed
            apart from warm-L2 ones (the key's ``timing`` ends in ``+cold_l2``).
    """
    constraints = (ConstraintSpec(3, 0, _rows_of_a),) if residual else ()
    return TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0),),
        constraint_specs=constraints,
        max_value=max_m,
        cold_l2=cold_l2,
    )


def gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    inplace: bool = False,
    out: torch.Tensor | None = None,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    runners: tuple[TunableRunner, ...] | None = None,
    cold_l2: bool = False,
) -> torch.Tensor:
    """``a @ weight.T + bias (+ residual)`` through the tuner's pick for this shape.

    Without a residual this is ``F.linear``; with one it is ``torch.addmm(residual, a,
    weight.T)`` (sum in float32, one rounding), and with ``inplace=True`` it writes into
    ``residual`` and returns it, like ``residual.addmm_(a, weight.T)``.

    Outside tuning mode this is a cache look-up (an untuned shape runs cuBLAS). Inside
    :func:`graphtune.autotune` a miss first tunes every bucket of ``M``.

    Args:
        a: ``[..., K]`` activations; leading dimensions are flattened into ``M``.
        weight: ``[N, K]``.
        bias: Optional ``[N]``.
        residual: Optional ``[..., N]`` added to the product (same leading shape as ``a``).
        inplace: Accumulate into ``residual`` (must be contiguous for the Triton runner).
        out: Write the ``[M, N]`` result here (contiguous, ``a``'s dtype; e.g. a communication
            buffer) instead of a new tensor; the return is then ``out`` itself for a 2-D ``a``,
            else ``out`` viewed as ``[..., N]``. Not with ``inplace``. The pick does not depend
            on it.
        tuner: The tuner to ask; the process default when ``None``.
        max_m: Largest tuned ``M`` (see :func:`gemm_config`).
        runners: Runners to choose from; :func:`gemm_runners` when ``None``.
        cold_l2: Tune with cold-L2 rotation (see :func:`gemm_config`), and look up the picks so
            tuned.

    Returns:
        ``[..., N]`` in ``a``'s dtype.
    """
    for name, operand in (("a", a), ("weight", weight)):
        if not isinstance(operand, torch.Tensor) or operand.dim() < 1:
            raise InputError(
                f"gemm: {name} must be a tensor with at least one dim, got "
                f"{getattr(operand, 'shape', type(operand).__name__)}."
            )
    if a.shape[-1] != weight.shape[-1]:
        raise InputError(
            f"gemm: a has K={a.shape[-1]} but weight {tuple(weight.shape)} has K="
            f"{weight.shape[-1]}; weight must be [N, K] as in nn.Linear."
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise InputError(f"gemm: bias must be [N] = [{weight.shape[0]}], got {tuple(bias.shape)}.")
    for name, operand in (("weight", weight), ("bias", bias), ("residual", residual)):
        if operand is not None and operand.dtype != a.dtype:
            raise InputError(
                f"gemm: {name} is {operand.dtype} but a is {a.dtype}; every operand takes a's "
                f"dtype (cast with .to({a.dtype}))."
            )
        if operand is not None and operand.device != a.device:
            raise wrong_device_error("gemm", "a", a.device, ((name, operand),))
    lead = a.shape[:-1]
    if residual is not None:
        rows = math.prod(lead)
        wanted = ((*lead, weight.shape[0]), (rows, weight.shape[0]))
        if tuple(residual.shape) not in wanted:
            raise InputError(
                f"gemm: residual must be a's leading shape then N, {list(wanted[0])} (or "
                f"{list(wanted[1])}), got {tuple(residual.shape)}."
            )
    a2 = as_rows(a)
    r2 = None
    if residual is not None:
        if inplace and residual.dim() > 2 and not residual.is_contiguous():
            raise InputError(
                f"gemm: a residual updated in place (inplace=True) with more than two dims must "
                f"be contiguous, got {describe_tensor(residual)}; pass it as [rows, N] or "
                "contiguous."
            )
        n = weight.shape[0]
        r2 = as_rows(residual) if residual.dim() == 2 or not inplace else residual.view(-1, n)
        if inplace:
            check_written_apart("gemm", "residual", r2, **_read_operands(a2, weight, bias))
    if out is not None:
        _check_out(out, a2, weight, inplace)
        check_written_apart("gemm", "out", out, **_read_operands(a2, weight, bias))
        if r2 is not None and overlaps(out, r2) and not _same_view(out, r2):
            raise InputError(
                "gemm: out overlaps residual without being the same [M, N] view, so one tile "
                "would overwrite residual elements another still reads; pass out=residual "
                "itself or a separate tensor."
            )
    inputs = [a2, weight, bias, r2, bool(inplace)]
    chosen = runners if runners is not None else gemm_runners()
    config = gemm_config(max_m, residual is not None, cold_l2)
    runner, tactic = (tuner or get_tuner()).choose_one(OP_NAME, chosen, config, inputs)
    result = runner.forward(inputs if out is None else [*inputs, out], tactic=tactic)
    if inplace:
        return residual
    return from_rows(out if out is not None else result, lead, weight.shape[0])


def _rebuild(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    config = gemm_config(record.config["max_value"], is_tensor(record, 3), record.config["cold_l2"])
    return gemm_runners(), config


register_op(OP_NAME, _rebuild)


def _read_operands(
    a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """What the GEMM reads while it writes its result: the bias too, since a tile may overwrite
    a bias that lies in the written tensor before another tile reads it."""
    read = {"a": a, "weight": weight}
    if bias is not None:
        read["bias"] = bias
    return read


def _same_view(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` address the same elements in the same order: ``out=`` the residual
    itself is safe, as each element is read, then written, by the same program."""
    return x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()


def _check_out(out: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, inplace: bool) -> None:
    want = (a.shape[0], weight.shape[0])
    if inplace:
        raise InputError("gemm: out= and inplace=True both say where the result goes; pass one.")
    if tuple(out.shape) != want or out.dtype != a.dtype or not out.is_contiguous():
        raise InputError(
            f"gemm: out must be a contiguous [M, N] = {list(want)} {a.dtype} tensor, got "
            f"{tuple(out.shape)} {out.dtype} (contiguous={out.is_contiguous()})."
        )


class TunableLinear(nn.Module):
    """``nn.Linear`` whose GEMM is the tuner's pick per batch bucket (inference).

    Parameters are created with ``requires_grad=False`` (an inference module). With autograd
    recording (grad enabled and a tensor that requires grad, e.g. after :meth:`from_linear` of a
    trainable layer) it runs ``F.linear``, since the Triton kernels have no backward.

    Args:
        in_features: ``K``.
        out_features: ``N``.
        bias: Whether to hold a bias.
        device: Device of the parameters.
        dtype: dtype of the parameters.
        max_m: Largest tuned ``M`` (see :func:`gemm_config`).
        tuner: Tuner to ask; the process default when ``None``.
        runners: Runners to choose from; :func:`gemm_runners` when ``None``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        max_m: int | None = None,
        tuner: AutoTuner | None = None,
        runners: tuple[TunableRunner, ...] | None = None,
    ) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ConfigError(
                f"TunableLinear({in_features}, {out_features}): features must be >= 1."
            )
        reference = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = reference.weight.requires_grad_(False)
        if reference.bias is not None:
            self.bias = reference.bias.requires_grad_(False)
        else:
            self.register_parameter("bias", None)
        self.max_m = max_m
        self.tuner = tuner
        self.runners = runners

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        max_m: int | None = None,
        tuner: AutoTuner | None = None,
        runners: tuple[TunableRunner, ...] | None = None,
    ) -> TunableLinear:
        """A TunableLinear sharing ``linear``'s parameters (no copy)."""
        module = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            max_m=max_m,
            tuner=tuner,
            runners=runners,
        )
        module.weight = linear.weight
        module.bias = linear.bias
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias``."""
        if torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in self.parameters())
        ):
            return F.linear(x, self.weight, self.bias)
        return gemm(
            x, self.weight, self.bias, tuner=self.tuner, max_m=self.max_m, runners=self.runners
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, max_m={self.max_m}"
        )
