"""Per-extra-key state of a graph runner, and reading a call's batch size.

One :class:`KeyState` exists per ``key_fn`` value (per :func:`typed_key`, so 1, 1.0 and True are
three keys): its static input buffers, the static outputs of its graph breaks, its captured graphs
by size and its failed captures by size.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from collections.abc import Hashable, Sequence
from operator import ne
from typing import Any

import torch

from graphtune.errors import CaptureError, ConfigError, InputError
from graphtune.graphs.breaks import BreakBuffers, PiecewiseGraph
from graphtune.graphs.buffers import StaticInputs
from graphtune.graphs.capture import CapturedGraph, CaptureRecord
from graphtune.graphs.grad import outputs_need_grad
from graphtune.graphs.outputs import StaticOutputs, row_rules, undecided_rows
from graphtune.graphs.policy import GraphState
from graphtune.graphs.tree import path_str

logger = logging.getLogger(__name__)


class KeyState:
    """Buffers and graphs of one extra key."""

    __slots__ = (
        "extra_key",
        "key",
        "inputs",
        "breaks",
        "graphs",
        "failed",
        "warmed",
        "seen",
        "low",
        "noted",
        "grad",
    )

    def __init__(self, extra_key: Hashable, inputs: StaticInputs) -> None:
        self.extra_key = extra_key  # the key_fn value that made this key, as records give it
        self.key = typed_key(extra_key)  # what the runner's dict of keys is keyed by
        self.inputs = inputs
        self.breaks = BreakBuffers(inputs.rows)
        self.graphs: dict[int, CapturedGraph] = {}
        self.failed: dict[int, CaptureRecord] = {}
        # Seconds of the warm-up per size fn ran at (capture()'s warm-up, or a lazy first call).
        self.warmed: dict[int, float] = {}
        # Output shapes of eager calls by batch: evidence for the row rules beside the graphs'.
        self.seen: dict[int, StaticOutputs] = {}
        # The smallest batch whose graph outputs are known to slice right (outputs.undecided_rows):
        # the hot path replays only from it, a smaller batch runs eagerly once and tells.
        self.low = 1
        self.noted: tuple[int, list[str]] = (1, [])  # the undecided outputs, once decided
        # Whether fn's outputs require grad when it runs with autograd on (grad.py), by the
        # latest capture or eager call that ran so; None until one has.
        self.grad: bool | None = None

    @classmethod
    def build(
        cls,
        extra_key: Hashable,
        inputs: tuple,
        rows: int,
        pad: Any,
        batched: Any,
        device_type: str | None,
    ) -> KeyState | None:
        """The state of key ``extra_key`` with static buffers of ``rows`` rows built from a
        call's (or ``capture()``'s example) ``inputs`` by the ``pad`` and ``batched`` arguments
        (only batched tensors on ``device_type``, when given), or None when no tensor is batched.

        Raises:
            ConfigError, InputError: What :meth:`StaticInputs.build` raises for them.
        """
        plan = StaticInputs.build(
            inputs, rows=rows, pad=pad, batched=batched, device_type=device_type
        )
        if plan is None:
            return None
        logger.debug(
            "graph runner buffers for key %r: batched inputs %s, %d rows",
            extra_key,
            ", ".join(plan.batched_paths),
            plan.rows,
        )
        return cls(extra_key, plan)

    @property
    def nbytes(self) -> int:
        """Bytes of this key's static buffers: inputs, shared and per-graph break outputs."""
        own = sum(
            brk.own_bytes
            for graph in self.graphs.values()
            if isinstance(graph.graph, PiecewiseGraph)
            for brk in graph.graph.breaks
        )
        return self.inputs.nbytes + self.breaks.nbytes + own

    def copy_examples(self, example_inputs: tuple, debug: bool) -> None:
        """Puts ``capture()``'s example rows into the buffers (the warm-up then runs on them)."""
        leaves = self.inputs.flatten(example_inputs)
        n = batch_of(self.inputs, leaves)
        if n > self.inputs.rows:
            leaves, n = self.inputs.first_rows(leaves), self.inputs.rows
        if n > 0:
            self.inputs.copy_in(leaves, n, self.inputs.rows, debug)

    def padded_copy(
        self, inputs: tuple, pad_table: Sequence[int], debug: bool = False
    ) -> tuple[tuple, int, int]:
        """``CUDAGraphRunner.padded_inputs`` for this key: ``(padded inputs, n, padded size)``.

        Raises:
            InputError: The batch is too large, or not a capture size with padding off; or an
                input a call refuses (:meth:`StaticInputs.padded_copy`).
        """
        n = batch_of(self.inputs, self.inputs.flatten(inputs))
        if not 0 < n <= self.inputs.rows:
            raise InputError(f"batch {n} is outside 1..{self.inputs.rows}; nothing to pad to")
        size = pad_table[n]
        if not size:
            raise InputError(
                f"batch {n} is not a capture size and padding is off (CapturePolicy(padding="
                "False)); such calls run eagerly, so there is nothing to pad to"
            )
        return self.inputs.padded_copy(inputs, size, debug), n, size

    def keep(
        self, result: CapturedGraph | CaptureRecord, sizes: Sequence[int], records: list[Any]
    ) -> str | None:
        """Keeps a capture's result (a graph, or the record of a failed capture) and its record
        in ``records`` (the runner's ``stats.records``). A new graph whose outputs cannot be
        sliced beside another size's drops the key's graphs (:meth:`drop_if_unsliceable`):
        their records in ``records`` then say failed too. A capture made with autograd on
        tells whether the key's outputs require grad (:attr:`grad`). Returns why it dropped
        them, or ``None``."""
        if not isinstance(result, CapturedGraph):
            self.failed[result.size] = result
            records.append(result)
            return None
        if torch.is_grad_enabled():
            self.grad = result.needs_grad
        self.graphs[result.record.size] = result
        records.append(result.record)
        return self._drop_records(self.drop_if_unsliceable(sizes), records)

    def _drop_records(self, dropped: str | None, records: list[Any]) -> str | None:
        """Marks this key's records in ``records`` failed when its graphs were ``dropped``."""
        if dropped is not None:
            for i, record in enumerate(records):
                if record.ok and typed_key(record.extra_key) == self.key:
                    records[i] = self.failed[record.size]
        return dropped

    def refuse_rerun(self, size: int) -> None:
        """Raises when the lazy capture of ``size`` that this call cannot use (it failed, its
        graph was dropped, or its outputs require grad under autograd) ran pieces of this call's
        ``fn`` at graph breaks: running ``fn`` again eagerly would run them twice.

        Raises:
            CaptureError: Those pieces ran; later calls of ``size`` (with autograd on, when
                the outputs require grad) run eagerly.
        """
        graph = self.graphs.get(size)
        record = graph.record if graph is not None else self.failed.get(size)
        if record is None or not record.ran_pieces:
            return
        if graph is not None:
            why, later = (
                "showed fn's outputs require grad (a replay drops them)",
                "with autograd on",
            )
            fix = "call under torch.no_grad() to replay, or use an EagerRunner for autograd"
        else:
            why, later = "failed", f"of size {size}"
            fix = "capture the key ahead with capture(), which captures on example rows"
        raise CaptureError(
            f"the lazy capture of size {size} {why} after {record.ran_pieces} piece(s) of fn ran "
            "on this call's rows (at graph breaks), so running fn again eagerly would run them "
            f"twice; this call raises, later calls {later} run eagerly. The cause is kept in "
            f"stats.records (a failure is logged by graphtune.graphs); to avoid this, {fix}."
        )

    def observe(self, n: int, outputs: Any, sizes: Sequence[int], records: list[Any]) -> str | None:
        """Keeps the shapes of an eager call's ``outputs`` at batch ``n`` as evidence for the
        row rules, deciding them again when graphs exist (:meth:`drop_if_unsliceable`; a drop
        marks their records in ``records`` failed, as :meth:`keep` does); with autograd on, they
        tell whether the key's outputs require grad (:attr:`grad`). Only a call whose inputs a
        replay would take may tell. Returns why it dropped the key's graphs, or ``None``."""
        if torch.is_grad_enabled():
            self.grad = outputs_need_grad(outputs)
        if n < 1 or n in self.seen or any(g.outputs.size == n for g in self.graphs.values()):
            return None
        try:
            self.seen[n] = StaticOutputs.seen(outputs, n)
        except ConfigError:  # outputs no capture keeps (its failure says why): no evidence
            return None
        if not self.graphs:
            return None
        return self._drop_records(self.drop_if_unsliceable(sizes), records)

    def rows_unknown_at(self, n: int, size: int) -> bool:
        """Whether a lazy capture of ``size`` for a batch of ``n`` would leave this call's rows
        undecided (the capture computes them, so no eager run could tell them afterwards): by
        the key's graphs and eager calls so far, some output's rows are not known below a batch
        above ``n``. A lone size tells nothing of an output with as many rows (the batch, or a
        constant of that many rows). An eager call at ``n`` tells instead; a later call captures.
        """
        seen = self._evidence()
        if n >= size or not seen:
            return False
        rules = row_rules(seen if len(seen) > 1 else seen * 2)
        return not isinstance(rules, str) and n < undecided_rows(seen, rules)[0]

    def _evidence(self) -> list[StaticOutputs]:
        """One observation per size: a graph's outputs, else an eager call's (an eager call at a
        size that has a graph since, a lazy capture's warm-up, is no second size to compare)."""
        seen = [g.outputs for g in self.graphs.values()]
        return seen + [o for n, o in self.seen.items() if n not in self.graphs]

    def drop_if_unsliceable(self, sizes: Sequence[int]) -> str | None:
        """Decides how every graph of the key slices each output from its shapes at all the
        key's sizes and eager batches (:func:`~graphtune.graphs.outputs.row_rules`), and below
        which batch that is not known (:attr:`low`). When they cannot all be sliced to the real
        batch, drops every graph of the key and marks each of ``sizes`` failed (its calls then
        run eagerly, reason ``capture_failed``), logs and returns why; else ``None``."""
        seen = self._evidence()
        rules = row_rules(seen) if len(seen) > 1 else next(iter(self.graphs.values())).outputs.rules
        if not isinstance(rules, str):
            for graph in self.graphs.values():
                graph.outputs.use_rules(rules)
            self.noted = undecided_rows(seen, rules)
            self.low = self.noted[0]
            return None
        problem = rules
        self.low, self.noted = 1, (1, [])
        for size, graph in list(self.graphs.items()):
            self.failed[size] = dataclasses.replace(graph.record, ok=False, error=problem)
        self.graphs.clear()
        for size in sizes:  # the sizes not captured yet are not captured at all
            self.failed.setdefault(
                size, CaptureRecord(self.extra_key, size, 0.0, 0, ok=False, error=problem)
            )
        logger.warning(
            "CUDA graphs of key %r dropped, every call of it runs eagerly: %s",
            self.extra_key,
            problem,
        )
        return problem

    def log_undecided(self) -> None:
        """Logs (info) the outputs whose rows are undecided below :attr:`low`, once the runner
        has captured what it meant to (a capture in progress may yet decide them)."""
        low, paths = self.noted
        if low > 1 and paths:
            logger.info(
                "graph outputs %s of key %r have %d rows at every size captured (%s): a "
                "constant or the batch capped there; the first call below %d rows runs eagerly "
                "to tell (reason 'output rows undecided')",
                ", ".join(paths),
                self.extra_key,
                low,
                sorted(self.graphs),
                low,
            )
            self.noted = (low, [])

    def graph_state(self, size: int | None) -> GraphState:
        if size in self.graphs:
            return GraphState.CAPTURED
        if size in self.failed:
            return GraphState.FAILED
        return GraphState.MISSING


def batch_of(plan: StaticInputs, leaves: Any) -> int:
    """The leading dim of the leaf that gives the batch size.

    Raises:
        InputError: That leaf is not a tensor with a leading dim.
    """
    leaf = leaves[plan.batch_index]
    try:
        return leaf.shape[0]
    except (AttributeError, IndexError):
        raise InputError(
            f"input {path_str(plan.paths[plan.batch_index])} gives the batch size and must be a "
            f"tensor with a leading dim, got {type(leaf).__name__}"
            f"{tuple(leaf.shape) if hasattr(leaf, 'shape') else ''}; keep the captured structure"
        ) from None


def typed_key(extra: Any) -> Hashable:
    """What a ``key_fn`` value keys graphs by: two values are one key when they have the same
    type and are equal, tuples (and their subclasses) compared item by item the same way, so
    1, 1.0 and True (equal in Python, but three constants to a graph, as in
    :func:`~graphtune.graphs.values.same_constant`) are three keys, and ``(1, 2)`` is not
    ``(1.0, 2)``. A NaN float (``numpy.float64`` and other float subclasses too) equals itself
    here, as does a complex number with a NaN part, and a zero (or a complex number's zero part)
    equals only a zero of its sign (``-0.0`` and ``0.0`` are two keys, as they are two constants
    to a graph); other values (a frozenset's items too) compare by ``==``. ``None`` stays
    ``None``. Does not hash: an unhashable value raises where it is looked up."""
    if extra is None:
        return None
    kind = type(extra)
    if kind in _PLAIN:  # the hot path of every replay with a key_fn: no NaN to look for
        return (kind, extra)
    if isinstance(extra, tuple):
        types = tuple(map(type, extra))
        # A flat tuple of plain values holding no NaN (ne(x, x) in C: True only for a NaN) and
        # no zero float (== cannot tell -0.0 from 0.0; an int 0 or False matches too and only
        # costs the slow path) is keyed by its items' types and itself, built in C: the types
        # tell 1, 1.0 and True apart. Any other tuple is keyed item by item.
        if _FLAT.issuperset(types) and (
            float not in types or (not any(map(ne, extra, extra)) and 0.0 not in extra)
        ):
            return (kind, types, extra)
    return _deep_key(extra)


def _deep_key(extra: Any) -> Hashable:
    """:func:`typed_key` item by item, at every depth (no fast path tried)."""
    kind = type(extra)
    if kind in _PLAIN:
        return (kind, extra)
    if isinstance(extra, tuple):
        return (kind, tuple([_deep_key(item) for item in extra]))
    if isinstance(extra, (float, complex)):  # numpy.float64 and complex128 too
        return (kind, _number_parts(extra))
    numpy = sys.modules.get("numpy")  # only values of an imported numpy can be numpy's
    if numpy is not None and isinstance(extra, (numpy.floating, numpy.complexfloating)):
        # float32, float16, complex64: not float subclasses, and == cannot tell -0.0 from 0.0
        number = complex(extra) if isinstance(extra, numpy.complexfloating) else float(extra)
        return (kind, _number_parts(number))
    return (kind, extra) if extra is not None else None


#: Exact types whose values key as themselves (no NaN among them); their subclasses do not.
_PLAIN = frozenset({int, str, bool, bytes})
#: Exact types a flat tuple key may hold for :func:`typed_key`'s fast path.
_FLAT = _PLAIN | {type(None), float}


def _number_parts(value: complex) -> tuple[Any, ...]:
    """A float's or complex number's stand-in in a key, as
    :func:`~graphtune.graphs.values.same_constant` compares them: every NaN part is one
    ``"nan"``, and a zero part carries its sign (``-0.0 == 0.0`` would make them one key)."""
    parts = (value.real, value.imag) if isinstance(value, complex) else (value, 0.0)
    return tuple(
        "nan" if part != part else (part, math.copysign(1.0, part)) if part == 0 else part
        for part in parts
    )


def check_key(extra: Hashable) -> None:
    """Refuses a ``key_fn`` value that would key graphs by object identity.

    Raises:
        ConfigError: ``extra`` is a tensor or holds one in a tuple or frozenset, at any depth
            (hashed by identity: new buffers and graphs for every call), or it cannot be hashed.
    """
    try:
        hash(extra)
    except TypeError:
        raise unhashable_key_error(extra) from None
    if _holds_tensor(extra):
        raise ConfigError(
            "key_fn returned a tensor, which would key graphs by the tensor object (new buffers "
            "and graphs every call); return a Python value, e.g. int(t)"
        )


def _holds_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor or a tuple or frozenset holding one (the containers a
    hashable key can hold one in; another object hashes as it defines)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, frozenset)):
        return any(_holds_tensor(item) for item in value)
    return False


def unhashable_key_error(extra: Any) -> ConfigError:
    """The error of a ``key_fn`` value that cannot key a graph."""
    return ConfigError(
        f"key_fn returned {extra!r}, which cannot key a graph (not hashable); return a tuple, a "
        "string or a number"
    )


def named_inputs_error(named: dict[str, Any]) -> InputError:
    """The error of a runner call with inputs given by name (graphs take positional inputs)."""
    return InputError(
        f"the graph runner takes positional inputs only, got {sorted(named)} by name; pass them "
        "in fn's order (or in a dict input)"
    )
