"""Persistent arrival counters for kernels whose last program finishes a row's work.

A kernel that splits one row's work over several programs (decode attention's inline merge, the
fused MoE router) can finish the row in whichever program arrives last: each program takes a
ticket from the row's int32 counter, and the one holding the last ticket does the row's final
step and resets the counter to 0. The counters must be zero between calls and must not be
allocated or zero-filled per call (a CUDA graph replays the kernel, not the fill), so each owner
gets one zeroed buffer per device, allocated once at full size.

Each owner has its own buffer, so two such kernels never share a counter even if they run at the
same time on two streams.
"""

from __future__ import annotations

import threading

import torch

from graphtune.errors import InputError

#: Counters per (owner, device): 256 KiB, enough for 65536 rows, so a buffer never grows and is
#: never allocated inside a graph capture after its first use.
COUNTER_ROWS = 1 << 16

_COUNTERS: dict[tuple[str, str], torch.Tensor] = {}
_LOCK = threading.Lock()


def arrival_counters(device: torch.device, rows: int, *, owner: str, hint: str) -> torch.Tensor:
    """The zeroed int32 counters ``[COUNTER_ROWS]`` of ``owner`` on ``device``.

    Args:
        device: Where the kernel runs.
        rows: Counters the launch needs (rows ``[0, rows)`` are used).
        owner: Which kernel's buffer (its runner or op name).
        hint: What to do instead when ``rows`` is too large (the end of the error).

    Raises:
        InputError: More than :data:`COUNTER_ROWS` rows.
    """
    if rows > COUNTER_ROWS:
        raise InputError(
            f"{owner}: {rows} rows exceed the {COUNTER_ROWS} arrival counters; {hint}."
        )
    key = (owner, str(device))
    with _LOCK:
        found = _COUNTERS.get(key)
        if found is None:
            found = _COUNTERS[key] = torch.zeros(COUNTER_ROWS, device=device, dtype=torch.int32)
    return found
