"""Fused RMSNorm + gate/up projection + SiLU-and-mul of one decode layer's MLP.

``act = norm_gate_up_silu(x, norm_weight, eps, w_gate_up)`` is, exactly, the unfused sequence

    h, _ = fused_add_rms_norm(x, norm_weight, eps)
    act = silu_and_mul(gemm(h, w_gate_up))

which is runner 0 (:class:`UnfusedNormGateUpSilu`, tactic ``-1``). :class:`TritonNormGateUpSilu`
runs ``graphtune.ops.fused_gemv._kernels`` in SiLU mode: a program streams gate rows ``j`` and
the matching up rows ``I + j`` (``w_gate_up`` is ``[gate | up]``, ``engine.model.swiglu``'s
order), so the ``[B, 2 * I]`` intermediate is never written. :class:`TritonGateUpSiluNormInLoop`
applies the norm inside the kernel's main loop instead of a prologue, and
:class:`TritonGateUpSiluAfterNorm` runs the tunable RMSNorm op first and the kernel without any
norm (the SiLU-and-mul stays in the GEMV's epilogue); only the last is offered
(:func:`norm_gate_up_silu_runners`), up to 16 rows. Above :data:`TILED_ABOVE_M` rows
:class:`TritonGateUpSiluTiled` runs the RMSNorm op and the tiled GEMM with gate and up columns in
one tile and SiLU-and-mul in its epilogue.
"""

from __future__ import annotations

from typing import Any

import torch

from graphtune.autotuner.calls import CallRecord
from graphtune.autotuner.config import TuningConfig
from graphtune.autotuner.runner import TunableRunner
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import ConfigError, InputError
from graphtune.ops._rows import as_rows, from_rows
from graphtune.ops._triton import KERNELS_SOURCES, device_limits
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.activation import silu_and_mul, torch_silu_and_mul
from graphtune.ops.fused._base import (
    AfterNormOp,
    NormPlacement,
    UnfusedRunner,
    resolve,
    rows_config,
    unfused_then_triton,
)
from graphtune.ops.fused_gemv import FusedTritonRunner
from graphtune.ops.fused_gemv.family import (
    SILU,
    GemvShape,
    fused_gemv_tactics,
    fused_supports,
    launch_fused_gemv,
    norm_weight_supported,
)
from graphtune.ops.gemm import gemm
from graphtune.ops.gemm.tiled import check_gemm_tactic, gemm_tactics, launch_tiled_gemm
from graphtune.ops.registry import register_op
from graphtune.ops.rmsnorm import check_eps, fused_add_rms_norm, torch_rms_norm

TILED_ABOVE_M = 32
"""Rows above which :class:`TritonGateUpSiluTiled` is offered. At 32 rows of the Llama-1B shape
on the H200 it won alone, but the served step ran 2.7 to 4.4% slower with it in all three A/Bs
that measured it, and the whole-step check (``graphtune.engine.tuning.check_fusion``) saw that
in one process and the opposite in another, so it cannot be left to decide there; at 64 and 128
rows the step ran faster with it (benchmarks/results/README.md, "The tiled gate/up + SiLU kernel
from 64 rows")."""

OP_NAME = "graphtune.norm_gate_up_silu"


def _unpack(inputs: list[Any]) -> list[Any]:
    x, norm_weight, w_gate_up, eps = inputs
    if x.dim() != 2 or norm_weight.shape != (x.shape[1],):
        raise InputError(
            f"norm_gate_up_silu: need x [B, hidden] and norm_weight [hidden], got x "
            f"{tuple(x.shape)} and norm_weight {tuple(norm_weight.shape)}."
        )
    if w_gate_up.dim() != 2 or w_gate_up.shape[1] != x.shape[1] or w_gate_up.shape[0] % 2:
        raise InputError(
            f"norm_gate_up_silu: w_gate_up must be [2 * I, hidden={x.shape[1]}] (gate rows "
            f"first), got {tuple(w_gate_up.shape)}."
        )
    return inputs


def torch_norm_gate_up_silu(inputs: list[Any]) -> torch.Tensor:
    """The unfused torch code (no tuner): ``rms_norm``, ``F.linear``, ``swiglu``."""
    x, norm_weight, w_gate_up, eps = _unpack(inputs)
    h, _ = torch_rms_norm(x, norm_weight, eps)
    return torch_silu_and_mul(torch.nn.functional.linear(h, w_gate_up))


class UnfusedNormGateUpSilu(UnfusedRunner):
    """Runner 0: ``fused_add_rms_norm``, ``gemm`` and ``silu_and_mul`` with their own picks."""

    def unfused(self, inputs: list[Any]) -> torch.Tensor:
        """The three tunable ops, through :attr:`tuner`."""
        x, norm_weight, w_gate_up, eps = _unpack(inputs)
        tuner, max_m = self.tuner, self.max_m
        h, _ = fused_add_rms_norm(x, norm_weight, eps, tuner=tuner, max_m=max_m)
        gate_up = gemm(h, w_gate_up, tuner=tuner, max_m=max_m, cold_l2=self.cold_l2)
        return silu_and_mul(gate_up, tuner=tuner, max_m=max_m)


class TritonNormGateUpSilu(NormPlacement, FusedTritonRunner):
    """The fused kernel; tactic ``-1`` is the unfused torch code.

    Args: as :class:`~graphtune.ops.fused_gemv.FusedTritonRunner`.
    """

    def supports(self, inputs: list[Any]) -> bool:
        """Unit last strides, one float dtype (the norm weight may differ; its one dim of unit
        stride), a Triton device."""
        x, norm_weight, w_gate_up, _ = _unpack(inputs)
        return norm_weight_supported(norm_weight) and fused_supports(x, w_gate_up)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`graphtune.ops.fused_gemv.family.fused_gemv_tactics` (column pairs)."""
        x, _, w_gate_up, _ = inputs
        inter = w_gate_up.shape[0] // 2
        shape = GemvShape(SILU, x.shape[0], inter, 1, x.shape[1], w_gate_up.element_size())
        sms = self.sm_count_for(x.device)
        return fused_gemv_tactics(shape, sm_count=sms, split_k=not self.norm_in_loop)

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """The unfused torch code."""
        return torch_norm_gate_up_silu(inputs)

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs the fused kernel; returns ``[B, I]``."""
        x, norm_weight, w_gate_up, eps = _unpack(inputs)
        inter = w_gate_up.shape[0] // 2
        out = torch.empty((x.shape[0], inter), device=x.device, dtype=x.dtype)
        if x.shape[0] == 0 or inter == 0:
            return out
        rows_in, kernel_norm = self.kernel_rows(x, norm_weight, eps, warmup)
        launch_fused_gemv(
            SILU,
            tactic,
            x=rows_in,
            weight=w_gate_up,
            out=out,
            n=inter,
            norm_weight=kernel_norm,
            eps=eps,
            norm_in_loop=self.norm_in_loop,
            warmup=warmup,
        )
        return out


class TritonGateUpSiluNormInLoop(TritonNormGateUpSilu):
    """The fused kernel with the RMSNorm in its main loop (see
    :class:`graphtune.ops.fused.qkv.TritonQkvRopeNormInLoop`). Tactic ``-1`` is the unfused
    torch code.

    Args: as :class:`TritonNormGateUpSilu`.
    """

    norm_in_loop = True


class TritonGateUpSiluAfterNorm(AfterNormOp, TritonNormGateUpSilu):
    """The tunable RMSNorm op, then the fused kernel without a norm (see
    :class:`~graphtune.ops.fused._base.AfterNormOp`); SiLU-and-mul stays in the GEMV's epilogue
    (no ``[B, 2 * I]`` intermediate, no SiLU kernel). Tactic ``-1`` is the unfused torch code.

    Args:
        tuner: The tuner the RMSNorm op asks (weakly held; ``None``: the process default).
        max_m: ``max_m`` passed to the RMSNorm op.
        sm_count, compile_workers: As for :class:`TritonNormGateUpSilu`.
    """

    def __init__(
        self,
        *,
        tuner: AutoTuner | None = None,
        max_m: int | None = None,
        sm_count: int | None = None,
        compile_workers: int | None = None,
    ) -> None:
        TritonNormGateUpSilu.__init__(self, sm_count=sm_count, compile_workers=compile_workers)
        self._hold_tuner(tuner, max_m, False)


class TritonGateUpSiluTiled(AfterNormOp, TritonRunner):
    """Above 32 rows: the tunable RMSNorm op, then the tiled Triton GEMM with each tile's gate
    and up columns side by side and SiLU-and-mul in its epilogue (``gemm_kernel``'s
    ``SILU_PAIRS``), so neither the ``[B, 2 * I]`` intermediate nor the SiLU kernel exists.
    Tactics are the tiled GEMM's one-split tactics whose three pipelined tiles (``a``, gate,
    up) fit the shared memory; none up to :data:`TILED_ABOVE_M` rows. Tactic ``-1`` is the
    unfused torch code.

    Args:
        tuner: The tuner the RMSNorm op asks (weakly held; ``None``: the process default).
        max_m: ``max_m`` passed to the RMSNorm op.
        compile_workers: Threads for ahead-of-time compilation.
    """

    source_modules = (*KERNELS_SOURCES, "graphtune.ops.gemm.tiled")

    def __init__(
        self,
        *,
        tuner: AutoTuner | None = None,
        max_m: int | None = None,
        compile_workers: int | None = None,
    ) -> None:
        TritonRunner.__init__(self, compile_workers=compile_workers)
        self._hold_tuner(tuner, max_m, False)

    def supports(self, inputs: list[Any]) -> bool:
        """As :meth:`TritonNormGateUpSilu.supports`."""
        x, norm_weight, w_gate_up, _ = _unpack(inputs)
        return norm_weight.dtype.is_floating_point and fused_supports(x, w_gate_up)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """:func:`graphtune.ops.gemm.tiled.gemm_tactics` for ``(B, I, hidden)``, one split,
        within the shared memory with the up tile added; none up to :data:`TILED_ABOVE_M`
        rows."""
        x, w_gate_up = inputs[0], inputs[2]
        m, k = x.shape
        if m <= TILED_ABOVE_M:
            return []
        smem, sms = device_limits(x.device)
        size = x.element_size()
        tactics = gemm_tactics(
            m, w_gate_up.shape[0] // 2, k, itemsize=size, smem_bytes=smem, sm_count=sms
        )
        return [
            t
            for t in tactics
            if t["split_k"] == 1 and t["stages"] * (t["bm"] + 2 * t["bn"]) * t["bk"] * size <= smem
        ]

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """The unfused torch code."""
        return torch_norm_gate_up_silu(inputs)

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs the RMSNorm op and the paired GEMM; returns ``[B, I]``.

        Raises:
            ConfigError: ``tactic`` is not a one-split tiled GEMM tactic for this ``hidden``.
        """
        x, norm_weight, w_gate_up, eps = _unpack(inputs)
        problem = check_gemm_tactic(tactic, x.shape[1])
        if problem is None and tactic["split_k"] != 1:
            problem = f"SiLU pairs run with split_k=1, got {tactic!r}"
        if problem is not None:
            raise ConfigError(
                f"TritonGateUpSiluTiled: {problem}; pick a tactic from get_valid_tactics."
            )
        inter = w_gate_up.shape[0] // 2
        out = torch.empty((x.shape[0], inter), device=x.device, dtype=x.dtype)
        if x.shape[0] == 0 or inter == 0:
            return out
        rows, _ = self.kernel_rows(x, norm_weight, eps, warmup)
        launch_tiled_gemm(rows, w_gate_up, None, None, out, tactic, silu_pairs=True, warmup=warmup)
        return out


def norm_gate_up_silu_runners(
    *, tuner: AutoTuner | None = None, max_m: int | None = None, cold_l2: bool = False
) -> tuple[TunableRunner, ...]:
    """The runners for one tuner: unfused first (fallback), then, when Triton is importable,
    the fused GEMV after the RMSNorm op (up to 16 rows) and the paired tiled GEMM after it (above
    :data:`TILED_ABOVE_M` rows). Not offered, since each would cost the tuner its tactics for
    nothing: the prologue form (:class:`TritonNormGateUpSilu`; no step measured it faster than
    these), and the norm in the loop (:class:`TritonGateUpSiluNormInLoop`): in the 22
    committed decode runs that offered it (``benchmarks/results/decode-*.json`` from 5c453b4 on,
    ``tuning_picks``; llama-1b-shape, Llama-3-8B and Qwen2.5-7B shapes) the tuner picked the
    after-norm runner 65 times, the unfused one 12 times and the in-loop one never."""

    def triton(tuner: AutoTuner, max_m: int | None) -> tuple[TunableRunner, ...]:
        return (
            TritonGateUpSiluAfterNorm(tuner=tuner, max_m=max_m),
            TritonGateUpSiluTiled(tuner=tuner, max_m=max_m),
        )

    return unfused_then_triton(tuner, OP_NAME, UnfusedNormGateUpSilu, triton, max_m, cold_l2)


def norm_gate_up_silu_config(max_m: int | None = None, cold_l2: bool = False) -> TuningConfig:
    """Rows of ``x`` bucketed (:func:`graphtune.ops.fused._base.rows_config`)."""
    return rows_config(max_m, cold_l2)


def norm_gate_up_silu(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_gate_up: torch.Tensor,
    *,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    runners: tuple[TunableRunner, ...] | None = None,
    cold_l2: bool = False,
) -> torch.Tensor:
    """``silu(gate) * up`` of ``rms_norm(x) @ w_gate_up.T``, through the tuner's pick.

    Args:
        x: ``[..., hidden]`` residual stream (not normalised).
        norm_weight: ``[hidden]`` the layer's MLP-norm weight.
        eps: RMSNorm epsilon.
        w_gate_up: ``[2 * I, hidden]``, gate rows first.
        tuner: Tuner to ask (for this op and the unfused path's inner ops); the process default
            when ``None``.
        max_m: Largest tuned row count (``None``: up to the live rows).
        runners: Runners to choose from; :func:`norm_gate_up_silu_runners` when ``None``.
        cold_l2: Tune with cold-L2 rotation (this op and the unfused path's GEMM); the weights
            stream from HBM in a decode step. Look-ups find the picks so tuned.

    Returns:
        ``[..., I]`` in ``x``'s dtype.
    """
    eps = check_eps("norm_gate_up_silu", eps)
    tuner = resolve(tuner)
    lead = x.shape[:-1]
    inputs = [as_rows(x), norm_weight, w_gate_up, float(eps)]
    chosen = runners
    if chosen is None:
        chosen = norm_gate_up_silu_runners(tuner=tuner, max_m=max_m, cold_l2=cold_l2)
    config = norm_gate_up_silu_config(max_m, cold_l2)
    runner, tactic = tuner.choose_one(OP_NAME, chosen, config, inputs)
    return from_rows(runner.forward(inputs, tactic=tactic), lead, w_gate_up.shape[0] // 2)


def _rebuild(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    max_m, cold = record.config["max_value"], bool(record.config.get("cold_l2", False))
    runners = norm_gate_up_silu_runners(tuner=tuner, max_m=max_m, cold_l2=cold)
    return runners, norm_gate_up_silu_config(max_m, cold)


register_op(OP_NAME, _rebuild)
