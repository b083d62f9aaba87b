"""Static input buffers, copy-in with pad rules (padding.py), and slicing of captured outputs.

One :class:`StaticInputs` exists per extra key (``key_fn`` value). It is built once from example
inputs: every *batched* tensor gets a buffer of ``rows`` (the largest capture size) rows with the
same trailing shape, dtype and device; non-batched tensors and constants are kept as they were
given, because a captured graph reads exactly those addresses and values. All graphs of that extra
key read the leading rows of the same buffers.

Per real batch size ``n`` the views a call needs (``buf[:n]`` to copy into, ``buf[n:s]`` to pad)
are built once and cached, so the hot path is one ``copy_`` per batched input plus one fill per
padded input, with no tree rebuilding and no host synchronisation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from graphtune.errors import ConfigError, InputError
from graphtune.graphs.padding import check_pad_value, is_pad_rule, pad_filler
from graphtune.graphs.tree import Path, TreeSpec, flatten_with_paths, path_str, resolve_rules
from graphtune.graphs.values import same_constant

BatchedPredicate = Callable[[str, torch.Tensor], bool]


def _is_batched_flag(value: Any) -> bool:
    return isinstance(value, bool)


class _Rows:
    """Cached views for one real batch size ``n`` (padded to ``s``)."""

    __slots__ = ("copies", "pads")

    def __init__(self, copies: list, pads: list) -> None:
        self.copies = copies
        self.pads = pads


class StaticInputs:
    """Buffers and flattening plan for one extra key. Build with :meth:`build`.

    Attributes:
        spec: Structure of the positional arguments.
        paths: Path of each leaf.
        batch_index: Leaf index whose leading dim is a call's batch size.
        rows: Rows allocated per batched buffer (the largest capture size).
    """

    def __init__(
        self,
        spec: TreeSpec,
        paths: list[Path],
        leaves: list,
        flags: list[bool],
        rules: list,
        batch_index: int,
        rows: int,
    ) -> None:
        self.spec = spec
        self.paths = paths
        self.batch_index = batch_index
        self.rows = rows
        self._flat = spec.is_flat
        self._num_leaves = spec.num_leaves
        self._statics: list[Any] = list(leaves)  # graphs read these non-batched leaves
        self._buffers: dict[int, torch.Tensor] = {}
        self._rules: dict[int, Any] = {}
        self._trailing: dict[int, tuple[int, ...]] = {}
        self._constants: list[tuple[int, Any]] = []
        # Non-batched tensors by what a graph reads of them: address, shape and strides (a view
        # such as w.t() or w[:, :2] shares w's address but is another tensor).
        self._static_ptrs: list[tuple[int, tuple[Any, ...]]] = []
        example_batch = leaves[batch_index].shape[0]
        for index, (leaf, batched) in enumerate(zip(leaves, flags, strict=True)):
            if batched:
                buf = torch.empty((rows, *leaf.shape[1:]), dtype=leaf.dtype, device=leaf.device)
                real = min(example_batch, rows)
                buf[:real].copy_(leaf[:real])
                if real < rows:
                    pad_filler(rules[index], buf[real:], buf[:real])()
                self._buffers[index] = buf
                self._rules[index] = rules[index]
                self._trailing[index] = tuple(leaf.shape[1:])
                self._statics[index] = None
            elif isinstance(leaf, torch.Tensor):
                self._static_ptrs.append((index, _layout(leaf)))
            else:
                self._constants.append((index, leaf))
        self._views: dict[tuple[int, int], _Rows] = {}  # by (rows copied, padded size)

    @classmethod
    def build(
        cls,
        inputs: tuple,
        *,
        rows: int,
        pad: Any = None,
        batched: Any = None,
        device_type: str | None = None,
    ) -> StaticInputs | None:
        """Builds buffers from example inputs, or returns None when no tensor is batched.

        Args:
            inputs: The positional arguments as passed to ``fn``.
            rows: Rows per buffer (the largest capture size).
            pad: Pad rule argument (see :func:`graphtune.graphs.tree.resolve_rules`).
            batched: Predicate ``(path, tensor) -> bool``, or bools by path/structure.
            device_type: Required device type of batched tensors (``"cuda"``), or None.

        Raises:
            ConfigError: ``pad`` or ``batched`` names unknown paths or holds invalid rules.
            InputError: A tensor marked batched disagrees with the batch size, or a batched
                tensor is on the wrong device type.
        """
        leaves, paths, spec = flatten_with_paths(inputs)
        is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        explicit = _explicit_flags(leaves, paths, is_tensor, batched)
        batch_index = _find_batch_index(leaves, is_tensor, explicit)
        if batch_index is None or leaves[batch_index].shape[0] < 1:
            return None
        batch = leaves[batch_index].shape[0]
        flags = []
        for leaf, tensor, flag, path in zip(leaves, is_tensor, explicit, paths, strict=True):
            if not tensor:
                flags.append(False)
                continue
            default = leaf.dim() >= 1 and leaf.shape[0] == batch
            marked = default if flag is None else flag
            if marked and not default:
                raise InputError(
                    f"input {path_str(path)} is marked batched but its shape {tuple(leaf.shape)} "
                    f"does not start with the batch size {batch} (taken from input "
                    f"{path_str(paths[batch_index])}); fix the batched= argument or the input"
                )
            if marked and device_type is not None and leaf.device.type != device_type:
                raise InputError(
                    f"batched input {path_str(path)} is on {leaf.device}, but graphs capture "
                    f"{device_type} work only; move it to {device_type} or use EagerRunner"
                )
            flags.append(marked)
        rules = resolve_rules(pad, paths, name="pad", is_rule=is_pad_rule)
        named = {str(key) for key in pad} if isinstance(pad, dict) else set()
        for marked, path in zip(flags, paths, strict=True):
            if not marked and path_str(path) in named:  # a rule for this very input
                raise ConfigError(
                    f"pad names input {path_str(path)}, which is not batched (its leading dim is "
                    f"not the batch {batch} of input {path_str(paths[batch_index])}); drop its pad "
                    "rule, or pass it with the batch as its leading dim"
                )
        for leaf, marked, rule, path in zip(leaves, flags, rules, paths, strict=True):
            if marked:
                check_pad_value(rule, leaf, path)
        return cls(spec, paths, leaves, flags, rules, batch_index, rows)

    # ---------------------------------------------------------------- per call (hot path)

    def flatten(self, inputs: tuple) -> Any:
        """Leaves of a call's inputs in plan order (a tuple for flat argument lists)."""
        if self._flat and len(inputs) == self._num_leaves:
            return inputs
        return self.spec.flatten(inputs)

    def copy_in(self, leaves: Any, n: int, s: int, debug: bool) -> None:
        """Copies batched leaves into ``buf[:n]``, fills ``buf[n:s]`` by the pad rules.

        Raises:
            InputError: A batched input has the wrong shape, dtype or device; a constant differs
                from the captured one; or (``debug``) a non-batched tensor moved.
        """
        rows = self._views.get((n, s))
        if rows is None:
            rows = self._make_rows(n, s)
        for index, dst, shape, dtype, device in rows.copies:
            src = leaves[index]
            try:
                ok = src.shape == shape and src.dtype == dtype and src.device == device
            except AttributeError:
                ok = False
            if not ok:
                raise self._mismatch(index, src, n, leaves)
            try:
                dst.copy_(src)
            except RuntimeError as exc:
                if "inference tensor" not in str(exc):
                    raise
                raise InputError(
                    "the graph runner's buffers were made under torch.inference_mode() and this "
                    "call runs outside it, where they cannot be written; call the runner under "
                    "torch.inference_mode() too (or capture outside it)"
                ) from None
        for fill in rows.pads:
            fill()
        self.check_unbatched(leaves, debug)

    def check_unbatched(self, leaves: Any, debug: bool) -> None:
        """Raises InputError when a constant differs from the captured one, or (``debug``) a
        non-batched tensor is not the captured one: what a call refuses besides its batched
        inputs (:meth:`copy_in` and :meth:`padded_copy` both check it here)."""
        for index, value in self._constants:
            got = leaves[index]
            if got is not value and not same_constant(got, value):
                raise InputError(
                    f"input {path_str(self.paths[index])} is {got!r} but the graph was captured "
                    f"with {value!r}: non-tensor inputs are baked into the graph; pass it as a "
                    "tensor, or return it from key_fn so each value gets its own graphs"
                )
        if debug:
            self.check_statics(leaves)

    def first_rows(self, leaves: Any) -> list:
        """``leaves`` with each batched tensor cut to the buffers' rows (as :meth:`build` copies
        examples with more rows than the buffers hold)."""
        return [
            leaf[: self.rows] if index in self._buffers else leaf
            for index, leaf in enumerate(leaves)
        ]

    def check_statics(self, leaves: Any) -> None:
        """Raises InputError when a non-batched tensor is not the captured one (its address,
        shape, strides or dtype differ)."""
        for index, layout in self._static_ptrs:
            got = leaves[index]
            if not isinstance(got, torch.Tensor) or _layout(got) != layout:
                raise InputError(
                    f"non-batched input {path_str(self.paths[index])} changed address (or shape, "
                    "strides, dtype) since capture: the graph reads the original tensor's memory, "
                    "so another tensor or view would be silently ignored; pass the same tensor "
                    "object every call (update it in place with copy_), or mark it batched if "
                    "its leading dim is the batch"
                )

    def _make_rows(self, n: int, s: int) -> _Rows:
        copies = []
        pads = []
        for index, buf in self._buffers.items():
            shape = torch.Size((n, *self._trailing[index]))
            copies.append((index, buf[:n], shape, buf.dtype, buf.device))
            if n < s:
                pads.append(pad_filler(self._rules[index], buf[n:s], buf[:n]))
        rows = _Rows(copies, pads)
        self._views[(n, s)] = rows
        return rows

    def _mismatch(self, index: int, got: Any, n: int, leaves: Any) -> InputError:
        buf = self._buffers[index]
        expected = f"shape {(n, *self._trailing[index])}, dtype {buf.dtype}, device {buf.device}"
        if isinstance(got, torch.Tensor):
            actual = f"shape {tuple(got.shape)}, dtype {got.dtype}, device {got.device}"
        else:
            actual = f"a {type(got).__name__}"
        return InputError(
            f"input {path_str(self.paths[index])}: expected {expected} (leading dim = this call's "
            f"batch size from input {path_str(self.paths[self.batch_index])}; the rest as in the "
            f"inputs the buffers were built from), got {actual}. Pass inputs with the captured "
            "dtype and trailing shape, or return a different key_fn value for this variant"
        )

    # ---------------------------------------------------------------- capture time

    def static_args(self, s: int) -> tuple:
        """Positional arguments for capturing size ``s``: ``buf[:s]`` views plus the statics."""
        leaves = [
            self._buffers[i][:s] if i in self._buffers else leaf
            for i, leaf in enumerate(self._statics)
        ]
        return self.spec.unflatten(leaves)

    def padded_copy(self, inputs: tuple, s: int, debug: bool = False) -> tuple:
        """Eager-equivalent inputs padded to ``s`` rows (for tests and benchmarks; allocates).

        Raises:
            InputError: What :meth:`copy_in` raises for these inputs.
        """
        leaves = list(self.spec.flatten(inputs))
        self.check_unbatched(leaves, debug)
        n = leaves[self.batch_index].shape[0]
        for index, buf in self._buffers.items():
            got = leaves[index]
            if not (
                isinstance(got, torch.Tensor)
                and tuple(got.shape) == (n, *self._trailing[index])
                and got.dtype == buf.dtype
                and got.device == buf.device
            ):
                raise self._mismatch(index, got, n, leaves)
            padded = torch.empty((s, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
            padded[:n].copy_(leaves[index])
            if n < s:
                pad_filler(self._rules[index], padded[n:], padded[:n])()
            leaves[index] = padded
        return self.spec.unflatten(leaves)

    @property
    def nbytes(self) -> int:
        """Bytes held by the static buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def batched_paths(self) -> list[str]:
        """Dotted paths of the batched inputs."""
        return [path_str(self.paths[i]) for i in self._buffers]


def batch_size(inputs: tuple, batched: Any = None) -> int | None:
    """The batch size :meth:`StaticInputs.build` would read from ``inputs`` (the leading dim of
    the tensor that gives it, possibly 0), or None when no tensor has a leading dim; allocates
    nothing (a frozen runner routes a new key's call with it).

    Raises:
        ConfigError: ``batched`` names paths that match no input (as :meth:`build` raises).
    """
    leaves, paths, _ = flatten_with_paths(inputs)
    is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
    explicit = _explicit_flags(leaves, paths, is_tensor, batched)
    index = _find_batch_index(leaves, is_tensor, explicit)
    return None if index is None else int(leaves[index].shape[0])


def _explicit_flags(leaves: list, paths: list[Path], is_tensor: list[bool], batched: Any) -> list:
    """Each leaf's ``batched`` mark: True, False, or None (decided by its leading dim)."""
    if callable(batched) and not isinstance(batched, (tuple, list, dict)):
        return [
            bool(batched(path_str(p), leaf)) if t else None
            for p, leaf, t in zip(paths, leaves, is_tensor, strict=True)
        ]
    return resolve_rules(batched, paths, name="batched", is_rule=_is_batched_flag)


def _find_batch_index(leaves: list, is_tensor: list[bool], explicit: list) -> int | None:
    """The first tensor with a leading dim that is not marked non-batched (docs/graph-runner.md)."""
    for index, (leaf, tensor, flag) in enumerate(zip(leaves, is_tensor, explicit, strict=True)):
        if tensor and flag is not False and leaf.dim() >= 1:
            return index
    return None


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


#: A row rule: ``None`` returns a leaf as it is; a number ``c`` slices it to ``min(n, c)`` rows
#: (:data:`BATCH`: to the real batch ``n``).
RowRule = int | None
BATCH = 1 << 62


class StaticOutputs:
    """The outputs one graph writes, and cached per-``n`` views of them.

    Each tensor leaf has a row rule. With one captured size of the key, a leaf whose leading dim
    equals the size is sliced to the real batch and any other is returned as it is; once the
    key has several sizes, :func:`row_rules` decides each leaf from its rows at every size.
    """

    def __init__(self, outputs: Any, size: int) -> None:
        leaves, paths, spec = flatten_with_paths(outputs)
        self.spec = spec
        self.paths = paths
        self.size = size
        self._leaves = leaves
        self._is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        for leaf, path, tensor in zip(leaves, paths, self._is_tensor, strict=True):
            field = None if tensor else tensor_field(leaf)
            if field is not None:
                raise ConfigError(
                    f"output {path_str(path, '<output>')} is a {type(leaf).__qualname__} whose "
                    f"field {field!r} holds a tensor: the graph runner slices tensors to the real "
                    "batch only inside tuples, lists and dicts, and would return this object as "
                    "it is, with the padded rows; return a tuple, dict or NamedTuple instead"
                )
        self._rules: list[RowRule] = [BATCH if _rows(x) == size else None for x in leaves]
        self._views: dict[int, list] = {}

    def use_rules(self, rules: list[RowRule]) -> None:
        """Slices by ``rules`` from now on (one per leaf, from :func:`row_rules`)."""
        self._rules = list(rules)
        self._views.clear()

    def result(self, n: int, clone: bool) -> Any:
        """Outputs for a call of real batch ``n`` (views into graph memory unless ``clone``)."""
        views = self._views.get(n)
        if views is None:
            pairs = zip(self._leaves, self._rules, strict=True)
            views = [x if cap is None else x[: min(n, cap)] for x, cap in pairs]
            self._views[n] = views
        if clone:
            views = [x.clone() if t else x for x, t in zip(views, self._is_tensor, strict=True)]
        return self.spec.unflatten(views)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The full-size output tensors (for tests)."""
        return [x for x, t in zip(self._leaves, self._is_tensor, strict=True) if t]


def tensor_field(value: Any, depth: int = 3) -> str | None:
    """The name of a field of ``value`` (an object that is not a tuple, list or dict: a
    dataclass, any object with a ``__dict__``) holding a tensor, directly or in containers or
    objects nested up to ``depth`` deep; ``None`` when none does (modules excepted)."""
    if depth <= 0 or isinstance(value, (type, torch.nn.Module)):
        return None
    if dataclasses.is_dataclass(value):
        fields: Any = {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
    else:
        fields = getattr(value, "__dict__", None)
    if not isinstance(fields, dict):
        return None
    for name, field in fields.items():
        for leaf in flatten_with_paths(field)[0]:
            if isinstance(leaf, torch.Tensor) or tensor_field(leaf, depth - 1) is not None:
                return str(name)
    return None


def _rows(x: Any) -> int | None:
    return x.shape[0] if isinstance(x, torch.Tensor) and x.dim() >= 1 else None


def row_rules(outputs: list[StaticOutputs]) -> list[RowRule] | str:
    """Each leaf's row rule from its shapes at the key's captured sizes (two or more), or why
    some leaf fits none. A tensor leaf must, at every size ``s``, have ``s`` rows (the batch:
    sliced to ``n``), one shape (returned as it is, even when its rows equal some size), or
    ``min(s, cap)`` rows (sliced to ``min(n, cap)``, as the engine's prefill returns its logits);
    its other dims may not change. A leaf that is not a tensor must be equal at every size.
    ``x[1:]``, ``x.t()`` or ``x @ x.t()`` fit none, and slicing them would return padded rows or
    a wrong shape without an error."""
    first = outputs[0]
    for other in outputs[1:]:
        if other.paths != first.paths:
            return (
                f"the outputs have other leaves at size {other.size} ({len(other.paths)}) than "
                f"at size {first.size} ({len(first.paths)}); fn must return one structure"
            )
    by_size = sorted(outputs, key=lambda o: o.size)
    rules: list[RowRule] = []
    for index, path in enumerate(first.paths):
        leaves = [o._leaves[index] for o in by_size]
        if not all(isinstance(x, torch.Tensor) for x in leaves):
            # A value that depends on the size (x.shape[0]) would come back as the padded size's.
            if any(isinstance(x, torch.Tensor) or not same_constant(x, leaves[0]) for x in leaves):
                seen = ", ".join(
                    f"{x!r:.40} at size {o.size}" for x, o in zip(leaves, by_size, strict=True)
                )
                return (
                    f"output {path_str(path, '<output>')} is {seen}: a value that is not a "
                    "tensor is returned as captured, so it may not depend on the batch; return "
                    "it as a tensor with the batch as its first dim, or compute it outside fn"
                )
            rules.append(None)
            continue
        sizes = [o.size for o in by_size]
        shapes = [tuple(x.shape) for x in leaves]
        rows = [_rows(x) for x in leaves]
        rule = _rule(sizes, shapes, rows)
        if isinstance(rule, str):
            seen = ", ".join(f"{s} at size {n}" for s, n in zip(shapes, sizes, strict=True))
            return (
                f"output {path_str(path, '<output>')} is {seen}, so it cannot be sliced to "
                "the real batch: the graph runner slices an output whose first dim is the batch "
                "(or min(batch, a cap)) and returns one that does not depend on the batch as it "
                "is; this one is neither"
            )
        rules.append(rule)
    return rules


def _rule(sizes: list[int], shapes: list[tuple[int, ...]], rows: list[int | None]) -> RowRule | str:
    if len(set(shapes)) == 1:
        return None  # one shape at every size: not batched (even when it equals a size)
    if any(r is None for r in rows) or len({s[1:] for s in shapes}) != 1:
        return "unsliceable"
    if rows == sizes:
        return BATCH
    # More rows than the size at every size (torch.cat([x, x]), an extra row) leaves no cap.
    cap = max((r for r, s in zip(rows, sizes, strict=True) if r is not None and r < s), default=0)
    if cap and all(r == min(s, cap) for r, s in zip(rows, sizes, strict=True)):
        return cap
    return "unsliceable"
