"""A graph backend without CUDA, for exercising the graph runner on CPU.

A simulated capture runs the step's code once and *records* every ATen op it dispatches (a
``TorchDispatchMode``), with the very tensors the op read and wrote. A replay re-executes the
recorded ops on those tensors and writes each op's fresh result into the tensor the op returned at
capture: exactly what a CUDA graph replay does to memory (same kernels, same addresses), so padding,
stale rows, slicing, output aliasing, graph breaks and fallbacks behave as with real graphs; only
speed differs. Triton kernels run by the CPU interpreter (``TRITON_INTERPRET=1``) write through raw
pointers that no ATen op shows, so their launches are recorded as launches and run again at replay,
like a graph's kernel nodes. Python code of the step does not run at replay, as on a GPU, and a host
synchronisation inside a capture (``.item()``, ``bool(tensor)``, ``torch.nonzero``, ``.tolist()``,
``.numpy()``) fails the capture with the CUDA error text. Unlike a CUDA capture, a simulated one
computes what it records; each capture saves what it overwrites in memory that existed before it,
so that :meth:`SimulatedGraphBackend.discard_capture` can undo a capture the runner cannot use.

Memory sharing is modelled pessimistically: storages the runner gives back to the pool
(:meth:`SimulatedGraphBackend.share_memory`) that were created during their graphs' capture are
overwritten (bytes ``0xFF``: NaN for floats, -1 for ints) whenever another graph of the same pool
replays, and when the runner invalidates them at ``release()``. A caller reading an output it
kept past the documented lifetime therefore sees garbage on CPU (on a GPU it may happen to see
the old values, or, after ``release()``, gets an error). Recorded tensors stay alive for the
backend's lifetime, so such reads never touch freed memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_aten = torch.ops.aten
# Ops that read device data on the host: forbidden while a CUDA stream is capturing.
_HOST_SYNC_OPS = frozenset(
    {
        _aten._local_scalar_dense.default,
        _aten.nonzero.default,
        _aten.is_nonzero.default,
        _aten.equal.default,
    }
)
_CAPTURE_SYNC_ERROR = "CUDA error: operation not permitted when stream is capturing"
_SCRIBBLE = 0xFF


def _storage_ptrs(values: Any) -> set[int]:
    return {
        leaf.untyped_storage().data_ptr()
        for leaf in tree_leaves(values)
        if isinstance(leaf, torch.Tensor)
    }


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an ATen op writes (its schema's ``Tensor(a!)`` arguments, ``out=`` too)."""
    written: list[torch.Tensor] = []
    for index, argument in enumerate(func._schema.arguments):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        if index < len(args) and not argument.kwarg_only:
            value = args[index]
        else:
            value = kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else (value,)
        written.extend(v for v in values if isinstance(v, torch.Tensor))
    return written


class _UndoLog:
    """What one capture overwrote in memory that existed before it, saved before its first write.

    A CUDA capture records kernels without running them, so memory outside the graph's own
    allocations keeps its contents until the graph (or a piece, at a graph break) runs.
    :meth:`SimulatedGraphBackend.discard_capture` restores these contents for a capture the
    runner does not use; a piece run at a graph break (``execute``) keeps what it wrote.
    """

    def __init__(self) -> None:
        self.saved: dict[int, tuple[Any, Any]] = {}
        self.created: set[int] = set()  # storages allocated by the capture's own ops

    def save(self, tensors: Sequence[Any]) -> None:
        for tensor in tensors:
            if (
                not isinstance(tensor, torch.Tensor)
                or tensor.device.type == "meta"
                or tensor.layout != torch.strided
            ):
                continue
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self.created and ptr not in self.saved:
                self.saved[ptr] = (storage, storage.clone())

    def note_created(self, inputs: set[int], output: Any) -> None:
        for leaf in tree_leaves(output):
            if (
                isinstance(leaf, torch.Tensor)
                and leaf.device.type != "meta"
                and leaf.layout == torch.strided
            ):
                ptr = leaf.untyped_storage().data_ptr()
                if ptr not in inputs:
                    self.created.add(ptr)

    def keep(self) -> None:
        self.saved.clear()

    def restore(self) -> None:
        for storage, contents in self.saved.values():
            storage.copy_(contents)
        self.saved.clear()


class _Op:
    """One recorded op: what to call, and which outputs to refresh after calling it again."""

    __slots__ = ("func", "args", "kwargs", "refresh", "waits")

    def __init__(self, func: Any, args: tuple, kwargs: dict, output: Any) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        inputs = _storage_ptrs((args, kwargs))
        # Views and in-place results already alias what the replayed op writes; fresh results
        # must be copied into the tensor the op returned at capture.
        self.refresh = [
            (index, leaf)
            for index, leaf in enumerate(tree_leaves(output))
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in inputs
        ]
        # An asynchronous collective (c10d's allreduce_) returns work that the eager call waited
        # on; a replay that did not would let the next op read a sum that is not finished.
        self.waits = [
            index
            for index, leaf in enumerate(tree_leaves(output))
            if not isinstance(leaf, torch.Tensor) and callable(getattr(leaf, "wait", None))
        ]

    def replay(self) -> None:
        fresh = self.func(*self.args, **self.kwargs)
        if not self.refresh and not self.waits:
            return
        leaves = tree_leaves(fresh)
        for index in self.waits:
            leaves[index].wait()
        for index, recorded in self.refresh:
            recorded.copy_(leaves[index])


class _KernelLaunch:
    """A Triton kernel launch recorded at capture (under ``TRITON_INTERPRET=1`` on the CPU).

    The interpreter writes through raw pointers, which no ATen op shows, so the launch itself is
    what a replay must run again, on the same argument tensors (as a CUDA graph's kernel node).
    """

    __slots__ = ("run", "kernel", "args", "kwargs")
    refresh: tuple = ()

    def __init__(self, run: Callable, kernel: Any, args: tuple, kwargs: dict) -> None:
        self.run = run
        self.kernel = kernel
        self.args = args
        self.kwargs = kwargs

    def replay(self) -> None:
        self.run(self.kernel, *self.args, **self.kwargs)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op | _KernelLaunch] = []
        self.undo: _UndoLog | None = None
        self._inside_kernel = 0
        self._unpatch: Callable[[], None] | None = None

    def __enter__(self) -> _Recorder:
        unpatch_launches = self._record_triton_launches()
        unpatch_reads = self._refuse_host_reads()

        def unpatch() -> None:
            unpatch_reads()
            if unpatch_launches is not None:
                unpatch_launches()

        self._unpatch = unpatch
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._unpatch is not None:
            self._unpatch()
            self._unpatch = None

    def _refuse_host_reads(self) -> Callable[[], None]:
        """``Tensor.tolist`` and ``Tensor.numpy`` read data on the host without an ATen op, so
        the dispatch mode does not see them: during the capture they fail as on a capturing CUDA
        stream (the interpreter's own reads inside a kernel launch stay allowed)."""
        recorder = self
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

        def refusing(name: str) -> Callable[..., Any]:
            original = originals[name]

            def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if not recorder._inside_kernel:
                    raise RuntimeError(f"{_CAPTURE_SYNC_ERROR} (Tensor.{name})")
                return original(tensor, *args, **kwargs)

            return read

        for name in originals:
            setattr(torch.Tensor, name, refusing(name))

        def unpatch() -> None:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)

        return unpatch

    def _record_triton_launches(self) -> Callable[[], None] | None:
        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:  # no Triton interpreter: nothing launches kernels behind ATen
            return None
        original = InterpretedFunction.run
        recorder = self

        def run(kernel: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if warmup:
                return original(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            launch = _KernelLaunch(
                original, kernel, args, {"grid": grid, "warmup": False, **kwargs}
            )
            recorder.ops.append(launch)
            # The interpreter's own tensor copies belong to the kernel, not to the graph.
            recorder._inside_kernel += 1
            try:
                if recorder.undo is not None:  # which arguments it writes is unknown: all
                    recorder.undo.save(args)  # (saved unrecorded: inside the kernel)
                return original(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                recorder._inside_kernel -= 1

        InterpretedFunction.run = run

        def unpatch() -> None:
            InterpretedFunction.run = original

        return unpatch

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._inside_kernel:
            return func(*args, **kwargs)
        if func in _HOST_SYNC_OPS:
            raise RuntimeError(_CAPTURE_SYNC_ERROR)
        undo = self.undo
        if undo is not None:
            undo.save(_written(func, args, kwargs))
        output = func(*args, **kwargs)
        if undo is not None:
            undo.note_created(_storage_ptrs((args, kwargs)), output)
        self.ops.append(_Op(func, args, kwargs, output))
        return output


class _SimulatedPool:
    def __init__(self) -> None:
        self.regions: list[tuple[frozenset[int], list[Any]]] = []

    def scribble_except(self, graph: _SimulatedGraph) -> None:
        for owners, storages in self.regions:
            if id(graph) not in owners:
                for storage in storages:
                    storage.fill_(_SCRIBBLE)


class _SimulatedGraph:
    def __init__(self, backend: SimulatedGraphBackend, pool: _SimulatedPool | None) -> None:
        self._backend = backend
        self.pool = pool
        self.recorder = _Recorder()
        self.ops: list[_Op | _KernelLaunch] = []
        self.created: set[int] = set()  # storages allocated by the recorded ops

    def finish(self) -> None:
        self.ops = self.recorder.ops
        for op in self.ops:
            self.created.update(leaf.untyped_storage().data_ptr() for _, leaf in op.refresh)

    def replay(self) -> None:
        if self.pool is not None:
            self.pool.scribble_except(self)
        for op in self.ops:
            op.replay()
        self._backend.replays += 1


class SimulatedGraphBackend:
    """A graph backend without CUDA, for exercising the runner on CPU (see the module docstring).

    Args:
        available: What :meth:`available` reports (False simulates a machine without CUDA).
        fail_when: Optional predicate on the static arguments; a capture where it returns True
            raises ``RuntimeError(fail_message)``, simulating e.g. a host sync during capture.
        fail_message: Text of the simulated capture error.

    Attributes:
        captures, replays, warmup_runs, recoveries, empty_cache_calls, synchronize_calls:
            Counters for tests (``captures`` counts captured keys, each of which may hold several
            pieces; ``replays`` counts piece replays).
        slack_requests: Bytes of each non-zero ``hold_slack`` call, in order.
        pieces: Pieces captured (one per key without graph breaks).
    """

    device_type: str | None = None
    capture_computes = True  # recording runs the step's ops (see the module docstring)

    def __init__(
        self,
        *,
        available: bool = True,
        fail_when: Callable[[tuple], bool] | None = None,
        fail_message: str = _CAPTURE_SYNC_ERROR,
    ) -> None:
        self._available = available
        self._fail_when = fail_when
        self._fail_message = fail_message
        self._graphs: list[_SimulatedGraph] = []  # kept alive: see the module docstring
        self._undo: _UndoLog | None = None  # the last capture's (see discard_capture)
        self.capturing = False
        self.captures = 0
        self.pieces = 0
        self.replays = 0
        self.warmup_runs = 0
        self.recoveries = 0
        self.empty_cache_calls = 0
        self.synchronize_calls = 0
        self.slack_requests: list[int] = []

    def available(self) -> bool:
        return self._available

    def is_capturing(self) -> bool:
        return self.capturing

    def resolve_device(self, device: Any, leaves: list) -> Any:
        return device

    def device_guard(self, device: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def new_pool(self, device: Any) -> Any:
        return _SimulatedPool()

    def warmup(self, fn: Callable, args: tuple, runs: int, device: Any) -> None:
        for _ in range(runs):
            fn(*args)
        self.warmup_runs += runs

    @contextlib.contextmanager
    def capture_context(self, device: Any, args: tuple) -> Iterator[None]:
        if self._fail_when is not None and self._fail_when(args):
            raise RuntimeError(self._fail_message)
        self._undo = _UndoLog()
        yield
        self.captures += 1

    def begin_capture(self, pool: Any, device: Any) -> _SimulatedGraph:
        graph = _SimulatedGraph(self, pool)
        graph.recorder.undo = self._undo
        graph.recorder.__enter__()
        self.capturing = True
        return graph

    def end_capture(self, graph: _SimulatedGraph) -> None:
        self.capturing = False
        graph.recorder.__exit__(None, None, None)
        graph.finish()
        self._graphs.append(graph)
        self.pieces += 1

    def abort_capture(self, graph: _SimulatedGraph, device: Any) -> None:
        if self.capturing:
            self.capturing = False
            graph.recorder.__exit__(None, None, None)

    def execute(self, graph: _SimulatedGraph) -> None:
        # Recording ran the piece's ops eagerly, so its results are already in memory; running
        # them again would apply in-place updates twice. CUDA ran them now: they are kept.
        if self._undo is not None:
            self._undo.keep()

    def hold_slack(self, device: Any, nbytes: int) -> None:
        if nbytes > 0:
            self.slack_requests.append(nbytes)

    def share_memory(self, pool: Any, graphs: Sequence[Any], storages: Sequence[Any]) -> None:
        if pool is None:
            return
        created = set().union(*(graph.created for graph in graphs))
        owned = [s for s in storages if s.data_ptr() in created]
        pool.regions.append((frozenset(id(graph) for graph in graphs), owned))

    def can_invalidate(self) -> bool:
        return True

    def invalidate(self, storages: Sequence[Any], message: str) -> None:
        created = set().union(*(graph.created for graph in self._graphs))
        for storage in storages:
            if storage.data_ptr() in created:  # never the step's own tensors (caches, weights)
                storage.fill_(_SCRIBBLE)

    def discard_capture(self, device: Any) -> None:
        """Restores the memory the last capture wrote that existed before it (a CUDA capture
        runs nothing), except what a piece run at a graph break wrote."""
        if self._undo is not None:
            self._undo.restore()
            self._undo = None

    def recover(self, device: Any) -> None:
        self.recoveries += 1

    def synchronize(self, device: Any) -> None:
        self.synchronize_calls += 1

    def memory_reserved(self, device: Any) -> int:
        return 0

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1
