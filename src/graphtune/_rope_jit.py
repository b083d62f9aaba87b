"""Triton device functions that two decode kernels share: the rotate-half RoPE and Qwen3's
per-head q/k norm, each with the roundings of the torch code it stands for.

Callers: ``graphtune.ops._kernels.rope_kv_kernel`` (RoPE + K/V write, one token a program) and
``graphtune.ops.fused_gemv._kernels.fused_gemv_kernel`` (the same in the QKV GEMV's epilogue,
on transposed tiles). The functions work on whatever tiles they are given: the caller
broadcasts the cos/sin rows and the norm weights to the shape of ``x1`` and ``x2`` (a head's
first and second halves, float32).

This module sits outside :mod:`graphtune.ops` on purpose: a Triton compile worker
(:mod:`graphtune._compile_worker`) executes a kernel module from its file without the packages
above it, and this import must not run ``graphtune.ops``'s ``__init__`` (torch and every op).
It imports nothing but Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def head_rms_norm_halves(x1, x2, inv, w1, w2, dtype: tl.constexpr):
    """``x * inv`` rounded to ``dtype``, times the norm weight, rounded again (the roundings of
    ``graphtune.ops.rmsnorm.head_rms_norm_``), for both halves; returned as float32. ``inv`` is
    the head's ``rsqrt(mean(x^2) + eps)`` over both halves, broadcast by the caller."""
    n1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    n2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return n1, n2


@triton.jit
def rotate_halves(x1, x2, c1, c2, s1, s2, SIGNED_SIN: tl.constexpr, dtype: tl.constexpr):
    """Rotate-half RoPE of one head's halves: ``(x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2)``
    in ``dtype``, each product rounded as ``graphtune.engine.model.apply_rope`` rounds it. With
    ``SIGNED_SIN`` the sin table's first half already holds ``-sin``
    (``engine.model.apply_rope_signed``): ``x * cos`` is one rounded tensor, then an addcmul adds
    ``swap(x) * signed_sin`` with one more rounding."""
    if SIGNED_SIN:
        o1 = ((x1 * c1).to(dtype).to(tl.float32) + x2 * s1).to(dtype)
        o2 = ((x2 * c2).to(dtype).to(tl.float32) + x1 * s2).to(dtype)
    else:
        o1 = ((x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)).to(dtype)
    return o1, o2
