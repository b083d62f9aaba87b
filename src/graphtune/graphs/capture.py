"""Capturing one key: the product is a :class:`CapturedGraph`, or a recorded failure.

Rules applied here, where the work happens:

* Warm-up runs eagerly on the backend's side stream before any capture (see
  :meth:`CudaGraphBackend.warmup`).
* Sizes are captured largest first into one pool: the largest graph's intermediate blocks are
  freed at the end of its capture and the smaller graphs reuse them, so the pool grows to roughly
  the largest graph plus every graph's live outputs instead of the sum of all graphs.
* The garbage collector is *frozen* (``gc.collect(); gc.freeze()``, undone by ``gc.unfreeze()``)
  rather than only disabled: a collection that runs mid-capture could free a tensor from another
  stream's memory at an arbitrary point, and freezing also makes the ``gc.collect()`` that some
  PyTorch versions run at every ``torch.cuda.graph`` entry skip the whole existing heap (it only
  scans objects created since the freeze), which keeps capturing 35 sizes fast in a large process.
  Automatic collection is disabled as well for the duration, and restored as it was.
* A failure is data: the error text is kept (not the exception, whose traceback would pin the
  failed capture's tensors and graph), logged once, and the backend recovers its stream.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import time
import traceback
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from graphtune.graphs.backend import GraphBackend
from graphtune.graphs.buffers import StaticOutputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureRecord:
    """What capturing one key did.

    Attributes:
        extra_key: The ``key_fn`` value (None without ``key_fn``).
        size: Padded batch size of the graph.
        seconds: Wall time of the capture (not counting warm-up).
        pool_bytes: Bytes the device's reserved memory grew by during the capture (graph pool).
        ok: Whether the capture succeeded.
        error: One-line error summary when it failed.
    """

    extra_key: Hashable
    size: int
    seconds: float
    pool_bytes: int
    ok: bool
    error: str | None = None

    @property
    def key(self) -> tuple[Hashable, int]:
        """``(extra_key, size)``."""
        return (self.extra_key, self.size)


class CapturedGraph:
    """One captured graph and the outputs it writes.

    Attributes:
        key: ``(extra_key, size)``.
        replay: Bound replay method of the backend graph (called on the hot path).
        outputs: The static outputs, sliced per real batch by :meth:`StaticOutputs.result`.
        record: The capture record.
    """

    __slots__ = ("key", "graph", "replay", "outputs", "record")

    def __init__(self, key: tuple, graph: Any, outputs: StaticOutputs, record: CaptureRecord):
        self.key = key
        self.graph = graph
        self.replay = graph.replay
        self.outputs = outputs
        self.record = record


@contextmanager
def frozen_gc(collect: bool = True) -> Iterator[None]:
    """Freezes the garbage collector for the block (see the module docstring for why)."""
    was_enabled = gc.isenabled()
    if collect:
        gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def capture_key(
    backend: GraphBackend,
    fn: Callable,
    args: tuple,
    *,
    extra_key: Hashable,
    size: int,
    pool: Any,
    device: Any,
) -> CapturedGraph | CaptureRecord:
    """Captures ``fn(*args)`` for one key.

    Returns:
        A CapturedGraph, or a failed CaptureRecord (already logged) when the capture raised.
    """
    backend.synchronize(device)
    backend.empty_cache()  # so the reserved-bytes delta below counts only the graph pool
    before = backend.memory_reserved(device)
    start = time.perf_counter()
    try:
        graph, outputs = backend.capture(fn, args, pool, device)
    except Exception as exc:  # any failure of user code or CUDA: recorded, never raised
        seconds = time.perf_counter() - start
        message = describe_failure(exc, extra_key=extra_key, size=size)
        del exc
        logger.warning("%s", message)
        backend.recover(device)
        gc.collect()  # drop cycles through the failed frames that still pin pool memory
        return CaptureRecord(extra_key, size, seconds, 0, ok=False, error=message)
    backend.synchronize(device)
    seconds = time.perf_counter() - start
    pool_bytes = max(0, backend.memory_reserved(device) - before)
    record = CaptureRecord(extra_key, size, seconds, pool_bytes, ok=True)
    return CapturedGraph((extra_key, size), graph, StaticOutputs(outputs, size), record)


# (pattern in the error chain, what it means) — the first match explains the failure.
_KNOWN_CAUSES = (
    (
        r"not permitted when stream is capturing|StreamCaptureUnsupported|"
        r"between CPU and CUDA tensors during CUDA graph capture|synchroniz\w* .*capturing",
        "a host synchronisation or host copy ran inside fn (.item(), .cpu(), .tolist(), "
        "bool(tensor), torch.nonzero, printing a CUDA tensor, torch.cuda.synchronize)",
    ),
    (r"out of memory|OutOfMemoryError", "the device ran out of memory while capturing"),
    (r"StreamCaptureImplicit|implicitly", "an op used the legacy default stream during capture"),
    (
        r"capture.*invalidated|StreamCaptureInvalidated|operation failed due to a previous error",
        "an earlier illegal operation invalidated the capture",
    ),
    (r"StreamCaptureWrongThread|capture_error_mode", "another thread used CUDA during capture"),
    (r"graph capture|capturing", "an op that CUDA graphs cannot capture ran inside fn"),
)

_REMEDIES = (
    "remedies: remove host synchronisations from the step (keep values on the GPU); "
    "use a smaller max_batch_size or fewer capture_sizes; use lazy=True to capture only sizes "
    "that are used; refuse this key with can_graph=... or run eagerly with enabled=False "
    "(GRAPHTUNE_DISABLE_GRAPHS=1)"
)


def describe_failure(exc: BaseException, *, extra_key: Hashable, size: int) -> str:
    """One message naming the key, the root error, the op's source line if known, and remedies."""
    chain = _exception_chain(exc)
    texts = [
        f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        for e in chain
    ]
    cause = None
    joined = "\n".join(f"{type(e).__name__}: {e}" for e in chain)
    for pattern, meaning in _KNOWN_CAUSES:
        if re.search(pattern, joined, flags=re.IGNORECASE):
            cause = meaning
            break
    where = _user_frame(chain)
    key = f"size {size}" if extra_key is None else f"key {extra_key!r}, size {size}"
    parts = [f"CUDA graph capture failed for {key}; this key runs eagerly from now on."]
    if where:
        parts.append(f"Failing op: {where}.")
    if cause:
        parts.append(f"Likely cause: {cause}.")
    parts.append("Error: " + " <- ".join(texts[:3]) + ".")
    parts.append(_REMEDIES + ".")
    return " ".join(parts)


def _exception_chain(exc: BaseException) -> list[BaseException]:
    """The root cause first: torch's capture_end error is raised *during* handling of the
    original error from fn, so the original sits in ``__context__``."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain and len(chain) < 8:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return list(reversed(chain))


# Frames inside graphtune or torch are skipped when naming the failing op.
_GRAPHTUNE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_PART = f"{os.sep}torch{os.sep}"


def _user_frame(chain: list[BaseException]) -> str | None:
    """Innermost traceback frame outside torch and graphtune, e.g. ``model.py:42 in step:
    x.sum().item()`` — the line that issued the op that could not be captured."""
    for error in chain:
        frames = traceback.extract_tb(error.__traceback__)
        for frame in reversed(frames):
            filename = frame.filename
            if filename.startswith(_GRAPHTUNE_DIR) or _TORCH_PART in filename:
                continue
            line = (frame.line or "").strip()
            where = f"{os.path.basename(filename)}:{frame.lineno} in {frame.name}"
            return f"{where}: {line}" if line else where
    return None
