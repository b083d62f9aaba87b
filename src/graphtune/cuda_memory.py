"""The caching allocator's reserved bytes, read cheaply: one leaf helper for every layer.

``torch.cuda.memory_reserved`` flattens and sorts every allocator counter into a new dict on each
call, which costs a measurable share of a tuning measurement or a captured piece when read
around each of them. The nested statistics dict holds the same number without that work.
"""

from __future__ import annotations

import torch


def reserved_bytes(device: torch.device | int | None = None) -> int:
    """Bytes the CUDA caching allocator holds on ``device`` (``torch.cuda.memory_reserved``)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return int(stats.get("reserved_bytes", {}).get("all", {}).get("current", 0))
