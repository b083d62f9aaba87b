"""Prefetching a weight into L2 from inside a latency-bound kernel of the decode step.

At small batches some kernels of a step leave HBM nearly idle while they run: decode attention
at batch 1 reads about a megabyte of K/V in a few microseconds, bound by its latency, not by the
memory. The projection right after it reads megabytes of weights that no kernel of the step
writes. Such a kernel can issue ``cp.async.bulk.prefetch.L2`` (Hopper's bulk prefetch: an
asynchronous hint that fills L2 from global memory, with nothing to wait for) over the next
weight, so that weight is read from L2 when its own kernel runs. It changes no result: only where
the bytes come from.

A kernel takes the three parameters that :func:`l2_prefetch_args` fills (``pf_ptr``,
``pf_chunks``, ``pf_last``) and an ``L2_PREFETCH`` constexpr from :func:`l2_prefetch_compiled`,
and calls ``graphtune.ops._prefetch_kernels.prefetch_l2_share`` before its ``gdc_wait()`` (a
weight is read before the wait under ``graphtune.ops._pdl``'s contract). The constexpr depends
only on the device (compute capability 9.0 or later, not the interpreter), so a call that
prefetches and one that does not (``pf_chunks == 0``) run the same binary: the tuner compiles
and times the binary the step replays, and ``GRAPHTUNE_L2_PREFETCH=0`` turns the prefetch off
without compiling anything.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from graphtune import env
from graphtune.autotuner.timing import l2_cache_bytes
from graphtune.ops._pdl import device_supports_pdl, is_interpreted

#: Bytes per bulk prefetch instruction (the kernels' immediate operand); a multiple of 16.
CHUNK_BYTES = 16384


@functools.lru_cache(maxsize=16)
def _l2_bytes(device: torch.device) -> int:
    return l2_cache_bytes(device)


def l2_prefetch_compiled(kernel: Any, device: torch.device) -> bool:
    """The ``L2_PREFETCH`` constexpr of ``kernel`` on ``device``: whether its binary carries the
    bulk-prefetch instructions (a CUDA device of compute capability >= 9.0, not interpreted)."""
    return device_supports_pdl(device) and not is_interpreted(kernel)


def prefetchable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is worth and safe to prefetch whole: a contiguous CUDA tensor, 16-byte
    aligned, a multiple of 16 bytes, at least one chunk, and at most half its device's L2 (so
    the kernels running meanwhile keep room, and the prefetched lines survive until read)."""
    nbytes = weight.numel() * weight.element_size()
    return (
        weight.is_cuda
        and weight.is_contiguous()
        and weight.data_ptr() % 16 == 0
        and nbytes % 16 == 0
        and CHUNK_BYTES <= nbytes <= _l2_bytes(weight.device) // 2
    )


def l2_prefetch_args(
    weight: torch.Tensor | None, placeholder: torch.Tensor
) -> tuple[torch.Tensor, int, int]:
    """The ``(pf_ptr, pf_chunks, pf_last)`` launch arguments that prefetch ``weight``.

    ``pf_chunks`` is the number of :data:`CHUNK_BYTES` chunks covering the weight, ``pf_last``
    the byte offset of the last chunk (``nbytes - CHUNK_BYTES``: the last chunk ends at the
    weight's end and overlaps the one before instead of reading past it). Without a weight, when
    it is not :func:`prefetchable`, or when ``GRAPHTUNE_L2_PREFETCH=0``: ``(placeholder, 0, 0)``,
    which issues nothing; ``placeholder`` is any aligned tensor of the launch of the same dtype
    (the pointer's dtype and alignment pick the binary, so the two forms share one).
    """
    if weight is None or not env.l2_prefetch_allowed() or not prefetchable(weight):
        return placeholder, 0, 0
    nbytes = weight.numel() * weight.element_size()
    return weight, -(-nbytes // CHUNK_BYTES), nbytes - CHUNK_BYTES
