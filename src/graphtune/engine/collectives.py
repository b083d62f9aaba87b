"""The all-reduce of tensor-parallel decode: NCCL, or a one-shot all-reduce in symmetric memory.

A row-parallel projection leaves each rank with a partial ``[rows, hidden]`` product that must be
summed over the ranks. Decode messages are tiny (``rows x hidden x 2`` bytes: 4 KiB at batch 1 for
a 2048-wide model) and there are two per layer, so the all-reduce's latency, not its bandwidth,
decides whether tensor parallelism pays off. Two backends with one interface:

* :class:`NcclAllReduce`: ``torch.distributed.all_reduce`` in place (NCCL on GPUs, gloo on CPUs).
* :class:`SymmMemAllReduce`: PyTorch's symmetric memory (``torch.distributed._symmetric_memory``):
  every rank writes its partial straight into a buffer that the other GPUs of the node can read
  over NVLink, and ``torch.ops.symm_mem.one_shot_all_reduce_out`` runs one kernel per rank that
  waits for the peers' partials (a signal-pad barrier), reads and sums them and writes the result.
  No NVLink multicast is used (it works with ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``), and the op
  is captured by CUDA graphs like any kernel. Messages larger than the buffer go through NCCL.

:func:`make_all_reduce` picks one for a :class:`~graphtune.engine.parallel.ParallelContext`
(``"auto"``: symmetric memory when every rank can use it, else NCCL). The decision is the same on
every rank, because both backends are collectives and a rank that took the other path would wait
forever.

Usage in a step: ``staged = reducer.staging(rows)``; write the partial product into ``staged``
when it is not ``None`` (else into any tensor); ``reducer.reduce(partial, out)``. A reducer may
also offer ``fused_staging(rows, parity)`` + ``reduce_add_rms_norm(partial, residual, weight,
eps)``: the all-reduce, the residual add and the next RMSNorm in one kernel (the symmetric-memory
backend does, with Triton); the tuned tensor-parallel step uses it when offered.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from graphtune.errors import ConfigError, DistributedError

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "nccl", "symm_mem")
#: Largest message (bytes) the one-shot path takes by default; larger ones go through NCCL, whose
#: ring/tree algorithms win once bandwidth, not latency, dominates.
DEFAULT_ONE_SHOT_MAX_BYTES = 1 << 20


class AllReduce(Protocol):
    """Sums a ``[rows, hidden]`` tensor over the ranks of a group."""

    name: str

    def staging(self, rows: int) -> torch.Tensor | None:
        """Where the partial of ``rows`` rows should be written, or ``None`` (anywhere)."""
        ...

    def reduce(self, partial: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of ``partial`` over the ranks, written to ``out`` (or in place / a new
        tensor when ``out`` is ``None``) and returned."""
        ...


class NcclAllReduce:
    """``torch.distributed.all_reduce`` (sum) in place over ``group``.

    Args:
        group: The process group (``None``: the default group).
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group

    @property
    def name(self) -> str:
        """The group's backend (``"nccl"`` on GPUs, ``"gloo"`` on CPUs); ``"nccl"`` before the
        default group exists."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return "nccl"
        return str(dist.get_backend(self.group))

    def staging(self, rows: int) -> torch.Tensor | None:
        """Always ``None``: NCCL reduces any contiguous tensor in place."""
        return None

    def reduce(self, partial: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sums ``partial`` in place; copies it to ``out`` when ``out`` is another tensor."""
        import torch.distributed as dist

        dist.all_reduce(partial, group=self.group)
        if out is None or out is partial:
            return partial
        return out.copy_(partial)


class SymmMemAllReduce:
    """One-shot all-reduce through symmetric-memory staging buffers of ``max_rows x hidden``.

    Two staging halves live in one symmetric allocation. :meth:`staging` + :meth:`reduce` use the
    first with PyTorch's ``one_shot_all_reduce_out`` (it has a barrier at both ends, so the
    buffer is free again when it returns). With ``fuse_norm`` (and Triton), :meth:`fused_staging`
    + :meth:`reduce_add_rms_norm` also sum the partials, add the residual and apply RMSNorm in one
    Triton kernel with a single barrier (:mod:`graphtune.ops._comm_kernels`); the caller alternates
    the halves (``parity``), which is what makes the missing end barrier safe.

    Construction is collective (``rendezvous``): every rank of ``group`` must build it at the same
    point with the same arguments.

    Args:
        group: The process group (``None``: the default group).
        max_rows: Rows of each staging half (the largest decode batch it serves).
        hidden: Row width.
        dtype: Element type of the partials.
        device: This rank's CUDA device.
        fuse_norm: Set up the fused all-reduce + add + RMSNorm kernel (needs Triton).

    Raises:
        DistributedError: Symmetric memory could not be set up (the message says how to use NCCL
            instead).
    """

    name = "symm_mem"

    def __init__(
        self,
        group: Any,
        max_rows: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        fuse_norm: bool = False,
    ) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group if group is not None else dist.group.WORLD
        self.group_name = self.group.group_name
        self.hidden = hidden
        self.max_rows = max_rows
        self.fallback = NcclAllReduce(group)
        self.fused = False
        try:
            self.buffer = symm_mem.empty(2 * max_rows * hidden, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(self.buffer, self.group_name)
            self.rank, self.world = handle.rank, handle.world_size
            if fuse_norm:
                self._setup_fused(handle, device)
        except (RuntimeError, AttributeError, ValueError) as exc:
            raise DistributedError(
                f"symmetric-memory all-reduce could not be set up on {device} ({exc}); run with "
                "the NCCL all-reduce instead (--all-reduce nccl, or "
                "ParallelContext(all_reduce_backend='nccl'))"
            ) from exc
        self._op = torch.ops.symm_mem.one_shot_all_reduce_out

    def _setup_fused(self, handle: Any, device: torch.device) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.buffer_deltas = _deltas(
            handle.buffer_ptrs, self.rank, self.buffer.element_size(), device
        )
        # Our own signal pad: PyTorch's ops use the handle's, and two protocols must not share
        # slots. Zeroed on every rank before anyone can signal (the barrier below).
        self.pad = symm_mem.empty(self.max_rows * self.world, dtype=torch.int32, device=device)
        self.pad.zero_()
        pad_handle = symm_mem.rendezvous(self.pad, self.group_name)
        self.pad_deltas = _deltas(
            pad_handle.buffer_ptrs, self.rank, self.pad.element_size(), device
        )
        torch.cuda.synchronize(device)
        dist.barrier(group=self.group)
        self.block = 1 << max(0, (self.hidden - 1).bit_length())
        self.fused = True

    def staging(self, rows: int) -> torch.Tensor | None:
        """A ``[rows, hidden]`` view at the start of the symmetric buffer; ``None`` when it does
        not fit (the message then goes through NCCL)."""
        if rows > self.max_rows:
            return None
        return self.buffer[: rows * self.hidden].view(rows, self.hidden)

    def reduce(self, partial: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """One-shot sum of a staged partial into ``out`` (a new tensor when ``None``).

        A partial that is not a staging view (too many rows) is reduced by NCCL in place.
        """
        if partial.data_ptr() != self.buffer.data_ptr() or partial.numel() > self.max_rows * (
            self.hidden
        ):
            return self.fallback.reduce(partial, out)
        if out is None or out is partial:
            out = torch.empty_like(partial)
        return self._op(partial, "sum", self.group_name, out)

    def fused_staging(self, rows: int, parity: int) -> torch.Tensor | None:
        """Staging half ``parity % 2`` for :meth:`reduce_add_rms_norm`; ``None`` when the fused
        kernel is off or ``rows`` does not fit. Consecutive calls must alternate ``parity``."""
        if not self.fused or rows > self.max_rows:
            return None
        start = (parity % 2) * self.max_rows * self.hidden
        return self.buffer[start : start + rows * self.hidden].view(rows, self.hidden)

    def reduce_add_rms_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += sum over ranks of partial`` (in place), and its RMSNorm.

        Args:
            partial: A :meth:`fused_staging` view holding this rank's partial product.
            residual: ``[rows, hidden]`` residual stream (contiguous rows), updated in place.
            weight: ``[hidden]`` norm weight.
            eps: RMSNorm epsilon.

        Returns:
            ``(normed, residual)``.
        """
        from graphtune.ops import _comm_kernels

        out = torch.empty_like(residual)
        _comm_kernels.allreduce_add_rms_norm_kernel[(partial.shape[0],)](
            partial,
            self.buffer_deltas,
            self.pad,
            self.pad_deltas,
            residual,
            weight,
            out,
            self.rank,
            self.hidden,
            partial.stride(0),
            residual.stride(0),
            out.stride(0),
            float(eps),
            WORLD=self.world,
            BLOCK=self.block,
            num_warps=min(16, max(4, self.block // 512)),
        )
        return out, residual


def _deltas(pointers: Any, rank: int, itemsize: int, device: torch.device) -> torch.Tensor:
    """Element distances from this rank's mapping of a buffer to every rank's (int64 tensor)."""
    base = pointers[rank]
    if any((ptr - base) % itemsize for ptr in pointers):
        raise ValueError("symmetric buffers are not element-aligned across ranks")
    return torch.tensor(
        [(ptr - base) // itemsize for ptr in pointers], dtype=torch.int64, device=device
    )


def symm_mem_unavailable(device: torch.device) -> str | None:
    """Why this process cannot use the symmetric-memory all-reduce, or ``None`` if it can."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        torch.ops.symm_mem.one_shot_all_reduce_out  # noqa: B018  (raises when the op is missing)
    except (ImportError, AttributeError, RuntimeError) as exc:
        return f"this torch build has no symm_mem one-shot all-reduce ({exc})"
    return None


def make_all_reduce(
    parallel: Any,
    *,
    max_rows: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    one_shot_max_bytes: int = DEFAULT_ONE_SHOT_MAX_BYTES,
    fuse_norm: bool | None = None,
) -> AllReduce:
    """The all-reduce backend for ``parallel`` (a ``ParallelContext``), agreed by every rank.

    ``parallel.all_reduce_backend`` chooses: ``"nccl"``; ``"symm_mem"`` (an error when
    unavailable); ``"auto"``: symmetric memory when it is available on every rank, else NCCL
    (logged). Each staging half holds ``min(max_rows, one_shot_max_bytes / row bytes)`` rows.
    ``fuse_norm`` (default: when Triton is importable) also sets up the fused all-reduce + add +
    RMSNorm kernel that the tuned tensor-parallel step uses.

    Raises:
        ConfigError: ``"symm_mem"`` was asked for and some rank cannot use it.
    """
    choice = getattr(parallel, "all_reduce_backend", "auto")
    if choice not in BACKENDS:
        raise ConfigError(f"all_reduce={choice!r} is not one of {', '.join(BACKENDS)}")
    if choice == "nccl" or parallel.world_size == 1:
        return NcclAllReduce(parallel.group)
    reason = symm_mem_unavailable(device)
    if device.type == "cuda":
        # Every rank must take the same path: agree on availability first (a MIN over flags).
        import torch.distributed as dist

        flag = torch.tensor([0 if reason else 1], device=device, dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=parallel.group)
        if reason is None and not int(flag.item()):
            reason = "another rank cannot use it"
    if reason is not None:
        if choice == "symm_mem":
            raise ConfigError(
                f"all_reduce='symm_mem' is unavailable: {reason}; use 'nccl' or 'auto'"
            )
        logger.info("tensor-parallel all-reduce: NCCL (symmetric memory unavailable: %s)", reason)
        return NcclAllReduce(parallel.group)
    row_bytes = hidden * torch.empty((), dtype=dtype).element_size()
    rows = max(1, min(max_rows, one_shot_max_bytes // row_bytes))
    if fuse_norm is None:
        from graphtune.ops import triton_available

        fuse_norm = triton_available()
    reducer = SymmMemAllReduce(parallel.group, rows, hidden, dtype, device, fuse_norm=fuse_norm)
    logger.info(
        "tensor-parallel all-reduce: symmetric-memory one-shot for <= %d rows (fused "
        "add + RMSNorm kernel: %s), NCCL above",
        rows,
        reducer.fused,
    )
    return reducer
