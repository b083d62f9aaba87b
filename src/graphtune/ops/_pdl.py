"""Programmatic dependent launch (PDL) for graphtune's Triton kernels.

On compute capability 9.0 and later a kernel launched with PDL may start while the kernel before
it in the stream is still running: its programs are scheduled as soon as every program of the
predecessor has called ``griddepcontrol.launch_dependents`` (or finished), and each of its programs
blocks in ``griddepcontrol.wait`` until the predecessor has completed and its writes are visible.
CUDA graphs capture the dependency, so a replayed step overlaps one kernel's tail and set-up with
the next kernel's start.

A kernel opts in by declaring a ``USE_PDL: tl.constexpr`` parameter; :func:`pdl_meta` (called by
:func:`graphtune.ops._triton.run_kernel` for every launch) then sets it, and asks Triton for a PDL
launch (``launch_pdl=True``), exactly when PDL can work: a CUDA device of compute capability
>= 9.0, a Triton whose CUDA backend has the ``launch_pdl`` option and ``tl.extra.cuda.gdc_wait``
(Triton 3.3 and later; the interpreter never), and ``GRAPHTUNE_PDL`` not ``0``. Otherwise
``USE_PDL`` is false, the kernel compiles without the ``griddepcontrol`` instructions, and it is
launched in plain stream order: the results are the same bits either way.

The contract a ``USE_PDL`` kernel keeps (every Triton kernel of a decode step does):

* before ``gdc_wait()`` it reads only what no kernel of the step writes (weights, norm weights,
  RoPE tables) and writes nothing; after it, anything. So a read-after-write (activations) and a
  write-after-read (an in-place residual update of a tensor the predecessor reads) are both safe.
  One kernel reads more early: the fused-MoE GEMV path's down kernel, whose predecessor is always
  the gate/up kernel of the same call, reads the routing (expert ids and weights, written by
  the kernel before that one) before its wait; by the next rule that kernel has completed when
  the down kernel starts (``graphtune.ops.moe._gemv_kernels``). Decode attention reads its mask
  (written at the step's start) before its wait, and a split's K/V tile when the split is one
  tile: of those, the kernel before it writes only each request's new K/V row, the last key the
  mask leaves visible, which it reads again after the wait (``graphtune.ops._attention_kernels``).
  The GEMV, fused GEMV and MoE down kernels issue their epilogues' reads of earlier kernels'
  outputs (the residual, the positions, the cache rows) right after the wait, before the main
  loop, and use them only in the epilogue, so those round trips overlap the loop instead of
  following it;
* every program calls ``gdc_wait()`` unconditionally (no early exit before it), so a kernel's
  completion implies its predecessor's, and waiting on the immediate predecessor is enough to
  order a kernel after every earlier one;
* ``gdc_launch_dependents()`` follows ``gdc_wait()`` at once. The trigger counts only when every
  program of the kernel has passed it, so the successor launches once this kernel's last wave is
  resident (it never takes a slot a program of this kernel still needs) and after the kernel
  before has completed (so at most two kernels wait on each other at a time). Its programs then
  fill the SM slots this kernel's programs free, issue their weight loads during this kernel's
  last wave, and keep the memory system busy across the kernel boundary. A trigger at the end of
  the main loop instead measured slower in the decode step: it overlapped only the epilogue.
  The one exception is the fused QKV stage, whose successor is decode attention (a grid of a few
  dozen programs): launched that early, attention took 7.3 us after the QKV kernel instead of
  4.3 us (likely because its programs could only start on the few SMs the QKV programs left room
  on, several to an SM), so that kernel triggers after its main loop. Decode attention without a
  separate combine kernel (one split, or the inline combine) triggers after its main loop too:
  its successor is the output projection, and with the early trigger every Triton GEMM there
  cost the step 2-5 us a call more than its own time said, at batches 16 and 32 on the H200
  (``benchmarks/step_truth.py``, results README).

A kernel that follows a kernel without PDL (cuBLAS, torch) is ordered as usual: the driver only
overlaps a PDL launch with a predecessor that triggers it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from graphtune import env

PDL_ARG = "USE_PDL"
"""The ``tl.constexpr`` parameter through which a kernel opts in to PDL."""
MIN_CAPABILITY = (9, 0)


@functools.lru_cache(maxsize=1)
def triton_accepts_pdl() -> bool:
    """Whether the installed Triton can launch with PDL and emit ``griddepcontrol``.

    Triton 3.3+ has ``launch_pdl`` among the CUDA backend's options and
    ``tl.extra.cuda.gdc_wait`` / ``gdc_launch_dependents`` (their builder argument was renamed
    between 3.3 and 3.4, which the ``tl.extra.cuda`` call sites do not see).
    """
    try:
        import triton.language.extra.cuda as cuda_extra
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return (
        "launch_pdl" in fields
        and hasattr(cuda_extra, "gdc_wait")
        and hasattr(cuda_extra, "gdc_launch_dependents")
    )


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def device_supports_pdl(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU of compute capability >= 9.0."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= MIN_CAPABILITY


def _is_interpreted(kernel: Any) -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(kernel, InterpretedFunction)


# Read on every launch, and fixed while the process runs: per kernel (by identity; the entry keeps
# it alive, so its id is not reused), whether it declares the switch and whether it is
# interpreted; per device (a CUDA one with its index), whether PDL can work there.
_KERNELS: dict[int, tuple[Any, bool, bool]] = {}
_DEVICES: dict[torch.device, bool] = {}


def _kernel_flags(kernel: Any) -> tuple[bool, bool]:
    found = _KERNELS.get(id(kernel))
    if found is None or found[0] is not kernel:
        declares = PDL_ARG in getattr(kernel, "arg_names", ())
        found = (kernel, declares, declares and _is_interpreted(kernel))
        _KERNELS[id(kernel)] = found
    return found[1], found[2]


def _device_allows(device: torch.device) -> bool:
    found = _DEVICES.get(device)
    if found is None:
        found = device_supports_pdl(device) and triton_accepts_pdl()
        if device.type != "cuda" or device.index is not None:  # "cuda": the current one
            _DEVICES[device] = found
    return found


def tensor_device(args: Sequence[Any]) -> torch.device | None:
    """The device of the first tensor in ``args`` (a launch's arguments, a runner's inputs),
    or ``None`` when there is none."""
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def pdl_enabled(device: torch.device | None) -> bool:
    """Whether a ``USE_PDL`` kernel on ``device`` is launched with PDL (see the module doc)."""
    return device is not None and env.pdl_allowed() and _device_allows(device)


def pdl_meta(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with ``USE_PDL`` (and ``launch_pdl``) filled in for a kernel that declares it.

    A kernel without a ``USE_PDL`` parameter gets ``meta`` unchanged; an explicit ``USE_PDL`` in
    ``meta`` is kept (``launch_pdl`` then follows it). Warm-up compiles pass the same options, so
    the binary compiled ahead of time is the one launched. Called for every launch: what does not
    change (the kernel's parameters, the device's support) is looked up once.
    """
    declares, interpreted = _kernel_flags(kernel)
    if not declares:
        return meta
    if PDL_ARG in meta:
        use = bool(meta[PDL_ARG])
    else:
        use = not interpreted and pdl_enabled(tensor_device(args))
    out = {**meta, PDL_ARG: use}
    if use:
        out["launch_pdl"] = True
    return out
