"""CUDAGraphRunner: the graph runner (``EagerRunner``, in eager.py, has its call interface).

The graph runner wraps a callable and knows nothing about models or engines. Per extra key
(``key_fn(inputs)``, default ``None``) it owns one set of static input buffers and one graph per
capture size (several pieces when the step has graph breaks, see breaks.py); all graphs share one
memory pool. A call pads its batch up to the nearest captured size, copies inputs into the
buffers, replays, and returns outputs sliced to the real batch; any call that cannot replay runs
``fn`` eagerly and counts why (:class:`FallbackReason`).

Lifecycle (:class:`RunnerState`): ``NEW`` -> ``WARMED`` (buffers built, warm-up run) ->
``CAPTURED`` (at least one graph) -> ``RELEASED`` (everything dropped; ``capture`` may start again).
Independently, :meth:`CUDAGraphRunner.freeze` forbids any further capture (serving mode).
Not thread-safe: one runner serves one thread, as CUDA graph capture itself requires.
"""

from __future__ import annotations

import enum
import gc
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

from torch import is_grad_enabled

from graphtune import env
from graphtune.errors import CaptureError, InputError
from graphtune.graphs import keys
from graphtune.graphs import policy as policies
from graphtune.graphs.backend import GraphBackend, default_backend
from graphtune.graphs.breaks import finish_capture_call
from graphtune.graphs.buffers import batch_size
from graphtune.graphs.capture import frozen_gc
from graphtune.graphs.grad import inputs_need_grad, needs_grad_error
from graphtune.graphs.keys import KeyState, batch_of
from graphtune.graphs.memory import can_disown
from graphtune.graphs.padding import check_pad_argument
from graphtune.graphs.policy import CapturePolicy, FallbackReason, GraphState, Route
from graphtune.graphs.pool import GraphPool
from graphtune.graphs.stats import RunnerStats
from graphtune.graphs.tree import flatten_with_paths
from graphtune.reporting import progress

logger = logging.getLogger(__name__)


class RunnerState(enum.Enum):
    """Lifecycle state of a runner."""

    NEW = "new"
    WARMED = "warmed"
    CAPTURED = "captured"
    RELEASED = "released"


class CUDAGraphRunner:
    """Owns every CUDA graph of one step callable: capture, pad, replay, fall back, release.

    Args:
        fn: The step. Called as ``fn(*inputs)``; inputs are any nesting of tuples, lists and
            dicts holding tensors and constants. Must not synchronise with the host.
        max_batch_size: Largest batch the runner is called with (caps the default sizes).
        capture_sizes: Batch sizes to capture; default :func:`default_capture_sizes`. Sorted,
            de-duplicated and validated (positive ints ``<= max_batch_size``).
        key_fn: ``key_fn(inputs) -> hashable`` extra key (e.g. draft length); each key gets its
            own buffers and graphs. Non-tensor inputs that vary must be returned from it. Two
            values are one key when they have the same type and are equal, tuples compared item
            by item alike (:func:`~graphtune.graphs.keys.typed_key`): 1, 1.0 and True are three
            keys, a float NaN is one; ``captured_keys`` and records give a key's first value.
        pad: Pad rule for padded rows: ``"zeros"`` (default), ``"repeat"`` (row 0), a number, a
            callable ``fn(pad_rows, real_rows)``, or a dict ``{"1.positions": rule}`` / a
            structure like the inputs holding rules. Padded rows are re-filled on every call.
        batched: Which tensors carry the batch dimension: a predicate ``(path, tensor) -> bool``,
            or bools by path (dict) or structure. Default: leading dim equals the batch size.
        warmup: Eager warm-up runs before capturing (on the capture stream).
        lazy: Capture a key on its first use instead of all sizes in ``capture``.
        enabled: False runs every call eagerly (reason ``disabled``); so does
            ``GRAPHTUNE_DISABLE_GRAPHS=1``.
        device: CUDA device to capture on; default the device of the first CUDA input.
        clone_outputs: Return copies instead of views that the next call overwrites.
        can_graph: Predicate ``can_graph(inputs) -> bool`` (or numpy.bool_); False: run eagerly.
        debug: Check that non-batched tensors keep their address; default ``GRAPHTUNE_DEBUG``.
        share_pool: Capture every graph into one memory pool (the point of the runner); False
            gives each graph its own pool, for measuring the difference.
        backend: Graph implementation; default the CUDA backend. Tests pass
            :class:`SimulatedGraphBackend` to run the same logic on CPU.
        policy: Serving switches (:class:`CapturePolicy`): padding off, what a capture after
            :meth:`freeze` does, output memory sharing. Default ``CapturePolicy()``.

    Raises:
        ConfigError: An argument breaks a documented rule.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        max_batch_size: int,
        capture_sizes: Any = None,
        key_fn: Callable[[tuple], Hashable] | None = None,
        pad: Any = None,
        batched: Any = None,
        warmup: int = 2,
        lazy: bool = False,
        enabled: bool = True,
        device: Any = None,
        clone_outputs: bool = False,
        can_graph: Callable[[tuple], bool] | None = None,
        debug: bool | None = None,
        share_pool: bool = True,
        backend: GraphBackend | None = None,
        policy: CapturePolicy | None = None,
    ) -> None:
        check_pad_argument(pad)
        policy = policies.checked_arguments(fn, warmup, key_fn, can_graph, backend, policy)
        if capture_sizes is None:
            sizes = policies.default_capture_sizes(max_batch_size)
        else:
            sizes = policies.validate_capture_sizes(capture_sizes, max_batch_size)
        self.fn = fn
        self.max_batch_size = max_batch_size
        self.capture_sizes: tuple[int, ...] = sizes
        self._largest = sizes[-1]
        self._pad_table = policies.padding_table(sizes, padding=policy.padding)
        self.policy = policy
        self._key_fn = key_fn
        self._pad = pad
        self._batched = batched
        self._warmup = warmup
        self._lazy = bool(lazy)
        self._device_arg = device
        self._device: Any = None
        self._clone_outputs = bool(clone_outputs)
        self._can_graph = can_graph
        self._debug = env.debug_checks() if debug is None else bool(debug)
        self._backend: GraphBackend = backend if backend is not None else default_backend()
        self._is_capturing = self._backend.is_capturing
        # Outputs share pool memory only where a read after release() can be made to fail.
        share_outputs = (
            policy.share_output_memory and can_disown() and self._backend.can_invalidate()
        )
        self._frozen = False
        self._static_reason = policies.static_reason(
            enabled and not env.graphs_disabled(), self._backend.available
        )
        self._keys: dict[Hashable, KeyState] = {}
        self._pool = GraphPool(
            self, self._backend, share_pool=bool(share_pool), share_outputs=share_outputs
        )
        self._noted_static_reason = False
        self.state = RunnerState.NEW
        self.stats = RunnerStats()

    # ------------------------------------------------------------------ public

    @property
    def fallback_reason(self) -> FallbackReason | None:
        """DISABLED or NO_CUDA when every call runs eagerly, else None."""
        return self._static_reason

    @property
    def frozen(self) -> bool:
        """Whether :meth:`freeze` forbids captures."""
        return self._frozen

    def freeze(self) -> None:
        """Forbids every further capture, so a serving process never captures under load.

        After this, a lazy capture a call would start does what ``CapturePolicy.when_frozen``
        says: run that call eagerly (counted as ``frozen (capture refused)``) or raise
        :class:`CaptureError`; ``capture()`` raises, or with ``"fallback"`` logs a warning and
        captures nothing. Replays, fallbacks and ``release()`` work as before.
        """
        self._frozen = True

    def unfreeze(self) -> None:
        """Allows captures again (after :meth:`freeze`)."""
        self._frozen = False

    @property
    def captured_keys(self) -> list[tuple[Hashable, int]]:
        """``(extra_key, size)`` of every live graph."""
        return [(st.extra_key, s) for st in self._keys.values() for s in sorted(st.graphs)]

    def capture(self, *example_inputs: Any) -> None:
        """Builds static buffers from ``example_inputs``, warms up, and captures every size.

        Sizes are captured largest first into the shared pool. With ``lazy=True`` only the
        buffers and the warm-up happen here; each key is captured on first use. Sizes already
        captured for this extra key are skipped. Without CUDA (or when disabled) this only records
        the reason; every call then runs ``fn`` eagerly. A size whose capture fails is recorded
        in ``stats``, logged once, and runs eagerly; this method does not raise for it.

        Raises:
            InputError: No tensor in ``example_inputs`` has a batch dimension, a tensor marked
                batched does not start with the batch size, or a batched input is on another
                device type than the backend captures.
            ConfigError: ``pad`` or ``batched`` names a path that matches no input, ``pad``
                names an input that is not batched, or a pad value does not fit its input.
            CaptureError: Called while a CUDA graph capture is already in progress, or after
                :meth:`freeze` with ``CapturePolicy(when_frozen="raise")``.
        """
        if self._static_reason is not None:
            self._note_static_reason()
            return
        if self._frozen:
            if self.policy.when_frozen == "raise":
                raise CaptureError(policies.frozen_message("capture()", self.policy.when_frozen))
            logger.warning("%s", policies.frozen_message("capture()", self.policy.when_frozen))
            return
        if self._backend.is_capturing():
            raise CaptureError(
                "capture() was called while a CUDA graph capture is in progress; graphs cannot "
                "be captured inside another capture. Capture this runner before the outer one"
            )
        if is_grad_enabled() and inputs_need_grad(example_inputs):
            raise needs_grad_error()
        extra = self._key_fn(example_inputs) if self._key_fn is not None else None
        keys.check_key(extra)
        existing = self._keys.get(keys.typed_key(extra))
        key_state = existing or self._build(extra, example_inputs)
        if existing is not None:  # the warm-up runs on these examples, not on earlier calls' rows
            existing.copy_examples(example_inputs, self._debug)
        if key_state is None:
            raise InputError(
                "capture() needs at least one batched tensor (a tensor with a leading dim >= 1) "
                "in example_inputs; the first such tensor's leading dim is the batch size. Pass "
                "example inputs shaped like a real call, or mark tensors with batched=..."
            )
        with self._backend.device_guard(self._device), frozen_gc():
            warmed = self._warm(key_state, self._largest)
            if self._lazy:
                return
            todo = [
                s
                for s in reversed(self.capture_sizes)
                if s not in key_state.graphs and s not in key_state.failed
            ]
            with progress("capturing CUDA graphs", total=len(todo)) as bar:
                for size in todo:
                    if size in key_state.failed:  # the key's outputs cannot be sliced
                        bar.advance(f"skipped size {size}")
                        continue
                    if self.policy.warm_each_size and size != self._largest:
                        warmed = self._warm(key_state, size, runs=1)
                    self._capture_size(key_state, size, warmed)
                    warmed = 0.0  # the key's one warm-up belongs to its first capture
                    bar.advance(f"captured size {size}")
        key_state.log_undecided()

    def __call__(self, *inputs: Any, **named: Any) -> Any:
        stats = self.stats
        stats.calls += 1
        if named:
            raise keys.named_inputs_error(named)
        if self._static_reason is not None:
            return self._eager(self._static_reason, inputs)
        if self._is_capturing():
            return self._eager(FallbackReason.NESTED_CAPTURE, inputs)
        if self._can_graph is not None and not policies.can_graph_decision(self._can_graph(inputs)):
            return self._eager(FallbackReason.PREDICATE_REFUSED, inputs)
        grad = is_grad_enabled()  # read once: with autograd off a replay pays nothing more
        if grad and inputs_need_grad(inputs):
            return self._eager(FallbackReason.NEEDS_GRAD, inputs)
        extra = self._key_fn(inputs) if self._key_fn is not None else None
        try:  # typed_key(None) is None: no call for the runners without key_fn
            key_state = self._keys.get(extra if extra is None else keys.typed_key(extra))
        except TypeError:  # an unhashable key (a list): free to guard, raised only then
            raise keys.unhashable_key_error(extra) from None
        if key_state is not None and (not grad or key_state.grad is False):
            plan = key_state.inputs
            leaves = plan.flatten(inputs)
            n = batch_of(plan, leaves)
            if key_state.low <= n <= self._largest:  # low >= 1; above 1 see KeyState.low
                size = self._pad_table[n]
                graph = key_state.graphs.get(size)
                if graph is not None:
                    plan.copy_in(leaves, n, size, self._debug)
                    graph.replay()
                    stats.replays += 1
                    stats.real_rows += n
                    stats.padded_rows += size
                    return graph.outputs.result(n, self._clone_outputs)
        return self._call_slow(inputs, extra, key_state)

    def release(self) -> None:
        """Drops every graph, the pool and the static buffers, then empties the allocator cache.

        The runner can capture again afterwards, on the device of the new inputs unless
        ``device`` was given; releasing twice is harmless. Outputs the
        caller kept become invalid: reading one raises ``RuntimeError`` (their memory goes back
        to the device). Call counters are kept; capture records are cleared.
        """
        if self._keys or self._pool.allocated:
            if any(st.graphs for st in self._keys.values()):
                self._backend.synchronize(self._device)  # no replay may still read the memory
            self._pool.release()
            self._keys.clear()
            self.stats.records.clear()
            self.stats.buffer_bytes = 0
            self.stats.releases += 1
            gc.collect()  # cycles (e.g. from a failed capture) could still pin pool memory
            self._backend.empty_cache()
        # The next capture resolves its device again (from its inputs when none was given).
        self._device = None
        self.state = RunnerState.RELEASED

    def padded_inputs(self, *inputs: Any) -> tuple[tuple, int, int]:
        """The inputs as the graph sees them: batched tensors padded by the pad rules.

        Allocates new tensors; meant for checking results (``fn(*padded)`` sliced to ``n`` is
        what a replay returns). Returns ``(padded_inputs, n, padded_size)``.

        Raises:
            InputError: No buffers exist for this call's extra key yet, the batch is too large,
                or a call would refuse these inputs (a batched input of another shape, dtype or
                device, a changed constant, a value that is not a tensor where a non-batched
                tensor was captured, in debug mode a moved non-batched tensor).
        """
        extra = self._key_fn(inputs) if self._key_fn is not None else None
        try:
            key_state = self._keys.get(keys.typed_key(extra))
        except TypeError:
            raise keys.unhashable_key_error(extra) from None
        if key_state is None:
            raise InputError(f"no buffers for extra key {extra!r}; call capture() first")
        return key_state.padded_copy(inputs, self._pad_table, self._debug)

    def __repr__(self) -> str:
        return (
            f"CUDAGraphRunner({getattr(self.fn, '__name__', 'fn')}, state={self.state.value}, "
            f"sizes={len(self.capture_sizes)} up to {self._largest}, graphs={self.stats.graphs})"
        )

    # ------------------------------------------------------------------ internals
    def _eager(self, reason: FallbackReason, inputs: tuple) -> Any:
        self.stats.count_fallback(reason)
        return self.fn(*inputs)

    def _telling(
        self, reason: FallbackReason, key_state: KeyState, n: int, leaves: Any, inputs: tuple
    ) -> Any:
        """Runs a call eagerly whose outputs tell the key's output rows (and whether they
        require grad); on inputs a replay would refuse, they would tell wrong: it raises."""
        key_state.inputs.check(leaves, n, self._debug)
        start = time.perf_counter()
        out = self._eager(reason, inputs)
        if reason is FallbackReason.WARMING_UP:  # the key's (or its size's) warm-up
            seconds = key_state.warmed[self._pad_table[n]] = time.perf_counter() - start
            self.stats.warmup_seconds += seconds
        self._settle(key_state.observe(n, out, self.capture_sizes, self.stats.records))
        return out

    def _call_slow(self, inputs: tuple, extra: Hashable, key_state: KeyState | None) -> Any:
        """Every call that does not replay an existing graph: decide, maybe capture lazily."""
        n = size = None
        if key_state is None:  # a key that has buffers was checked when they were built
            keys.check_key(extra)
        if key_state is None and self._lazy:
            if self._frozen:  # no capture under load, so no buffers for one: the batch alone
                n = batch_size(inputs, self._batched)
            else:
                key_state = self._build(extra, inputs)
                if key_state is None:
                    return self._eager(FallbackReason.NO_BATCH, inputs)
        graph_state = GraphState.MISSING
        if key_state is not None:
            leaves = key_state.inputs.flatten(inputs)
            n = batch_of(key_state.inputs, leaves)
        if n is not None and 0 < n <= self._largest:
            size = self._pad_table[n]
            if key_state is not None:
                graph_state = key_state.graph_state(size)
        decision = policies.decide(
            static_reason=None,
            capturing=False,
            refused=False,
            has_plan=key_state is not None,
            lazy=self._lazy,
            batch=n,
            largest_size=self._largest,
            graph_state=graph_state,
            size_captured=size != 0,
            frozen=self._frozen,
        )
        if isinstance(decision, FallbackReason):
            if decision is FallbackReason.FROZEN and self.policy.when_frozen == "raise":
                new = "" if key_state is not None else " of a new key"
                raise CaptureError(
                    policies.frozen_message(f"a call{new} of batch {n} (size {size})", "raise")
                )
            return self._eager(decision, inputs)
        assert key_state is not None and n is not None and size is not None
        if n < key_state.low:  # rows undecided (a replay or a capture would guess): this call tells
            return self._telling(FallbackReason.ROWS_UNDECIDED, key_state, n, leaves, inputs)
        plan = key_state.inputs
        capture = decision is Route.CAPTURE_THEN_REPLAY
        warm_size = self.policy.warm_each_size and size not in key_state.warmed
        if capture and self._warmup and (not key_state.warmed or warm_size):
            # The warm-up is this call, run eagerly on its own inputs: on the buffers it would run
            # its rows again (a stateful step steps twice). The next call of the size captures.
            return self._telling(FallbackReason.WARMING_UP, key_state, n, leaves, inputs)
        # A replay would drop gradients; a capture (with autograd on) tells whether it would.
        if is_grad_enabled() and (key_state.grad or (key_state.grad is None and not capture)):
            return self._telling(FallbackReason.OUTPUT_NEEDS_GRAD, key_state, n, leaves, inputs)
        if capture:
            if key_state.rows_unknown_at(n, size):  # no other size to tell the batch rows by
                return self._telling(FallbackReason.ROWS_UNDECIDED, key_state, n, leaves, inputs)
            plan.copy_in(leaves, n, size, self._debug)  # the capture computes on these rows
            with self._backend.device_guard(self._device), frozen_gc(collect=False):
                self._capture_size(key_state, size, key_state.warmed.get(size, 0.0))
            graph = key_state.graphs.get(size)
            if graph is None or graph.needs_grad:  # failed, dropped, or a replay drops gradients
                # A CUDA capture computed nothing; undo what a computing one wrote, so the
                # eager run below is this call's only computation, as on CUDA.
                if self._backend.capture_computes:
                    self._backend.discard_capture(self._device)
                key_state.refuse_rerun(size)
                why = FallbackReason.OUTPUT_NEEDS_GRAD if graph else FallbackReason.CAPTURE_FAILED
                return self._eager(why, inputs)
            finish_capture_call(self._backend, graph.graph)  # no second run of this call's rows
            # Its capture ran each graph break once for this call, as a replay does.
            self.stats.break_runs += graph.record.breaks
            self.stats.break_seconds += graph.record.break_seconds
            if n < key_state.low:  # this call's rows ran in the capture: no eager run can tell
                logger.warning(policies.undecided_message(key_state.extra_key, n, key_state.low))
            key_state.log_undecided()
        else:
            graph = key_state.graphs[size]
            plan.copy_in(leaves, n, size, self._debug)
            graph.replay()
        self.stats.replays += 1
        self.stats.real_rows += n
        self.stats.padded_rows += size
        return graph.outputs.result(n, self._clone_outputs)

    def _build(self, extra: Hashable, inputs: tuple) -> KeyState | None:
        keys.check_key(extra)
        key_state = KeyState.build(
            extra, inputs, self._largest, self._pad, self._batched, self._backend.device_type
        )
        if key_state is None:
            return None
        if self._device is None:
            self._device = self._backend.resolve_device(
                self._device_arg, flatten_with_paths(inputs)[0]
            )
        self._keys[key_state.key] = key_state
        self._count_buffers()
        return key_state

    def _warm(self, key_state: KeyState, size: int, runs: int | None = None) -> float:
        seconds = 0.0
        runs = self._warmup if runs is None else min(runs, self._warmup)
        if runs > 0:
            start = time.perf_counter()
            self._backend.warmup(self.fn, key_state.inputs.static_args(size), runs, self._device)
            seconds = time.perf_counter() - start
            key_state.warmed[size] = seconds
            self.stats.warmup_seconds += seconds
        if self.state in (RunnerState.NEW, RunnerState.RELEASED):
            self.state = RunnerState.WARMED
        return seconds

    def _capture_size(self, key_state: KeyState, size: int, warmup_seconds: float) -> None:
        result = self._pool.capture(
            self.fn,
            key_state,
            size,
            device=self._device,
            counters=self.stats,
            slack_bytes=self.policy.pool_slack_bytes if len(self.capture_sizes) > 1 else 0,
            warmup_seconds=warmup_seconds,
        )
        self._settle(key_state.keep(result, self.capture_sizes, self.stats.records))
        self._count_buffers()

    def _settle(self, dropped: str | None) -> None:
        """Sets the runner's state after a capture or an eager call told a key's row rules:
        captured while a graph lives, else warmed when a key's graphs were ``dropped`` (why,
        logged by KeyState.keep or observe; None when none were)."""
        if any(k.graphs for k in self._keys.values()):
            self.state = RunnerState.CAPTURED
        elif dropped is not None:
            self.state = RunnerState.WARMED

    def _count_buffers(self) -> None:
        self.stats.buffer_bytes = sum(st.nbytes for st in self._keys.values())

    def _note_static_reason(self) -> None:
        if not self._noted_static_reason:
            self._noted_static_reason = True
            logger.info(
                "CUDA graph capture skipped (%s): every call of %s runs eagerly",
                self._static_reason,
                getattr(self.fn, "__name__", "fn"),
            )
