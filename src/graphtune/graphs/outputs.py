"""Static outputs of a captured graph, and the row rules that slice them to the real batch.

A graph writes its outputs at the padded size; each tensor output gets a *row rule* from its
shapes at the key's captured sizes (and at batches seen eagerly): sliced to the real batch, to
``min(batch, cap)``, or returned as it is (:func:`row_rules`). An output with the same rows at
every observed size, no more than the smallest, fits both "returned as it is" and "capped at
those rows"; :func:`undecided_rows` says below which batch the two differ.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from graphtune.errors import ConfigError
from graphtune.graphs.tree import flatten_with_paths, path_str
from graphtune.graphs.values import same_constant

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

    @classmethod
    def seen(cls, outputs: Any, n: int) -> StaticOutputs:
        """What the outputs of an eager call of batch ``n`` tell of each output's rows, for
        :func:`row_rules` beside the captured sizes: tensors kept as meta tensors of their
        shapes (no memory held).

        Raises:
            ConfigError: An output is an object with a tensor field (as captures refuse).
        """
        leaves, _, spec = flatten_with_paths(outputs)
        shapes = [
            torch.empty(x.shape, device="meta") if isinstance(x, torch.Tensor) else x
            for x in leaves
        ]
        return cls(spec.unflatten(shapes), n)

    @property
    def rules(self) -> list[RowRule]:
        """The row rule of each leaf, as this graph slices now."""
        return list(self._rules)

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
    dataclass, any object with a ``__dict__`` or ``__slots__``) holding a tensor, directly or in
    containers or objects nested up to ``depth`` deep; ``None`` when none does (modules
    excepted)."""
    if depth <= 0 or isinstance(value, (type, torch.nn.Module)):
        return None
    if dataclasses.is_dataclass(value):
        fields: Any = {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
    else:
        fields = dict(getattr(value, "__dict__", None) or {})
        for cls in type(value).__mro__:  # a class with __slots__ keeps its fields out of __dict__
            names = cls.__dict__.get("__slots__", ())
            for name in (names,) if isinstance(names, str) else names:
                if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                    fields[name] = getattr(value, name)
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


def undecided_rows(outputs: list[StaticOutputs], rules: list[RowRule]) -> tuple[int, list[str]]:
    """The batch below which some output's rows are not known, and those outputs' paths.

    An output returned as it is (rule ``None``) whose rows ``r`` are at most the smallest size
    in ``outputs`` fits "the batch capped at ``r``" too (``x[:r]``, as the engine's prefill
    returns its logits): both give ``r`` rows to a call of ``r`` or more, but to a smaller batch
    ``n`` a cap gives ``n`` rows and a constant ``r``, and nothing observed tells which. Returns
    ``(1, [])`` when every output is decided. A leaf with no rows (a scalar), or more rows than
    some observed size (a ``[vocab]`` table), is decided.
    """
    smallest = min(o.size for o in outputs)
    low, paths = 1, []
    for index, (rule, path) in enumerate(zip(rules, outputs[0].paths, strict=True)):
        rows = _rows(outputs[0]._leaves[index])
        if rule is None and rows is not None and rows <= smallest:
            low = max(low, rows)
            paths.append(path_str(path, "<output>"))
    return low, paths
