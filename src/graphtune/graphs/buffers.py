"""Static input buffers and copy-in with pad rules (padding.py); outputs are in outputs.py.

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

from collections.abc import Callable
from typing import Any

import torch

from graphtune.errors import ConfigError, InputError
from graphtune.graphs.outputs import tensor_field
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
        self._static_tensors: list[int] = []  # checked every call to be tensors still
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
                self._static_tensors.append(index)
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
            ConfigError: ``pad`` or ``batched`` names unknown paths or holds invalid rules, or
                an input that is not a tensor or container holds a tensor (a dataclass field).
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
                _check_constant(leaf, path)
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
                raise _inference_error() from None
        for fill in rows.pads:
            fill()
        self.check_unbatched(leaves, debug)

    def check(self, leaves: Any, n: int, debug: bool) -> None:
        """Raises the InputError :meth:`copy_in` raises for a call's ``leaves`` of batch ``n``,
        without copying: the runner checks each call it runs eagerly whose outputs count as
        evidence (of the key's row rules, of whether they require grad), since the outputs of
        inputs a replay would refuse tell nothing true of the key."""
        for index, buf in self._buffers.items():
            got = leaves[index]
            if not (
                isinstance(got, torch.Tensor)
                and got.shape == (n, *self._trailing[index])
                and got.dtype == buf.dtype
                and got.device == buf.device
            ):
                raise self._mismatch(index, got, n, leaves)
            if buf.is_inference() and not torch.is_inference_mode_enabled():
                raise _inference_error()
        self.check_unbatched(leaves, debug)

    def check_unbatched(self, leaves: Any, debug: bool) -> None:
        """Raises InputError when a constant differs from the captured one, a non-batched tensor
        is not a tensor any more, or (``debug``) not the captured one: what a call refuses
        besides its batched inputs (:meth:`copy_in` and :meth:`check` both check it here)."""
        for index in self._static_tensors:
            got = leaves[index]
            if not isinstance(got, torch.Tensor):
                raise InputError(
                    f"input {path_str(self.paths[index])} got a value of type "
                    f"{type(got).__name__}, but the graph was captured with a non-batched tensor "
                    "there, which it reads at its captured address and would keep reading; pass "
                    "the same tensor object every call, or return a different key_fn value for "
                    "this variant"
                )
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
        n = leaves[self.batch_index].shape[0]
        self.check(leaves, n, debug)
        for index, buf in self._buffers.items():
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


def _check_constant(leaf: Any, path: Path) -> None:
    """Refuses a leaf the tree walker does not look into (a dataclass, an object of your own
    class) that holds a tensor: as a constant it is compared as one object, so the graph would
    keep reading the tensor the field held at capture, whatever the field holds later.

    Raises:
        ConfigError: ``leaf`` has a field holding a tensor (:func:`tensor_field`).
    """
    field = tensor_field(leaf)
    if field is not None:
        raise ConfigError(
            f"input {path_str(path)} is a {type(leaf).__qualname__} whose field {field!r} holds "
            "a tensor: the graph runner looks only into tuples, lists and dicts (NamedTuples and "
            "dict subclasses too), so it would bake this object in and keep reading the tensor "
            "captured, ignoring later values; pass the tensor as an input of its own, or carry "
            "it in a tuple, list, dict or NamedTuple"
        )


def _find_batch_index(leaves: list, is_tensor: list[bool], explicit: list) -> int | None:
    """The first tensor with a leading dim that is not marked non-batched (docs/graph-runner.md)."""
    for index, (leaf, tensor, flag) in enumerate(zip(leaves, is_tensor, explicit, strict=True)):
        if tensor and flag is not False and leaf.dim() >= 1:
            return index
    return None


def _inference_error() -> InputError:
    """The error of a call that would write buffers made under ``torch.inference_mode()``."""
    return InputError(
        "the graph runner's buffers were made under torch.inference_mode() and this call runs "
        "outside it, where they cannot be written; call the runner under "
        "torch.inference_mode() too (or capture outside it)"
    )


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
