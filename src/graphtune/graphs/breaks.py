"""Breakable graphs: parts of a step that run eagerly between captured pieces, without a compiler.

A step marks a region that must not be captured (variable-length attention, a host sync, a
library call that cannot be captured for every shape) by calling it through :func:`graph_break`,
as a decorator or as ``graph_break(fn, *args)``. Outside a runner's capture that is an ordinary
call. While a :class:`CUDAGraphRunner` captures a key, each break:

1. ends the capture of the current piece and runs that piece once, so the break sees real data;
2. runs the break eagerly on its arguments (outside any capture); when a non-tensor result is
   not equal to itself (its ``==`` is False for itself), runs it once more and fails the capture
   (the key's calls then run eagerly) unless that result is the very same object again, the only
   way a replay could match it;
3. copies the break's tensor results into static buffers and hands those to the rest of the step;
4. starts capturing the next piece into the same pool.

A replay of the key then replays piece 0, runs each break again on the very tensors it was given
at capture (their addresses are fixed, and the piece before wrote them) and copies its results
into the same static buffers, replays the next piece, and so on. Replay order equals capture
order, so pieces may share pool memory exactly as graphs of different sizes do. A step with no
break is one piece: the same single graph as before, replayed the same way.

Static break outputs of every size share one buffer per (break, output) when the output's leading
dimension is the batch and its layout is the plain contiguous one (:class:`BreakBuffers`);
anything else gets a buffer of its own with the result's exact strides, so the pieces after a
break see the same layout as eager code and stay bit-exact.
"""

from __future__ import annotations

import contextvars
import functools
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from graphtune.errors import ConfigError, InputError
from graphtune.graphs.tree import TreeSpec, flatten_with_paths
from graphtune.graphs.values import equal_to_itself, same_constant

_clock = time.perf_counter


class BreakHost(Protocol):
    """What :func:`graph_break` needs from the capture in progress (a :class:`PieceCapture`)."""

    def run_break(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any: ...


_ACTIVE: contextvars.ContextVar[BreakHost | None] = contextvars.ContextVar(
    "graphtune_graph_break_host", default=None
)


def graph_break(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs ``fn`` eagerly between captured pieces when a graph runner is capturing.

    Two forms:

    * ``graph_break(fn, *args, **kwargs)`` calls ``fn(*args, **kwargs)`` (a break point);
    * ``graph_break(fn)`` with no arguments returns ``fn`` wrapped so that every call is a break
      point (use it as a decorator). A break with no arguments is ``graph_break(fn)()``.

    Outside a :class:`CUDAGraphRunner` capture (eager calls, warm-up, fallbacks, replays of
    other code) this is a plain call. Rules for ``fn``: it may do anything eager code may
    (synchronise, branch on host data, launch uncapturable kernels); at replay it is called again
    with the same argument tensors, whose contents the piece before it has just written; its
    tensor results must keep their shape and dtype for a given key (they are copied into static
    buffers); return new tensors, not views of tensors that later code modifies, because the rest
    of the step sees copies.

    Returns:
        ``fn``'s result (static copies of its tensors while capturing), or the wrapper.
    """
    if not callable(fn):
        raise ConfigError(f"graph_break needs a callable, got {type(fn).__name__}")
    if not args and not kwargs:

        @functools.wraps(fn)
        def breaking(*call_args: Any, **call_kwargs: Any) -> Any:
            return _call(fn, call_args, call_kwargs)

        return breaking
    return _call(fn, args, kwargs)


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    host = _ACTIVE.get()
    if host is None:
        return fn(*args, **kwargs)
    return host.run_break(fn, args, kwargs)


class BreakCounters(Protocol):
    """Where a piecewise replay counts its breaks (:class:`RunnerStats` has these fields)."""

    break_runs: int
    break_seconds: float


class Break:
    """One break of one captured key: its callable, recorded arguments and static outputs."""

    __slots__ = ("fn", "args", "kwargs", "spec", "copies", "constants", "single", "own_bytes")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        spec: TreeSpec,
        copies: list[tuple[int, torch.Tensor]],
        constants: list[tuple[int, Any]],
        own_bytes: int = 0,
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.spec = spec
        self.copies = copies
        self.constants = constants
        self.single = copies[0][1] if spec.is_leaf and copies else None
        self.own_bytes = own_bytes  # static outputs held by this break alone (not shared)

    @property
    def name(self) -> str:
        """The break callable's name (for messages)."""
        return getattr(self.fn, "__qualname__", None) or repr(self.fn)

    def run(self) -> None:
        """Runs the break eagerly on its recorded arguments; copies results into the statics."""
        result = self.fn(*self.args, **self.kwargs)
        single = self.single
        if single is not None:
            if (
                not isinstance(result, torch.Tensor)
                or result.shape != single.shape
                or result.dtype != single.dtype
                or result.device != single.device
            ):
                raise self._changed(0, single, result)
            single.copy_(result)
            return
        leaves = self.spec.flatten(result, root=f"result of graph break {self.name}")
        for index, static in self.copies:
            got = leaves[index]
            if (
                not isinstance(got, torch.Tensor)
                or got.shape != static.shape
                or got.dtype != static.dtype
                or got.device != static.device
            ):
                raise self._changed(index, static, got)
            static.copy_(got)
        for index, value in self.constants:
            got = leaves[index]
            if got is not value and not same_constant(got, value):
                if not equal_to_itself(value):
                    raise _incomparable(self.name, index, value)
                raise self._changed(index, value, got)

    def _changed(self, index: int, captured: Any, got: Any) -> InputError:
        return InputError(
            f"graph break {self.name} returned {_describe(got)} as output {index} at replay but "
            f"{_describe(captured)} at capture: the pieces after a break were captured reading "
            "its results, so they must keep their structure, shapes and dtypes for a given key; "
            "make them depend only on the batch size, or return the varying part from key_fn"
        )


def _incomparable(name: str, index: int, value: Any) -> InputError:
    return InputError(
        f"graph break {name} returned a new {type(value).__name__} as output {index} at replay, "
        f"and the one it returned at capture ({value!r:.80}) is not equal to itself: the pieces "
        "after a break were captured with its non-tensor results, so every replay checks that "
        "they did not change, and such a value matches only itself; return that very object at "
        "every call, return it as a tensor, or compute it outside the break"
    )


def _check_incomparable(fn: Callable[..., Any], args: tuple, kwargs: dict, leaves: list) -> None:
    """Decides at capture whether the break's constant results that are not equal to themselves
    (an ``__eq__`` that is False for itself) can be checked at replay, where only the very same
    object matches them: runs the break once more on the same arguments (only when it returned
    such a value, and as each replay will) and accepts a value it returned again as the same
    object (a cached marker); a new object at each call would fail every replay, so the capture
    fails instead (its calls then run eagerly).

    Raises:
        InputError: The second run returned another object at such an output.
    """
    odd = [
        i
        for i, leaf in enumerate(leaves)
        if not isinstance(leaf, torch.Tensor) and not equal_to_itself(leaf)
    ]
    if not odd:
        return
    again = flatten_with_paths(fn(*args, **kwargs))[0]
    for index in odd:
        if index >= len(again) or again[index] is not leaves[index]:
            name = getattr(fn, "__qualname__", None) or repr(fn)
            raise InputError(
                f"graph break {name} returned a new {type(leaves[index]).__name__} as output "
                f"{index} at each call, a value not equal to itself ({leaves[index]!r:.80}): "
                "the pieces after a break are captured with its non-tensor results and every "
                "replay checks that they did not change, which such a value passes only as the "
                "very same object, so this capture fails and its calls run eagerly; return that "
                "very object at every call, return it as a tensor, or compute it outside the break"
            )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return repr(value)


def _plain_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a view of a shared buffer's rows has
    them), computed as torch does: a dimension of size 0 counts as 1."""
    strides: list[int] = []
    step = 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


class BreakBuffers:
    """Static outputs of the breaks of one extra key, shared by all its sizes where possible.

    Attributes:
        rows: Rows of a shared buffer (the largest capture size).
        nbytes: Bytes of the shared buffers (a break's own buffers count in ``Break.own_bytes``).
    """

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.nbytes = 0
        self._shared: dict[tuple[int, int], torch.Tensor] = {}

    def static_for(
        self, break_index: int, leaf_index: int, like: torch.Tensor, size: int
    ) -> tuple[torch.Tensor, bool]:
        """A buffer with ``like``'s shape, dtype, device and strides to hold this output, and
        whether it is the caller's own (True) or a view of a shared buffer (False)."""
        # The layout is checked first: a shared buffer allocated for an output that cannot use
        # it would stay allocated (and counted in buffer_bytes) for nothing.
        if (
            like.dim() >= 1
            and like.shape[0] == size
            and size <= self.rows
            and like.stride() == _plain_strides(like.shape)
        ):
            key = (break_index, leaf_index)
            shared = self._shared.get(key)
            if shared is None:
                shared = torch.empty(
                    (self.rows, *like.shape[1:]), dtype=like.dtype, device=like.device
                )
                self._shared[key] = shared
                self.nbytes += shared.numel() * shared.element_size()
            if shared.dtype == like.dtype and shared.device == like.device:
                view = shared[:size]
                if view.shape == like.shape and view.stride() == like.stride():
                    return view, False
        return torch.empty_like(like), True  # keeps like's strides when it is dense


class PieceCapture:
    """Captures one key's call of ``fn`` as pieces split at graph breaks.

    Attributes:
        pieces: Backend graphs, in capture (and replay) order.
        breaks: The breaks between them (``len(pieces) == len(breaks) + 1`` after :meth:`run`).
        record_seconds: Time spent running ``fn``'s code under capture.
        finish_seconds: Time spent ending captures (end of capture and instantiation).
        break_seconds: Time spent at breaks (running the piece before, the break, the copies).
        account_seconds: Time spent reading memory statistics.
        pool_bytes: Bytes the device's reserved memory grew by while pieces were being captured.
        executed: Pieces run on the captured rows at breaks (a break reads what they computed).
    """

    def __init__(
        self,
        backend: Any,
        pool: Any,
        device: Any,
        buffers: BreakBuffers,
        size: int,
        slack_bytes: int = 0,
    ) -> None:
        self._backend = backend
        self._slack_bytes = slack_bytes
        self._pool = pool
        self._device = device
        self._buffers = buffers
        self._size = size
        self._open: Any = None
        self._reserved_before = 0
        self._started = 0.0
        self.pieces: list[Any] = []
        self.breaks: list[Break] = []
        self.record_seconds = 0.0
        self.finish_seconds = 0.0
        self.break_seconds = 0.0
        self.account_seconds = 0.0
        self.pool_bytes = 0
        self.executed = 0

    def run(self, fn: Callable[..., Any], args: tuple) -> Any:
        """Runs ``fn(*args)`` under capture, with this object answering its graph breaks."""
        token = _ACTIVE.set(self)
        try:
            self._begin()
            # Allocated first, so in a new segment of the pool; freed after the capture, so
            # the next sizes find it (see CapturePolicy.pool_slack_bytes).
            slack = self._backend.hold_slack(self._device, self._slack_bytes)
            outputs = fn(*args)
            self._end()
            del slack
        finally:
            _ACTIVE.reset(token)
        return outputs

    def run_break(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Ends the current piece, runs the break eagerly, starts the next piece."""
        self._end()
        start = _clock()
        self._backend.execute(self.pieces[-1])
        self.executed += 1
        token = _ACTIVE.set(None)  # a break inside the break is an ordinary call
        try:
            result = fn(*args, **kwargs)
            leaves, _, spec = flatten_with_paths(result)
            _check_incomparable(fn, args, kwargs, leaves)
        finally:
            _ACTIVE.reset(token)
        statics: list[Any] = []
        copies: list[tuple[int, torch.Tensor]] = []
        constants: list[tuple[int, Any]] = []
        own_bytes = 0
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                static, own = self._buffers.static_for(len(self.breaks), index, leaf, self._size)
                if own:
                    own_bytes += static.untyped_storage().nbytes()
                static.copy_(leaf)
                statics.append(static)
                copies.append((index, static))
            else:  # a replay checks it (same_constant: the same object, or an equal one)
                statics.append(leaf)
                constants.append((index, leaf))
        self.breaks.append(Break(fn, args, kwargs, spec, copies, constants, own_bytes))
        del result, leaves
        self.break_seconds += _clock() - start
        self._begin()
        return spec.unflatten(statics)

    def abort(self) -> None:
        """Ends a capture left open by a failure and drops the pieces captured so far."""
        if self._open is not None:
            graph, self._open = self._open, None
            self._backend.abort_capture(graph, self._device)
        self.pieces.clear()
        self.breaks.clear()

    def graph(self, counters: BreakCounters) -> Any:
        """The object to replay: the single backend graph, or a :class:`PiecewiseGraph`."""
        if not self.breaks:
            return self.pieces[0]
        return PiecewiseGraph(self.pieces, self.breaks, counters)

    def _begin(self) -> None:
        start = _clock()
        self._reserved_before = self._backend.memory_reserved(self._device)
        self._started = _clock()
        self.account_seconds += self._started - start
        self._open = self._backend.begin_capture(self._pool, self._device)

    def _end(self) -> None:
        start = _clock()
        self.record_seconds += start - self._started
        self._backend.end_capture(self._open)
        self.pieces.append(self._open)
        self._open = None
        ended = _clock()
        self.finish_seconds += ended - start
        grown = self._backend.memory_reserved(self._device) - self._reserved_before
        self.pool_bytes += max(0, grown)
        self.account_seconds += _clock() - ended


class PiecewiseGraph:
    """Replays the pieces of one key with its breaks run eagerly in between.

    Attributes:
        pieces: Backend graphs in replay order.
        breaks: Breaks; break ``i`` runs after piece ``i``.
    """

    __slots__ = ("pieces", "breaks", "_replays", "_counters")

    def __init__(self, pieces: list[Any], breaks: list[Break], counters: BreakCounters) -> None:
        self.pieces = list(pieces)
        self.breaks = list(breaks)
        self._replays = [piece.replay for piece in self.pieces]
        self._counters = counters

    def replay(self) -> None:
        """Replays every piece in order, running each break between its neighbours."""
        replays = self._replays
        replays[0]()
        spent = 0.0
        for brk, replay in zip(self.breaks, replays[1:], strict=True):
            start = _clock()
            brk.run()
            spent += _clock() - start
            replay()
        counters = self._counters
        counters.break_runs += len(self.breaks)
        counters.break_seconds += spent


def finish_capture_call(backend: Any, graph: Any) -> None:
    """Computes what capturing a call left undone, so the call runs ``fn`` exactly once: nothing
    on a backend whose capture computes; the last piece of a piecewise graph (the pieces before
    each break ran at the break, and the breaks ran); a whole replay of a plain graph."""
    if getattr(backend, "capture_computes", False):
        return
    if isinstance(graph, PiecewiseGraph):
        backend.execute(graph.pieces[-1])
    else:
        graph.replay()
