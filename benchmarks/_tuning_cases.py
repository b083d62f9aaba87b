"""The (op, bucket) cases of benchmarks/tuning.py: Llama-1B decode shapes and their runners."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

HIDDEN, INTER, HEADS, KV, DIM, VOCAB = 2048, 8192, 32, 8, 64, 128256
FULL_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Case:
    """One (op, bucket) to tune."""

    op: str
    label: str
    bucket: int
    build: Callable[[torch.device, int], tuple[str, tuple[Any, ...], Any, list[Any]]]


def selected(case: Case, only: str | None) -> bool:
    """Whether ``case`` matches ``--only``: alternatives separated by ``|``, each a text the
    label contains, optionally ``@M`` for one bucket (``"down@1|add+rmsnorm@8"``)."""
    if not only:
        return True
    for part in only.split("|"):
        text, _, bucket = part.partition("@")
        if text in case.label and (not bucket or bucket == str(case.bucket)):
            return True
    return False


def _randn(device: torch.device, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(torch.bfloat16)


def _only_bucket(config: Any, m: int) -> Any:
    """The op's tuning config restricted to one bucket (the case), so a run tunes just it."""
    from graphtune.autotuner import DynamicTensorSpec

    return dataclasses.replace(
        config, dynamic_specs=(DynamicTensorSpec(0, 0, buckets=(m,)),), max_value=m
    )


def gemm_case(label: str, n: int, k: int, m: int, max_tactics: int = 20) -> Case:
    def build(device: torch.device, m: int):
        from graphtune.ops.gemm import (
            OP_NAME,
            TorchGemmRunner,
            TritonGemmRunner,
            TritonGemvRunner,
            TritonSkinnyGemmRunner,
            gemm_config,
        )

        # The engine's runners (gemm_runners()): the GEMV offers tactics for M <= 2 only, the
        # skinny tensor-core GEMM for 2 <= M <= 16, the tiled GEMM from 17 rows
        # (graphtune.ops._pruned).
        runners = (
            TorchGemmRunner(),
            TritonGemmRunner(max_tactics=max_tactics),
            TritonGemvRunner(),
            TritonSkinnyGemmRunner(),
        )
        inputs = [_randn(device, m, k), _randn(device, n, k, scale=k**-0.5), None, None, False]
        return OP_NAME, runners, _only_bucket(gemm_config(m), m), inputs

    return Case("gemm", f"{label} {k}->{n}", m, build)


def norm_case(m: int) -> Case:
    def build(device: torch.device, m: int):
        from graphtune.ops.rmsnorm import (
            OP_NAME,
            TorchRMSNormRunner,
            TritonRMSNormRunner,
            rms_norm_config,
        )

        inputs = [
            _randn(device, m, HIDDEN),
            _randn(device, HIDDEN),
            _randn(device, m, HIDDEN),
            1e-5,
        ]
        runners = (TorchRMSNormRunner(), TritonRMSNormRunner())
        return OP_NAME, runners, _only_bucket(rms_norm_config(m, True), m), inputs

    return Case("rms_norm", f"add+rmsnorm {HIDDEN}", m, build)


def silu_case(m: int) -> Case:
    def build(device: torch.device, m: int):
        from graphtune.ops.activation import (
            OP_NAME,
            TorchSiluAndMulRunner,
            TritonSiluAndMulRunner,
            silu_and_mul_config,
        )

        runners = (TorchSiluAndMulRunner(), TritonSiluAndMulRunner())
        inputs = [_randn(device, m, 2 * INTER)]
        return OP_NAME, runners, _only_bucket(silu_and_mul_config(m), m), inputs

    return Case("silu_and_mul", f"silu*mul {INTER}", m, build)


def rope_case(m: int) -> Case:
    def build(device: torch.device, m: int):
        from graphtune.ops.rope_config import CACHE_ROWS, TABLE_ROWS, rope_config
        from graphtune.ops.rotary import OP_NAME, TorchRopeRunner, TritonRopeRunner

        runners = (TorchRopeRunner(HEADS, KV, True), TritonRopeRunner(HEADS, KV, True))
        rows = torch.randperm(CACHE_ROWS, device=device)[: m * KV]
        inputs = [
            _randn(device, m, (HEADS + 2 * KV) * DIM),
            torch.randint(0, TABLE_ROWS, (m,), device=device),
            _randn(device, TABLE_ROWS, DIM),
            _randn(device, TABLE_ROWS, DIM),
            _randn(device, CACHE_ROWS, DIM),
            _randn(device, CACHE_ROWS, DIM),
            rows,
        ]
        return OP_NAME, runners, _only_bucket(rope_config(KV, m), m), inputs

    return Case("rope_kv_cache", f"rope+kv {HEADS}/{KV}x{DIM}", m, build)


def cases(quick: bool) -> list[Case]:
    gemm_buckets = (1, 16, 128) if quick else FULL_BUCKETS
    fused_buckets = (1, 64) if quick else (1, 8, 64)
    shapes = [
        ("qkv", 3072, 2048),
        ("o_proj", 2048, 2048),
        ("gate_up", 16384, 2048),
        ("down", 2048, 8192),
    ]
    if quick:
        shapes = [shapes[0], shapes[3]]
    out = [gemm_case(label, n, k, m) for label, n, k in shapes for m in gemm_buckets]
    if not quick:
        out += [gemm_case("lm_head", VOCAB, HIDDEN, m, max_tactics=8) for m in (1, 16, 128)]
    for m in fused_buckets:
        out += [norm_case(m), silu_case(m), rope_case(m)]
    return out
