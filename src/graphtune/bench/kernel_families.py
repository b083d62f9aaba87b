"""Device time by kernel family: CUPTI kernel names grouped into what a decode step spends on.

Families: ``GEMV/GEMM`` (cuBLAS, graphtune's Triton GEMM / GEMV and the fused GEMV kernel, which
carries the norm prologue, RoPE and the SiLU epilogue of its stage, and the mixture-of-experts
expert kernels, GEMV-style ``moe_gemv_*`` and tiled ``moe_gate_up`` / ``moe_down`` alike),
``attention``, ``norms``, ``RoPE``, ``activation``, ``routing`` (a mixture-of-experts router:
graphtune's route and router kernels, the latter with its small router GEMM, expert histograms
and alignment, top-k and gating-softmax kernels), ``communication`` (tensor-parallel
all-reduces) and ``other`` (embedding gathers, K/V ``index_copy_``, plain elementwise kernels,
copies, the expert-output sum). Names are matched by lower-case substrings in rule order
(routing first: ``topkGatingSoftmax`` is routing; attention before GEMM: ``fmha_cutlass...`` is
attention), with one rule for Inductor's generated names (``triton_poi_fused_...cat...neg...`` is
rotate-half, RoPE). A bare softmax kernel (torch's ``cunn_SoftMaxForward``) lands in ``other``:
both the matmul attention runner and the torch MoE router launch it, and its name does not say
which. An unfused torch step's RoPE and norms likewise partly run as generic elementwise kernels
in ``other``: compare families across steps knowing that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

FAMILIES = (
    "GEMV/GEMM",
    "attention",
    "norms",
    "RoPE",
    "activation",
    "routing",
    "communication",
    "other",
)

_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("allreduce", "all_reduce", "nccl", "one_shot", "two_shot", "multimem")),
    ("routing", ("router", "route_", "routing", "gating", "topk", "moe_histogram", "moe_align")),
    ("attention", ("attention", "attn", "sdpa", "fmha", "flash")),
    (
        "GEMV/GEMM",
        (
            *("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "splitk", "bmm", "triton_tem"),
            *("moe_gate_up", "moe_down"),
        ),
    ),
    ("norms", ("rms_norm", "rmsnorm", "layer_norm", "layernorm", "norm_kernel", "rsqrt")),
    ("RoPE", ("rope", "rotary")),
    ("activation", ("silu", "swiglu", "act_and_mul", "gelu")),
)


class Activity(Protocol):
    """What is read of a device activity (``graphtune.bench.cupti.DeviceEvent`` has it)."""

    name: str
    duration_us: float


def family_of(name: str) -> str:
    """The family of one kernel name (see the module docstring)."""
    low = name.lower()
    for family, needles in _RULES:
        if any(needle in low for needle in needles):
            return family
    if low.startswith("triton_") and "cat" in low and "neg" in low:
        return "RoPE"  # Inductor's rotate-half: cat(-x2, x1)
    return "other"


def kernel_families(events: Sequence[Activity], calls: int) -> dict[str, dict[str, Any]]:
    """Per-call device time (``us``) and activity count (``calls``) of every family in
    :data:`FAMILIES` order (families without a kernel are left out).

    Raises:
        ValueError: ``calls < 1``.
    """
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    totals: dict[str, list[float]] = {}
    for event in events:
        entry = totals.setdefault(family_of(event.name), [0.0, 0.0])
        entry[0] += event.duration_us
        entry[1] += 1
    return {
        family: {"us": totals[family][0] / calls, "calls": totals[family][1] / calls}
        for family in FAMILIES
        if family in totals
    }
