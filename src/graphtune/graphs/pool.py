"""The memory pool a runner's graphs share: capturing each size into it, and making the outputs
kept in it unreadable once it goes (on ``release()``, or when the runner is collected)."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

from graphtune.graphs.backend import GraphBackend
from graphtune.graphs.capture import CapturedGraph, CaptureRecord, capture_key
from graphtune.graphs.keys import KeyState
from graphtune.graphs.memory import RELEASED_MESSAGE
from graphtune.graphs.stats import RunnerStats


class GraphPool:
    """The memory pool every graph of one runner is captured into, and the outputs kept in it.

    Args:
        owner: The runner. When it is collected without a release, its pool goes back to the
            allocator, so the outputs kept in the pool are made unreadable then too.
        backend: The graph implementation.
        share_pool: Capture every graph into one pool; False gives each graph its own.
        share_outputs: Outputs share pool memory (non-owning storages, poisoned on release).
    """

    def __init__(
        self, owner: object, backend: GraphBackend, *, share_pool: bool, share_outputs: bool
    ) -> None:
        self._backend = backend
        self._share_pool = share_pool
        self._share_outputs = share_outputs
        self._pool: Any = None
        # The non-owning output storages of every graph captured since the last release(): they
        # are poisoned on release(), and by this finalizer when the runner is collected without
        # one (its pool goes back to the allocator then, and a kept output would read whatever
        # reuses that memory). The finalizer holds the list and the backend, never the runner.
        self._shared: list[Any] = []
        weakref.finalize(owner, _invalidate, backend, self._shared)

    @property
    def allocated(self) -> bool:
        """Whether a shared pool exists (made by the first capture since the last release)."""
        return self._pool is not None

    def capture(
        self,
        fn: Callable[..., Any],
        key_state: KeyState,
        size: int,
        *,
        device: Any,
        counters: RunnerStats,
        slack_bytes: int,
        warmup_seconds: float,
    ) -> CapturedGraph | CaptureRecord:
        """Captures ``size`` of ``key_state`` (see :func:`~graphtune.graphs.capture.capture_key`)
        into the shared pool, made first when there is none, with ``slack_bytes`` held then.

        Returns the graph, or the record of a failed capture; both carry ``warmup_seconds``.
        """
        slack = 0
        if self._share_pool and self._pool is None:
            self._pool = self._backend.new_pool(device)
            slack = slack_bytes
        result = capture_key(
            self._backend,
            fn,
            key_state.inputs.static_args(size),
            extra_key=key_state.extra_key,
            size=size,
            pool=self._pool if self._share_pool else None,
            device=device,
            buffers=key_state.breaks,
            counters=counters,
            share_outputs=self._share_outputs,
            slack_bytes=slack,
        )
        if isinstance(result, CapturedGraph):
            result.record = dataclasses.replace(result.record, warmup_seconds=warmup_seconds)
            self._shared.extend(result.shared)
            return result
        if self._share_pool:
            # When capture_end fails (an invalidated capture: a host sync inside fn), torch
            # never tells the caching allocator that the capture ended, so every later
            # capture into this pool fails with "already recording to mempool_id" (seen on
            # torch 2.11). Graphs captured so far keep their pool; later sizes get a new one.
            self._pool = None
        return dataclasses.replace(result, warmup_seconds=warmup_seconds)

    def release(self) -> None:
        """Makes every kept output raise on access and drops the pool (no replay may still
        read it: synchronise first)."""
        _invalidate(self._backend, self._shared)
        self._pool = None


def _invalidate(backend: GraphBackend, shared: list[Any]) -> None:
    """Makes every kept output of the storages in ``shared`` raise on access, and forgets them."""
    if shared:
        backend.invalidate(list(shared), RELEASED_MESSAGE)
        shared.clear()
