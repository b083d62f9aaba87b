"""Pure decisions of the graph runner: which sizes to capture, which size a batch pads to, and
whether a call replays, captures lazily or falls back to eager (and why); and the serving
switches that change those decisions (:class:`CapturePolicy`).

Nothing here touches CUDA or holds state, so CPU tests cover every rule directly and the runner's
hot path only does table look-ups built from these functions.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from graphtune.errors import ConfigError


class FallbackReason(str, enum.Enum):
    """Why a call ran ``fn`` eagerly instead of replaying a graph. Values are human-readable."""

    DISABLED = "disabled"
    """``enabled=False`` or ``GRAPHTUNE_DISABLE_GRAPHS=1``."""
    NO_CUDA = "no CUDA"
    """No CUDA device is available (or the backend reports none)."""
    BATCH_TOO_LARGE = "batch too large"
    """The batch is larger than the largest capture size."""
    KEY_NOT_CAPTURED = "key not captured"
    """No graph exists for this (extra key, padded size) and ``lazy`` is off."""
    PREDICATE_REFUSED = "can_graph refused"
    """The user predicate ``can_graph(inputs)`` returned False."""
    CAPTURE_FAILED = "capture failed"
    """Capturing this key failed earlier; the error was logged once and kept in ``stats``."""
    NESTED_CAPTURE = "nested capture"
    """The call happened while a CUDA graph capture was in progress on the current stream."""
    NO_BATCH = "no batch dimension"
    """No input tensor has a leading dimension >= 1, so there is no batch to pad."""
    SIZE_NOT_CAPTURED = "size not captured (padding off)"
    """``CapturePolicy(padding=False)`` and the batch is not one of the capture sizes."""
    NEEDS_GRAD = "input requires grad"
    """Autograd is on and an input requires grad: a replay records no autograd graph, so the
    call runs ``fn`` eagerly and its output carries gradients as eager code would."""
    OUTPUT_NEEDS_GRAD = "output requires grad"
    """Autograd is on and the key's outputs require grad (``fn`` reads a tensor that requires
    grad, such as a parameter it holds), or no capture or eager call of the key with autograd on
    has shown yet whether they do: a replay records no autograd graph, so the call runs ``fn``
    eagerly (see graphs/grad.py)."""
    FROZEN = "frozen (capture refused)"
    """The key would be captured lazily, but :meth:`CUDAGraphRunner.freeze` forbids captures."""
    ROWS_UNDECIDED = "output rows undecided"
    """An output has the same rows ``r`` at every captured size, at most the smallest: it is a
    constant or the batch capped at ``r``, which differ only for a batch below ``r``. The first
    such call of a key runs eagerly and its output's rows decide (then such calls replay)."""
    WARMING_UP = "warm-up (first call of a key)"
    """``lazy=True`` without a ``capture()`` call: a key's first call (of each size, with
    ``CapturePolicy.warm_each_size``) runs eagerly on its own inputs as the warm-up, so ``fn``
    runs once per call; the next call of that size captures."""

    def __str__(self) -> str:
        return self.value


WHEN_FROZEN = ("fallback", "raise")


def static_reason(enabled: bool, available: Callable[[], bool]) -> FallbackReason | None:
    """Why every call of a runner runs eagerly: ``DISABLED`` when not ``enabled`` (the argument,
    or ``GRAPHTUNE_DISABLE_GRAPHS=1``), else ``NO_CUDA`` when the backend is not ``available()``
    (asked only then); None when graphs may be used."""
    if not enabled:
        return FallbackReason.DISABLED
    return None if available() else FallbackReason.NO_CUDA


def frozen_message(what: str, when_frozen: str) -> str:
    """The message of a capture a frozen runner refuses (``what`` would have captured)."""
    return (
        f"{what} would capture a CUDA graph, but the runner is frozen (freeze() was called) "
        f"and CapturePolicy.when_frozen is {when_frozen!r}: capture every size before freeze(), "
        "call unfreeze() first, or use when_frozen='fallback' to run such calls eagerly"
    )


@dataclass(frozen=True)
class CapturePolicy:
    """Serving switches of a :class:`CUDAGraphRunner`, grouped so the constructor stays narrow.

    Attributes:
        padding: True (default) pads a batch up to the nearest captured size. False uses a graph
            only for batches that are exactly a capture size; other batches run eagerly with
            reason ``size not captured (padding off)``.
        when_frozen: What a capture attempt after :meth:`CUDAGraphRunner.freeze` does:
            ``"fallback"`` (default) runs that call eagerly, counted as ``frozen (capture
            refused)``; ``"raise"`` raises :class:`~graphtune.errors.CaptureError`.
        share_output_memory: True (default) returns every graph's outputs to the shared pool
            after its capture, so all sizes write their outputs into memory the others reuse and
            the pool grows with the largest size instead of the sum (outputs stay valid until the
            next call, as documented). False keeps one set of outputs per size (the pool then
            grows with every size's outputs); only for measuring the difference.
        warm_each_size: False (default) runs the ``warmup`` eager calls once, at the largest size,
            before ``capture()`` captures every size. True also runs one eager call at each
            smaller size right before capturing it (none with ``warmup=0``), so per-shape
            first-use work (a library's per-shape set-up, loading a kernel the process had not
            used) happens outside the capture; each size's warm-up is recorded in
            ``CaptureRecord.warmup_seconds``. Lazy capture always warms the size it captures.
        pool_slack_bytes: Spare memory held while the first graph is captured into a fresh
            shared pool and returned to the pool after it, when the runner has more than one
            size; 0 (default) holds none. A smaller size's allocations are a little smaller than
            the largest's, so the caching allocator's best fit may place one of them in a block
            the largest size used for something else; without a spare block, the first request
            that finds no block of its own splits the largest free one (a decode step's logits),
            and the next size's logits need a new one. 10 MiB (the smallest block the allocator
            gives a request of its own outside its small pool) absorbs that drift, at a cost
            that only a step with a large block (such as logits) recovers; graphtune's engine
            sets it for its runners.

    Raises:
        ConfigError: A field has a value outside the documented ones.
    """

    padding: bool = True
    when_frozen: str = "fallback"
    share_output_memory: bool = True
    warm_each_size: bool = False
    pool_slack_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("padding", "share_output_memory", "warm_each_size"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"CapturePolicy.{name} must be True or False, got {getattr(self, name)!r}"
                )
        slack = self.pool_slack_bytes
        if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
            raise ConfigError(
                f"CapturePolicy.pool_slack_bytes must be an int >= 0 (0 turns it off), got "
                f"{slack!r}"
            )
        if self.when_frozen not in WHEN_FROZEN:
            raise ConfigError(
                f"CapturePolicy.when_frozen={self.when_frozen!r} is not one of {WHEN_FROZEN}; "
                "use 'fallback' (run eagerly, counted) or 'raise' (CaptureError)"
            )


class Route(enum.Enum):
    """What a call does when it does not fall back."""

    REPLAY = "replay"
    CAPTURE_THEN_REPLAY = "capture then replay"


class GraphState(enum.Enum):
    """State of one (extra key, size) slot."""

    MISSING = "missing"
    CAPTURED = "captured"
    FAILED = "failed"


# Serving engines (vLLM, SGLang, TensorRT-LLM) capture 1, 2, 4 and then a multiple-of-8 grid: small
# batches are common in decode and cheap to capture, and above 256 a 16-step grid halves the graph
# count while wasting at most 15 rows in several hundred. Above 1024 the step grows with the size
# (16 sizes per doubling), so padding stays under 1/16 of a batch and the graph count grows with
# the logarithm of max_batch_size: a linear grid would capture 60 000 graphs for a million rows.
_SMALL = (1, 2, 4)
_STEP8_LIMIT = 256
_STEP16_LIMIT = 1024
_SIZES_PER_DOUBLING = 16


def default_capture_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Default capture sizes: 1, 2, 4, every 8 up to 256, every 16 up to 1024, then 16 sizes per
    doubling (every 64 up to 2048, every 128 up to 4096, ...), capped at the maximum.

    ``max_batch_size`` itself is always included even when it is off the grid (for example 100 gives
    ``..., 88, 96, 100``), so every batch the runner was told to expect can replay a graph instead
    of falling back with "batch too large".

    Args:
        max_batch_size: Largest batch the runner will be called with; a positive int.

    Returns:
        Sorted, distinct sizes, all ``<= max_batch_size``.

    Raises:
        ConfigError: ``max_batch_size`` is not a positive int.
    """
    _check_max(max_batch_size)
    grid = list(_SMALL) + list(range(8, _STEP8_LIMIT + 1, 8))
    grid += list(range(_STEP8_LIMIT + 16, min(max_batch_size, _STEP16_LIMIT) + 1, 16))
    low = _STEP16_LIMIT
    while low < max_batch_size:
        step = low // _SIZES_PER_DOUBLING
        grid += list(range(low + step, 2 * low + 1, step))
        low *= 2
    sizes = [s for s in grid if s <= max_batch_size]
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return tuple(sizes)


def validate_capture_sizes(sizes: Iterable[int], max_batch_size: int) -> tuple[int, ...]:
    """Sorts, de-duplicates and validates a user's capture sizes.

    A user list is taken as given: ``max_batch_size`` is not appended, so batches above the
    largest listed size fall back to eager ("batch too large").

    Raises:
        ConfigError: The list is empty, holds a non-int or non-positive value, or a value above
            ``max_batch_size``.
    """
    _check_max(max_batch_size)
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise ConfigError(
            f"capture_sizes must be a list of positive ints, got {sizes!r}; "
            "pass e.g. capture_sizes=[1, 2, 4, 8] or leave it None for the default list"
        )
    values = list(sizes)
    if not values:
        raise ConfigError(
            "capture_sizes is empty: at least one size is needed to capture a graph; "
            "leave it None for the default list, or use enabled=False to run eagerly"
        )
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"capture_sizes must hold positive ints, got {value!r}; "
                "remove it or replace it with a batch size >= 1"
            )
        if value > max_batch_size:
            raise ConfigError(
                f"capture size {value} exceeds max_batch_size={max_batch_size}: static buffers "
                "are allocated for max_batch_size rows; raise max_batch_size or drop the size"
            )
    return tuple(sorted(set(values)))


def padded_size(batch: int, sizes: Sequence[int]) -> int | None:
    """Smallest capture size ``>= batch`` (bisect), or ``None`` when the batch is too large.

    Args:
        batch: Real batch size of a call (>= 1).
        sizes: Sorted capture sizes.
    """
    index = bisect.bisect_left(sizes, batch)
    return sizes[index] if index < len(sizes) else None


def padding_table(sizes: Sequence[int], *, padding: bool = True) -> tuple[int, ...]:
    """``table[n]`` is the padded size of batch ``n`` for ``1 <= n <= max(sizes)``.

    The runner indexes this tuple on the hot path instead of bisecting per call. ``table[0]`` is 0
    (an empty batch is never replayed). With ``padding=False`` only the capture sizes map to
    themselves and every other entry is 0 (no graph for that batch).
    """
    largest = sizes[-1]
    table = [0] * (largest + 1)
    if not padding:
        for exact in sizes:
            table[exact] = exact
        return tuple(table)
    for n in range(1, largest + 1):
        size = padded_size(n, sizes)
        assert size is not None  # n <= largest
        table[n] = size
    return tuple(table)


def padding_waste(real_rows: int, padded_rows: int) -> float:
    """Fraction of replayed rows that were padding, in [0, 1] (0 when nothing was replayed)."""
    return (padded_rows - real_rows) / padded_rows if padded_rows else 0.0


def decide(
    *,
    static_reason: FallbackReason | None,
    capturing: bool,
    refused: bool,
    has_plan: bool,
    lazy: bool,
    batch: int | None = None,
    largest_size: int | None = None,
    graph_state: GraphState = GraphState.MISSING,
    size_captured: bool = True,
    frozen: bool = False,
) -> FallbackReason | Route:
    """Decides what one call does. Earlier rules win.

    Order: disabled / no CUDA (``static_reason``), nested capture, user predicate refused, no
    buffers for this extra key (not lazy), no batch dimension, batch too large, batch not a
    capture size (padding off), capture of the key failed earlier, key not captured (or, when
    ``lazy``, refused because the runner is frozen, or captured now), else replay.

    Args:
        static_reason: DISABLED or NO_CUDA when fixed at construction, else None.
        capturing: A CUDA graph capture is in progress on the current stream.
        refused: ``can_graph(inputs)`` returned False.
        has_plan: Static buffers exist for this call's extra key.
        lazy: Missing keys are captured on first use.
        batch: Batch size of the call (None when not known yet).
        largest_size: Largest capture size.
        graph_state: State of the (extra key, padded size) slot.
        size_captured: False when padding is off and the batch is not a capture size.
        frozen: :meth:`CUDAGraphRunner.freeze` was called (no capture may start).

    Returns:
        A FallbackReason (run eagerly) or a Route.
    """
    if static_reason is not None:
        return static_reason
    if capturing:
        return FallbackReason.NESTED_CAPTURE
    if refused:
        return FallbackReason.PREDICATE_REFUSED
    if not has_plan and not lazy:
        return FallbackReason.KEY_NOT_CAPTURED
    if batch is None or batch < 1:
        return FallbackReason.NO_BATCH
    if largest_size is None or batch > largest_size:
        return FallbackReason.BATCH_TOO_LARGE
    if not size_captured:
        return FallbackReason.SIZE_NOT_CAPTURED
    if graph_state is GraphState.FAILED:
        return FallbackReason.CAPTURE_FAILED
    if graph_state is GraphState.MISSING:
        if not lazy:
            return FallbackReason.KEY_NOT_CAPTURED
        return FallbackReason.FROZEN if frozen else Route.CAPTURE_THEN_REPLAY
    return Route.REPLAY


def _check_max(max_batch_size: int) -> None:
    valid = isinstance(max_batch_size, int) and not isinstance(max_batch_size, bool)
    if not valid or max_batch_size < 1:
        raise ConfigError(
            f"max_batch_size must be a positive int, got {max_batch_size!r}; pass the largest "
            "batch the step will be called with, e.g. max_batch_size=256"
        )


def checked_arguments(
    fn: Any, warmup: Any, key_fn: Any, can_graph: Any, backend: Any, policy: Any
) -> CapturePolicy:
    """Checks ``CUDAGraphRunner``'s constructor arguments; returns the policy (the default one
    for ``None``).

    Raises:
        ConfigError: The first argument of the wrong kind, named with what it must be.
    """
    if not callable(fn):
        raise ConfigError(f"fn must be callable, got {type(fn).__name__}; pass the step")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"warmup must be an int >= 0, got {warmup!r}; 2 is typical")
    for name, value in (("key_fn", key_fn), ("can_graph", can_graph)):
        if value is not None and not callable(value):
            raise ConfigError(f"{name} must be callable(inputs) or None, got {value!r}")
    if backend is not None and not callable(getattr(backend, "capture_context", None)):
        raise ConfigError(
            f"backend must be a GraphBackend (graphtune.graphs.backend), got {backend!r}; "
            "leave it None for CUDA graphs"
        )
    if policy is None:
        return CapturePolicy()
    if not isinstance(policy, CapturePolicy):
        raise ConfigError(f"policy must be a CapturePolicy or None, got {policy!r}")
    return policy


def can_graph_decision(value: Any) -> bool:
    """``can_graph``'s answer: a bool or ``numpy.bool_`` (a tensor's truth is ambiguous or a
    sync, so anything else is refused)."""
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    if not isinstance(value, bool):
        raise ConfigError(f"can_graph must return True or False, got {kind.__qualname__}")
    return value


def undecided_message(extra_key: Any, n: int, low: int) -> str:
    """The warning of a lazy capture call of batch ``n`` whose outputs' rows are undecided below
    ``low`` (:attr:`FallbackReason.ROWS_UNDECIDED`), known only from the key's first capture,
    which ran this call's rows: it returns them as captured."""
    return (
        f"the lazy capture of key {extra_key!r} ran this call of batch {n}, and an output with "
        f"{low} rows at every size captured may be a constant or the batch capped at {low}: "
        f"this call got {low} rows, padded rows included if it is capped; the next call below "
        f"{low} rows runs eagerly to tell. Capture a size below {low} (capture_sizes) to avoid it"
    )
