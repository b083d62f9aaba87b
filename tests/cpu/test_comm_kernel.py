"""The fused all-reduce + add + RMSNorm Triton kernel under TRITON_INTERPRET=1, two ranks simulated.

One process plays rank ``rank`` of a world of ``WORLD``: the other ranks' partials and signal
pads are separate host tensors reached through the same element distances the symmetric-memory
reducer computes from peer addresses. The other ranks' arrival is simulated by raising their slots
in this rank's pad before the launch (a rank that never arrives would make the kernel spin, as on
the GPU). Checks the math against float64 with the unfused path's roundings, and the protocol:
this rank's slots are consumed and its signal is raised in every other rank's pad.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from graphtune.ops import _triton  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)


def _deltas(tensors: list[torch.Tensor], rank: int) -> torch.Tensor:
    base, size = tensors[rank].data_ptr(), tensors[rank].element_size()
    return torch.tensor([(t.data_ptr() - base) // size for t in tensors], dtype=torch.int64)


def _reference(
    parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused path: an all-reduced delta in the dtype, then add + RMSNorm (float32 stats)."""
    dtype = residual.dtype
    delta = torch.stack([p.double() for p in parts]).sum(0).to(dtype)
    s = (residual.double() + delta.double()).to(dtype)
    sd = s.double()
    normed = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return normed.to(dtype), s


@pytest.mark.parametrize(
    ("world", "rank", "dtype", "hidden"),
    [
        (2, 0, torch.float32, 48),
        (2, 1, torch.float16, 64),
        (4, 2, torch.float32, 40),
    ],
)
def test_fused_allreduce_add_rms_norm(
    world: int, rank: int, dtype: torch.dtype, hidden: int
) -> None:
    from graphtune.ops import _comm_kernels

    gen = torch.Generator().manual_seed(world * 10 + rank)
    rows, eps = 3, 1e-5
    parts = [torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(world)]
    pads = [torch.zeros(rows * world, dtype=torch.int32) for _ in range(world)]
    for row in range(rows):
        for peer in range(world):
            if peer != rank:
                pads[rank][row * world + peer] = 1  # the other ranks already arrived
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.randn(hidden, generator=gen) * 0.1 + 1).to(dtype)
    want_out, want_res = _reference(parts, residual, weight, eps)
    out = torch.empty_like(residual)
    block = 1 << (hidden - 1).bit_length()
    _comm_kernels.allreduce_add_rms_norm_kernel[(rows,)](
        parts[rank],
        _deltas(parts, rank),
        pads[rank],
        _deltas(pads, rank),
        residual,
        weight,
        out,
        rank,
        hidden,
        hidden,
        hidden,
        hidden,
        eps,
        WORLD=world,
        BLOCK=block,
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(residual.double(), want_res.double(), rtol=tol, atol=tol)
    assert torch.allclose(out.double(), want_out.double(), rtol=tol, atol=tol)
    # Protocol: this rank consumed every arrival (its own included), and raised its slot in
    # every pad (the others' now wait to be consumed by their ranks).
    assert int(pads[rank].abs().sum()) == 0
    for peer in range(world):
        if peer != rank:
            raised = pads[peer].view(rows, world)
            assert raised[:, rank].tolist() == [1] * rows
            assert int(raised.sum()) == rows
