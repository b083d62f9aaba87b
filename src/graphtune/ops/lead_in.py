"""A small PDL kernel to time candidates after: the lead-in of ``GraphTimer(lead_in=...)``.

In the decode step every tuned kernel follows a different PDL kernel, while the graph timer's
chain of back-to-back calls puts each call after itself; under programmatic dependent launch the
two overlap differently (:mod:`graphtune.autotuner.timing.lead_in` says why that matters). The
lead-in here is graphtune's fused add + RMSNorm kernel on 64 rows of 2048 bfloat16 elements, as a
step's norm launches it (``gdc_wait`` / ``gdc_launch_dependents`` first), on buffers of its own,
so it reads and writes nothing the candidate does. Experimental, and off unless asked for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphtune.ops._pdl import pdl_enabled
from graphtune.ops._triton import kernels, kernels_interpreted, run_kernel, triton_available

ROWS, HIDDEN = 64, 2048


def pdl_lead_in(device: torch.device) -> Callable[[], None] | None:
    """A callable that launches one small Triton PDL kernel on ``device``'s current stream, or
    ``None`` where PDL cannot work: not CUDA, no Triton, Triton's interpreter, a GPU below
    compute capability 9.0, a Triton without PDL, or ``GRAPHTUNE_PDL=0``
    (:func:`graphtune.ops._pdl.pdl_enabled`).

    The buffers (about 1 MiB) are allocated here and kept by the callable, so it allocates
    nothing when called and may be captured in a CUDA graph.
    """
    device = torch.device(device)
    if device.type != "cuda" or not triton_available() or not pdl_enabled(device):
        return None
    if kernels_interpreted():
        return None
    gen = torch.Generator(device=device).manual_seed(0)
    x, residual = (
        torch.randn(ROWS, HIDDEN, generator=gen, device=device, dtype=torch.bfloat16)
        for _ in range(2)
    )
    weight = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    args = (x, residual, weight, out, res_out, HIDDEN, HIDDEN, HIDDEN, HIDDEN, HIDDEN, 1e-6)
    meta = dict(HAS_RES=True, BLOCK=HIDDEN, ONE_PASS=True, num_warps=4)
    kernel = kernels().rms_norm_kernel

    def launch() -> None:
        run_kernel(kernel, (ROWS,), args, meta, False)

    return launch
