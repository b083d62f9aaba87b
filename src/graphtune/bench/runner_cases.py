"""Every Triton runner of graphtune.ops on small CPU tensors, in each kernel mode: one list.

``tests/cpu/sm90_compile.py`` compiles every launch these cases make for an sm_90 GPU, and
``benchmarks/host_overhead.py`` times graphtune's own host code per launch over them, so both
see the same runners. Building the cases imports every runner's module but launches nothing;
:func:`launches_replaced` is how both run the runners' launch code without a kernel.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

BF16, F32 = torch.bfloat16, torch.float32


def _rand(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def runner_cases() -> list[tuple[str, Any, list[Any]]]:
    """``(label, runner, inputs)`` of every Triton runner, on small CPU tensors, in each of its
    kernel modes, at 1 and 8 rows (2 and 8 for the tiled and skinny GEMMs, which offer nothing
    for one row; only 8 for the runners :mod:`graphtune.ops._pruned` offers nothing at one row;
    each label names the case and holds its ``m=``). The inputs are random; nothing is launched
    here."""
    from graphtune.ops import attention
    from graphtune.ops._pruned import (
        ADD_PROJECTION_MIN_ROWS,
        NORM_LINEAR_IN_LOOP_MIN_ROWS,
        QKV_AFTER_NORM_MIN_ROWS,
    )
    from graphtune.ops.activation import TritonSiluAndMulRunner
    from graphtune.ops.fused import (
        TritonAddProjection,
        TritonGateUpSiluAfterNorm,
        TritonGateUpSiluNormInLoop,
        TritonNormGateUpSilu,
        TritonNormLinear,
        TritonNormLinearInLoop,
        TritonNormQkvRope,
        TritonQkvRopeAfterNorm,
        TritonQkvRopeNormInLoop,
    )
    from graphtune.ops.gemm import TritonSkinnyGemmRunner
    from graphtune.ops.gemm.gemv import TritonGemvRunner
    from graphtune.ops.gemm.tiled import TritonGemmRunner
    from graphtune.ops.moe import (
        TritonFusedMoeRunner,
        TritonMoeGemvRunner,
        TritonMoeRouter,
        TritonRouteTopKRunner,
    )
    from graphtune.ops.rmsnorm import TritonRMSNormRunner
    from graphtune.ops.rotary import TritonRopeRunner

    hidden, inter, heads, kv, dim, seq = 256, 512, 4, 2, 64, 512
    cases: list[tuple[str, Any, list[Any]]] = []

    def add(label: str, runner: Any, inputs: list[Any]) -> None:
        cases.append((label, runner, inputs))

    for m in (1, 8):
        x, nw = _rand(m, hidden), _rand(hidden)
        add(f"norm_linear m={m}", TritonNormLinear(), [x, nw, _rand(inter, hidden), None, 1e-5])
        if m >= NORM_LINEAR_IN_LOOP_MIN_ROWS:
            add(
                f"norm_linear in loop m={m}",
                TritonNormLinearInLoop(),
                [x, nw, _rand(inter, hidden), _rand(inter), 1e-5],
            )
        add(
            f"norm_linear+bias m={m}",
            TritonNormLinear(),
            [x, nw, _rand(inter, hidden), _rand(inter), 1e-5],
        )
        if m >= ADD_PROJECTION_MIN_ROWS:
            add(
                f"add_projection m={m}",
                TritonAddProjection(),
                [x, _rand(m, inter), _rand(hidden, inter)],
            )
        for gate_up in (
            TritonNormGateUpSilu(),
            TritonGateUpSiluNormInLoop(),
            TritonGateUpSiluAfterNorm(),
        ):
            add(
                f"norm_gate_up_silu {type(gate_up).__name__} m={m}",
                gate_up,
                [x, nw, _rand(2 * inter, hidden), 1e-5],
            )
        rows = (heads + 2 * kv) * dim
        positions = torch.zeros(m, dtype=torch.long)
        write_rows = torch.arange(m * kv, dtype=torch.long)
        k_cache, v_cache = _rand(64, dim), _rand(64, dim)
        for signed, bias in ((True, None), (False, _rand(rows))):
            qkv_runners = [
                TritonNormQkvRope(heads, kv, signed),
                TritonQkvRopeNormInLoop(heads, kv, signed),
            ]
            if m >= QKV_AFTER_NORM_MIN_ROWS:
                qkv_runners.append(TritonQkvRopeAfterNorm(heads, kv, signed))
            for qkv in qkv_runners:
                add(
                    f"norm_qkv_rope {type(qkv).__name__} m={m} signed={signed} "
                    f"bias={bias is not None}",
                    qkv,
                    [x, nw, _rand(rows, hidden), bias, positions, _rand(seq, dim), _rand(seq, dim)]
                    + [k_cache, v_cache, write_rows, 1e-5, None],
                )
        # The tiled and skinny GEMMs offer no tactics for one row (the GEMV's): two rows.
        tiled_m = max(m, 2)
        x_tiled = _rand(tiled_m, hidden)
        add(
            f"skinny_gemm m={tiled_m}",
            TritonSkinnyGemmRunner(),
            [x_tiled, _rand(inter, hidden), _rand(inter), _rand(tiled_m, inter), True],
        )
        add(
            f"gemm m={tiled_m}",
            TritonGemmRunner(min_rows=1),
            [x_tiled, _rand(inter, hidden), None, _rand(tiled_m, inter), True],
        )
        add(
            f"gemv m={m}",
            TritonGemvRunner(max_rows=8),
            [x, _rand(inter, hidden), None, None, False],
        )
        add(
            f"gemv+bias+residual m={m}",
            TritonGemvRunner(max_rows=8),
            [x, _rand(inter, hidden), _rand(inter), _rand(m, inter), True],
        )
        add(f"rms_norm m={m}", TritonRMSNormRunner(), [x, nw, _rand(m, hidden), 1e-5])
        add(f"silu_and_mul m={m}", TritonSiluAndMulRunner(), [_rand(m, 2 * inter)])
        experts, top_k, expert_inter = 8, 2, 64
        logits = _rand(m, experts)
        for weights_float32 in (True, False):
            add(
                f"route_top_k m={m} float32={weights_float32}",
                TritonRouteTopKRunner(top_k, True, weights_float32),
                [logits],
            )
            for experts_of_router in (experts, 128):  # a 16-lane block and a wide one
                add(
                    f"moe_router m={m} experts={experts_of_router} float32={weights_float32}",
                    TritonMoeRouter(top_k, True, weights_float32),
                    [x, _rand(experts_of_router, hidden)],
                )
        ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(m)])
        moe_inputs = [
            x,
            _rand(experts, 2 * expert_inter, hidden),
            _rand(experts, hidden, expert_inter),
            torch.full((m, top_k), 0.5, dtype=BF16),
            ids,
        ]
        add(f"fused_moe m={m}", TritonFusedMoeRunner(smem_bytes=228 * 1024), moe_inputs)
        add(f"fused_moe gemv m={m}", TritonMoeGemvRunner(), moe_inputs)
        with_residual = [*moe_inputs, _rand(m, hidden)]
        add(f"fused_moe+residual m={m}", TritonFusedMoeRunner(smem_bytes=228 * 1024), with_residual)
        add(f"fused_moe gemv+residual m={m}", TritonMoeGemvRunner(), with_residual)
        rope_inputs = [_rand(m, rows), positions, _rand(seq, dim), _rand(seq, dim), k_cache]
        rope_inputs += [v_cache, write_rows]
        add(f"rope m={m}", TritonRopeRunner(heads, kv, True), rope_inputs)
        head_norm = [_rand(heads + kv, dim), 1e-6]
        add(f"rope+head norm m={m}", TritonRopeRunner(heads, kv, True), rope_inputs + head_norm)
        for dtype in (BF16, F32):
            q = _rand(m, kv, heads // kv, dim, dtype=dtype)
            keys, values = _rand(m, kv, seq, dim, dtype=dtype), _rand(m, kv, seq, dim, dtype=dtype)
            mask = torch.zeros(m, 1, 1, seq, dtype=dtype)
            for runner in (
                attention.TritonDecodeAttention(),
                attention.TritonDecodeAttentionOneKernel(),
            ):
                add(f"{type(runner).__name__} m={m} {dtype}", runner, [q, keys, values, mask])
    return cases


@contextmanager
def launches_replaced(stand_in: Callable[..., None]) -> Iterator[None]:
    """Within the block every loaded ``graphtune.ops`` module calls ``stand_in(kernel, grid, args,
    meta, warmup)`` where it would call ``graphtune.ops._triton.run_kernel``; put back after."""
    from graphtune.ops import _triton

    real = _triton.run_kernel
    patched = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("graphtune.ops") and getattr(module, "run_kernel", None) is real
    ]
    for module in patched:
        module.run_kernel = stand_in
    try:
        yield
    finally:
        for module in patched:
            module.run_kernel = real
