"""Capturing one key: the product is a :class:`CapturedGraph`, or a recorded failure.

Rules applied here, where the work happens:

* Warm-up runs eagerly on the backend's side stream before any capture (see
  :meth:`CudaGraphBackend.warmup`).
* Sizes are captured largest first into one pool. After each capture the runner keeps the graph's
  outputs (and the tensors its graph breaks read) only as non-owning twins (see memory.py), so
  their blocks go back to the pool and the next, smaller capture reuses them: the pool grows to
  about the largest graph alone instead of the sum of all graphs' outputs.
* The garbage collector is *frozen* (``gc.freeze()``, undone by ``gc.unfreeze()``; left as it
  is when the application froze it already) rather than only disabled, and automatic collection
  is disabled for the duration (restored as it was): a collection that runs mid-capture could
  free a tensor from another stream's memory at an arbitrary point, and freezing also makes any
  ``gc.collect()`` that runs during capture skip the whole existing heap (it only scans objects
  created since the freeze).
* No device synchronisation and no emptying of the allocator cache per size: the capture stream
  is ordered after the caller's stream by an event, and the pool bytes a capture added are the
  growth of the allocator's reserved bytes while its pieces were captured. That count is exact
  when nothing else allocates device memory meanwhile (other threads may not use CUDA during a
  capture anyway); an allocation on another stream inside the step would be counted too.
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
from graphtune.graphs.breaks import BreakBuffers, BreakCounters, PieceCapture
from graphtune.graphs.grad import detached, outputs_need_grad
from graphtune.graphs.memory import Disowner
from graphtune.graphs.outputs import StaticOutputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureRecord:
    """What capturing one key did.

    Attributes:
        extra_key: The ``key_fn`` value (None without ``key_fn``).
        size: Padded batch size of the graph.
        seconds: Wall time of the capture (not counting warm-up): the sum of the phases below.
        pool_bytes: Bytes the device's reserved memory grew by during the capture: what this
            graph added to the pool beyond the memory it could reuse.
        ok: Whether the capture succeeded.
        error: One-line error summary when it failed.
        record_seconds: Running the step's code under capture (Python, kernel launches, and
            first-use work such as loading a kernel the process had not used yet).
        finish_seconds: Ending captures: end of stream capture and graph instantiation.
        break_seconds: At graph breaks: running the piece before, the break and its copies.
        account_seconds: Reading allocator statistics and building non-owning outputs.
        warmup_seconds: The eager warm-up run just before this capture (not part of
            ``seconds``; a key's warm-up in ``capture()`` belongs to its first, largest size).
        pieces: Graphs this key replays (breaks + 1).
        breaks: Graph breaks run eagerly per replay.
        shared_outputs: Whether every output with memory went back to the pool (see
            ``CapturePolicy``; an ``nn.Parameter`` or a tensor that requires grad is kept).
        ran_pieces: Pieces of ``fn`` that ran on the captured rows (at graph breaks), also when
            the capture then failed.
    """

    extra_key: Hashable
    size: int
    seconds: float
    pool_bytes: int
    ok: bool
    error: str | None = None
    record_seconds: float = 0.0
    finish_seconds: float = 0.0
    break_seconds: float = 0.0
    account_seconds: float = 0.0
    warmup_seconds: float = 0.0
    pieces: int = 1
    breaks: int = 0
    shared_outputs: bool = False
    ran_pieces: int = 0

    @property
    def key(self) -> tuple[Hashable, int]:
        """``(extra_key, size)``."""
        return (self.extra_key, self.size)


class CapturedGraph:
    """One captured key and the outputs it writes.

    Attributes:
        key: ``(extra_key, size)``.
        graph: The backend graph, or a :class:`~graphtune.graphs.breaks.PiecewiseGraph`.
        replay: Bound replay method of ``graph`` (called on the hot path).
        outputs: The static outputs, sliced per real batch by :meth:`StaticOutputs.result`.
        record: The capture record.
        shared: Non-owning storages of this key's outputs and break inputs (invalidated by
            ``release()``); empty when the outputs own their memory.
        needs_grad: Whether the captured outputs required grad (``fn`` read a tensor that
            requires grad, with autograd on); ``outputs`` hold them detached (grad.py).
    """

    __slots__ = ("key", "graph", "replay", "outputs", "record", "shared", "needs_grad")

    def __init__(
        self,
        key: tuple,
        graph: Any,
        outputs: StaticOutputs,
        record: CaptureRecord,
        shared: list | None = None,
        needs_grad: bool = False,
    ) -> None:
        self.key = key
        self.graph = graph
        self.replay = graph.replay
        self.outputs = outputs
        self.record = record
        self.shared = shared or []
        self.needs_grad = needs_grad


@contextmanager
def frozen_gc(collect: bool = False) -> Iterator[None]:
    """Freezes the garbage collector for the block (see the module docstring for why)."""
    was_enabled = gc.isenabled()
    # An application's own gc.freeze() (a pre-fork server's) must outlive the block, and
    # unfreeze() cannot undo only this block's freeze: then only collection is disabled.
    ours = gc.get_freeze_count() == 0
    if collect:
        gc.collect()
    if ours:
        gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if ours:
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
    buffers: BreakBuffers,
    counters: BreakCounters,
    share_outputs: bool,
    slack_bytes: int = 0,
) -> CapturedGraph | CaptureRecord:
    """Captures ``fn(*args)`` for one key, as one graph or as pieces split at graph breaks.

    Args:
        buffers: Static outputs of graph breaks for this extra key.
        counters: Where replays count their breaks (the runner's stats).
        share_outputs: Keep outputs and break inputs as non-owning twins (see memory.py).
        slack_bytes: Spare pool memory held during this capture and freed after it
            (``CapturePolicy.pool_slack_bytes``; 0: none).

    Returns:
        A CapturedGraph, or a failed CaptureRecord (already logged) when the capture raised.
    """
    start = time.perf_counter()
    session = PieceCapture(backend, pool, device, buffers, size, slack_bytes)
    try:
        with backend.capture_context(device, args):
            try:
                outputs = session.run(fn, args)
            except BaseException:
                session.abort()
                raise
        needs_grad = outputs_need_grad(outputs)
        if needs_grad:  # replays record no autograd: the capture's grad_fn would be stale
            outputs = detached(outputs)
        # The outputs' structure is rebuilt on every replay: one that cannot be rebuilt fails
        # here, as a capture, instead of in every call.
        static = StaticOutputs(outputs, size)
        static.result(size, clone=False)
    except Exception as exc:  # any failure of user code or CUDA: recorded, never raised
        return _failed(backend, device, exc, extra_key, size, start, session.executed)
    shared: list = []
    all_shared = False
    if share_outputs:
        accounted = time.perf_counter()
        twins = Disowner(backend.device_type)
        try:
            outputs = twins.tree(outputs)
            static = StaticOutputs(outputs, size)
        except Exception as exc:  # recorded like a failure of the step
            return _failed(backend, device, exc, extra_key, size, start, session.executed)
        all_shared = twins.kept == 0
        for brk in session.breaks:
            brk.args, brk.kwargs = twins.break_args(brk.args, brk.kwargs)
        shared = twins.storages
        backend.share_memory(pool, session.pieces, shared)
        session.account_seconds += time.perf_counter() - accounted
    record = CaptureRecord(
        extra_key,
        size,
        time.perf_counter() - start,
        session.pool_bytes,
        ok=True,
        record_seconds=session.record_seconds,
        finish_seconds=session.finish_seconds,
        break_seconds=session.break_seconds,
        account_seconds=session.account_seconds,
        pieces=len(session.pieces),
        breaks=len(session.breaks),
        shared_outputs=all_shared,
        ran_pieces=session.executed,
    )
    graph = session.graph(counters)
    return CapturedGraph((extra_key, size), graph, static, record, shared, needs_grad)


def _failed(
    backend: GraphBackend,
    device: Any,
    exc: Exception,
    extra_key: Hashable,
    size: int,
    start: float,
    ran_pieces: int,
) -> CaptureRecord:
    """The record of a failed capture (logged once); the backend recovers its stream."""
    seconds = time.perf_counter() - start
    message = describe_failure(exc, extra_key=extra_key, size=size)
    del exc
    logger.warning("%s", message)
    backend.recover(device)
    gc.collect()  # drop cycles through the failed frames that still pin pool memory
    return CaptureRecord(
        extra_key, size, seconds, 0, ok=False, error=message, ran_pieces=ran_pieces
    )


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
    "run the part that cannot be captured eagerly with graphtune.graphs.graph_break; "
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
