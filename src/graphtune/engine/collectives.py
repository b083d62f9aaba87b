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
when it is not ``None`` (else into any tensor); ``reducer.reduce(partial, out)``.
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

    name = "nccl"

    def __init__(self, group: Any = None) -> None:
        self.group = group

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
    """One-shot all-reduce through a symmetric-memory staging buffer of ``max_rows x hidden``.

    Construction is collective (``rendezvous``): every rank of ``group`` must build it at the same
    point with the same arguments.

    Args:
        group: The process group (``None``: the default group).
        max_rows: Rows of the staging buffer (the largest decode batch it serves).
        hidden: Row width.
        dtype: Element type of the partials.
        device: This rank's CUDA device.

    Raises:
        DistributedError: Symmetric memory could not be set up (the message says how to use NCCL
            instead).
    """

    name = "symm_mem"

    def __init__(self, group: Any, max_rows: int, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group if group is not None else dist.group.WORLD
        self.group_name = self.group.group_name
        self.hidden = hidden
        self.max_rows = max_rows
        self.fallback = NcclAllReduce(group)
        try:
            self.buffer = symm_mem.empty(max_rows * hidden, dtype=dtype, device=device)
            symm_mem.rendezvous(self.buffer, self.group_name)
        except (RuntimeError, AttributeError, ValueError) as exc:
            raise DistributedError(
                f"symmetric-memory all-reduce could not be set up on {device} ({exc}); run with "
                "the NCCL all-reduce instead (--all-reduce nccl, or "
                "ParallelContext(all_reduce_backend='nccl'))"
            ) from exc
        self._op = torch.ops.symm_mem.one_shot_all_reduce_out

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
        if partial.data_ptr() != self.buffer.data_ptr() or partial.numel() > self.buffer.numel():
            return self.fallback.reduce(partial, out)
        if out is None or out is partial:
            out = torch.empty_like(partial)
        return self._op(partial, "sum", self.group_name, out)


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


def make_all_reduce(parallel: Any, *, max_rows: int, hidden: int, dtype: torch.dtype,
                    device: torch.device, one_shot_max_bytes: int = DEFAULT_ONE_SHOT_MAX_BYTES
                    ) -> AllReduce:
    """The all-reduce backend for ``parallel`` (a ``ParallelContext``), agreed by every rank.

    ``parallel.all_reduce_backend`` chooses: ``"nccl"``; ``"symm_mem"`` (an error when
    unavailable); ``"auto"``: symmetric memory when it is available on every rank, else NCCL
    (logged). The staging buffer holds ``min(max_rows, one_shot_max_bytes / row bytes)`` rows.

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
    reducer = SymmMemAllReduce(parallel.group, rows, hidden, dtype, device)
    logger.info("tensor-parallel all-reduce: symmetric-memory one-shot for <= %d rows, NCCL above",
                rows)
    return reducer
