"""Shared cases of the fused-MoE kernel tests (tests/cpu/test_moe_kernels.py,
tests/cpu/test_moe_gemv.py): random inputs, the float64 oracle, poisoned allocations, a guard
against host-synchronising ops and a fake timer."""

from __future__ import annotations

import contextlib
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphtune.ops.moe import route_top_k

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def gen_seeded() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def moe_case(gen, tokens, experts, hidden, inter, dtype=torch.float32, top_k=2):
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    weights, ids = route_top_k(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
    return [x, gate_up, down, weights, ids]


def float64_moe(x, gate_up, down, weights, ids):
    """The math, one (token, slot) at a time, in float64; ids outside [0, E) add nothing."""
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < gate_up.shape[0]:
                continue
            h = gate_up[e].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, j]) * (down[e].double() @ act)
    return out


@contextlib.contextmanager
def poisoned_allocations():
    """Every ``torch.empty`` inside returns NaN floats or ints of -777 instead of whatever the
    allocator had (often zeros on the CPU, which would hide a row that is read unwritten)."""
    original = torch.empty

    def empty(*args, **kwargs):
        out = original(*args, **kwargs)
        return out.fill_(float("nan") if out.dtype.is_floating_point else -777)

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = original


HOST_SYNC_OPS = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "masked_select",
    "bincount",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
}


class NoHostSync(TorchDispatchMode):
    """Fails on every torch op that reads a device value on the host or has a data-dependent
    output shape: what a CUDA graph capture cannot hold."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_SYNC_OPS:
            raise RuntimeError(f"host-synchronising op {func} during capture")
        return func(*args, **(kwargs or {}))
