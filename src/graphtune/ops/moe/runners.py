"""The fused-MoE runners: the torch fallback and the Triton grouped GEMMs.

:class:`TritonFusedMoeRunner` runs, per call, four kernels with fixed grids (capturable):

1. the sort step (:func:`~graphtune.ops.moe.align.sort_by_expert`, one or two kernels) for the
   tactic's ``block_m``;
2. ``moe_gate_up_kernel``: one launch for all experts, the gate and up GEMMs with SiLU-and-mul
   fused, writing ``[rows, I]`` in sorted order;
3. ``moe_down_kernel``: one launch, the down GEMM times the routing weight, one ``[H]`` row per
   (token, slot) pair;
4. ``moe_sum_kernel``: each token's k rows added in slot order.

Why the top-k sum is a separate kernel instead of atomics in the down GEMM: atomic adds of
bf16/fp16 rows would round in whatever order the programs finish (results that change from run
to run) and need a zero-filled output first; the per-pair rows cost one extra write and read of
``T * k * H`` elements, small next to the weights the GEMMs stream, and the sum is deterministic.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.errors import ConfigError
from graphtune.ops._triton import device_limits, device_supported, run_kernel, triton_available
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.moe._loader import moe_kernels
from graphtune.ops.moe.align import sort_by_expert
from graphtune.ops.moe.gemv import TritonMoeGemvRunner
from graphtune.ops.moe.reference import (
    add_to_residual,
    has_residual,
    moe_output,
    torch_fused_moe,
    unpack_moe_inputs,
)
from graphtune.ops.moe.tactics import check_moe_tactic, moe_tactics

#: Most experts the sort kernels take (their per-expert vectors live in registers).
MAX_EXPERTS = 1024
#: Widest column block of the top-k sum kernel.
SUM_BLOCK = 1024


class TorchFusedMoeRunner(TunableRunner):
    """The torch formulation (``reference.torch_fused_moe``); only the fallback tactic.

    Outside graph capture it loops over the selected experts (one host synchronisation); while a
    CUDA stream captures it runs the dense all-experts form, which needs none.
    """

    source_modules = ("graphtune.ops.moe.reference",)

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC, **kwargs: Any) -> Any:
        """Returns ``[T, H]`` (the residual, updated in place, when the call has one)."""
        return add_to_residual(torch_fused_moe(*unpack_moe_inputs(inputs)), inputs)


class TritonFusedMoeRunner(TritonRunner):
    """Triton grouped GEMMs (see the module docstring); tactic ``-1`` is the torch fallback.

    Args:
        smem_bytes: Override the shared-memory budget per program (pruning rule).
        compile_workers: Threads for ahead-of-time compilation.
    """

    # The kernels, the sort step that launches two of them, and the torch path of tactic -1.
    source_modules = (
        "graphtune.ops.moe._kernels",
        "graphtune.ops.moe.align",
        "graphtune.ops.moe.reference",
    )

    def __init__(
        self, *, smem_bytes: int | None = None, compile_workers: int | None = None
    ) -> None:
        super().__init__(compile_workers=compile_workers)
        self.smem_bytes = smem_bytes

    def cache_key_extras(self) -> tuple[Any, ...]:
        """An override of the budget changes the candidate set, so it is part of the identity."""
        return () if self.smem_bytes is None else ({"smem": self.smem_bytes},)

    def supports(self, inputs: list[Any]) -> bool:
        """Float16/bfloat16/float32 on one Triton device, at most :data:`MAX_EXPERTS` experts."""
        x, gate_up, down, weights, ids = unpack_moe_inputs(inputs)
        devices = {t.device for t in (x, gate_up, down, weights, ids)}
        return len(devices) == 1 and gate_up.shape[0] <= MAX_EXPERTS and device_supported(x.device)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`~graphtune.ops.moe.tactics.moe_tactics`; limits of the inputs' device."""
        x, gate_up, down, _, ids = unpack_moe_inputs(inputs)
        smem, _ = device_limits(x.device)
        return list(
            moe_tactics(
                x.shape[0],
                gate_up.shape[0],
                ids.shape[1],
                x.shape[1],
                down.shape[2],
                itemsize=x.element_size(),
                smem_bytes=self.smem_bytes or smem,
            )
        )

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """The torch fallback (``reference.torch_fused_moe``, then the residual add)."""
        return add_to_residual(torch_fused_moe(*unpack_moe_inputs(inputs)), inputs)

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC, **kwargs: Any) -> Any:
        """Runs tactic ``-1`` with torch, any other tactic with the Triton kernels."""
        if tactic == FALLBACK_TACTIC:
            return self.torch_forward(inputs)
        return self.launch(inputs, tactic)

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs (or with ``warmup`` only compiles) the sort, both GEMMs and the sum (which adds
        the residual in place, when the call has one, and returns it).

        Raises:
            ConfigError: ``tactic`` breaks a rule of :func:`~graphtune.ops.moe.tactics.
                check_moe_tactic`.
        """
        x, gate_up, down, weights, ids = unpack_moe_inputs(inputs)
        problem = check_moe_tactic(tactic)
        if problem is not None:
            raise ConfigError(
                f"TritonFusedMoeRunner: {problem}; pick a tactic from get_valid_tactics."
            )
        tokens, hidden = x.shape
        experts, two_inter, _ = gate_up.shape
        inter, top_k = two_inter // 2, ids.shape[1]
        out, work = moe_output(inputs)
        if not work:
            return out
        pairs = tokens * top_k
        blocks = sort_by_expert(ids, experts, tactic["block_m"], warmup=warmup)
        meta = dict(
            IEEE=x.dtype == torch.float32,
            BLOCK_M=tactic["block_m"],
            BLOCK_N=tactic["block_n"],
            BLOCK_K=tactic["block_k"],
            GROUP_M=tactic["group_m"],
            num_warps=tactic["warps"],
            num_stages=tactic["stages"],
        )
        kernels = moe_kernels()
        act = torch.empty((blocks.sorted_pairs.shape[0], inter), dtype=x.dtype, device=x.device)
        grid = (blocks.num_blocks * math.ceil(inter / tactic["block_n"]),)
        args: tuple[Any, ...] = (
            x,
            gate_up,
            act,
            blocks.sorted_pairs,
            blocks.block_expert,
            pairs,
            top_k,
            inter,
            hidden,
            blocks.num_blocks,
            *x.stride(),
            *gate_up.stride(),
            *act.stride(),
        )
        even_k = dict(EVEN_K=hidden % tactic["block_k"] == 0)
        run_kernel(kernels.moe_gate_up_kernel, grid, args, {**meta, **even_k}, warmup)
        per_pair = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
        route = weights.reshape(-1)
        route = route if route.is_contiguous() else route.contiguous()
        grid = (blocks.num_blocks * math.ceil(hidden / tactic["block_n"]),)
        args = (
            act,
            down,
            route,
            per_pair,
            blocks.sorted_pairs,
            blocks.block_expert,
            pairs,
            hidden,
            inter,
            blocks.num_blocks,
            *act.stride(),
            *down.stride(),
            *per_pair.stride(),
        )
        even_k = dict(EVEN_K=inter % tactic["block_k"] == 0)
        run_kernel(kernels.moe_down_kernel, grid, args, {**meta, **even_k}, warmup)
        flat_ids = ids.reshape(-1)
        flat_ids = flat_ids if flat_ids.is_contiguous() else flat_ids.contiguous()
        block = min(SUM_BLOCK, max(32, 1 << (hidden - 1).bit_length()))
        args = (per_pair, flat_ids, out, hidden, experts, top_k, per_pair.stride(0), out.stride(0))
        meta = dict(
            BLOCK=block, HAS_RES=has_residual(inputs), num_warps=max(1, min(4, block // 256))
        )
        run_kernel(kernels.moe_sum_kernel, (tokens, math.ceil(hidden / block)), args, meta, warmup)
        return out


@functools.lru_cache(maxsize=1)
def fused_moe_runners() -> tuple[TunableRunner, ...]:
    """The process-wide runners: torch first (fallback), then, when Triton is importable, the
    grouped GEMMs and the GEMV path of decode sizes (:mod:`graphtune.ops.moe.gemv`)."""
    runners: list[TunableRunner] = [TorchFusedMoeRunner()]
    if triton_available():
        runners += [TritonFusedMoeRunner(), TritonMoeGemvRunner()]
    return tuple(runners)
