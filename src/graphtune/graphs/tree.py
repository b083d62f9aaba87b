"""Flattening of nested inputs and outputs (tuples, lists, namedtuples, dicts) with paths.

A *path* names a leaf by the indices and keys that lead to it from the runner's positional
arguments: ``"0"`` is the first argument, ``"1.positions"`` the key ``positions`` of the dict passed
second, ``"2.0"`` the first element of the third argument. Paths appear in every error message and
key the ``pad`` and ``batched`` mappings.

Only ``tuple``, ``list`` and ``dict`` (and their subclasses: namedtuples, ``torch.return_types``,
``OrderedDict``, ``ModelOutput``-like dicts, rebuilt with their type) are traversed; anything else
(tensors, numbers, strings, ``None``, arbitrary objects) is a leaf. A :class:`TreeSpec` built once
at capture time re-flattens later calls without re-discovering the structure and reports the
first difference as an :class:`~graphtune.errors.InputError`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from graphtune.errors import ConfigError, InputError

Path = tuple[Hashable, ...]

_LEAF, _SEQ, _DICT = 0, 1, 2


def path_str(path: Path, root: str = "<inputs>") -> str:
    """Dotted form of a path (``(1, "positions")`` -> ``"1.positions"``); ``root`` when empty."""
    return ".".join(str(part) for part in path) if path else root


class TreeSpec:
    """The container structure of a value, without its leaves.

    Attributes:
        num_leaves: Number of leaves in flattening order.
    """

    __slots__ = ("kind", "type", "keys", "children", "num_leaves")

    def __init__(self, kind: int, type_: type | None, keys: tuple, children: tuple) -> None:
        self.kind = kind
        self.type = type_
        self.keys = keys
        self.children = children
        self.num_leaves = 1 if kind == _LEAF else sum(c.num_leaves for c in children)

    @property
    def is_leaf(self) -> bool:
        """Whether this spec is a single leaf."""
        return self.kind == _LEAF

    @property
    def is_flat(self) -> bool:
        """Whether this is a tuple/list whose children are all leaves (the common call shape)."""
        return self.kind == _SEQ and all(c.kind == _LEAF for c in self.children)

    def flatten(self, value: Any, root: str = "<inputs>") -> list:
        """Leaves of ``value`` in this spec's order.

        Dict leaves are looked up by the recorded keys, so a dict with the same keys in another
        insertion order still lines up.

        Raises:
            InputError: ``value`` does not have this structure (names the first differing path).
        """
        out: list = []
        self._flatten(value, out, (), root)
        return out

    def _flatten(self, value: Any, out: list, path: Path, root: str) -> None:
        kind = self.kind
        if kind == _LEAF:
            out.append(value)
        elif kind == _SEQ:
            if not isinstance(value, (tuple, list)) or len(value) != len(self.children):
                raise _mismatch(self, value, path, root)
            for index, (child, item) in enumerate(zip(self.children, value, strict=True)):
                child._flatten(item, out, path + (index,), root)
        else:
            if not isinstance(value, dict) or len(value) != len(self.keys):
                raise _mismatch(self, value, path, root)
            for key, child in zip(self.keys, self.children, strict=True):
                if key not in value:
                    raise _mismatch(self, value, path, root)
                child._flatten(value[key], out, path + (key,), root)

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        """Rebuilds a value of this structure from leaves in flattening order."""
        if self.kind == _LEAF:
            return leaves[0]
        return self._build(iter(leaves))

    def _build(self, it: Iterator[Any]) -> Any:
        kind = self.kind
        if kind == _LEAF:
            return next(it)
        items = [child._build(it) for child in self.children]
        if kind == _SEQ:
            if self.type is list:
                return items
            if self.type is tuple:
                return tuple(items)
            assert self.type is not None
            return rebuild_sequence(self.type, items)
        mapping = dict(zip(self.keys, items, strict=True))
        if self.type in (dict, None):
            return mapping
        assert self.type is not None
        return _rebuild_mapping(self.type, mapping)

    def describe(self) -> str:
        """Short human description, e.g. ``tuple(3)`` or ``dict['ids', 'pos']``."""
        if self.kind == _LEAF:
            return "leaf"
        if self.kind == _SEQ:
            return f"{self.type.__name__}({len(self.children)})"  # type: ignore[union-attr]
        return f"dict{list(self.keys)!r}"


def rebuild_sequence(type_: type, items: list) -> Any:
    """A tuple or list subclass rebuilt with its type: a namedtuple (``_fields``) from its
    fields, any other (``torch.return_types``, a list subclass) from one sequence; a plain
    tuple or list when the type cannot be built that way."""
    try:
        if hasattr(type_, "_fields"):
            return type_(*items)
        return type_(items)
    except Exception:  # a constructor with other arguments: keep the values, lose the type
        return list(items) if issubclass(type_, list) else tuple(items)


def _rebuild_mapping(type_: type, mapping: dict) -> Any:
    """A dict subclass (``OrderedDict``, an HF ``ModelOutput``-like class) rebuilt with its
    type from its items, else from its keys as keywords; a plain dict when neither works."""
    for build in (lambda: type_(mapping), lambda: type_(**mapping)):
        try:
            value = build()
        except Exception:  # the second form is the fallback of the first
            continue
        if isinstance(value, type_) and isinstance(value, dict) and list(value) == list(mapping):
            return value
    return mapping


def _mismatch(spec: TreeSpec, value: Any, path: Path, root: str) -> InputError:
    if isinstance(value, dict):
        got = f"dict{list(value.keys())!r}"
    elif isinstance(value, (tuple, list)):
        got = f"{type(value).__name__}({len(value)})"
    else:
        got = type(value).__name__
    return InputError(
        f"{root} at {path_str(path, root)} has structure {got} but the captured structure is "
        f"{spec.describe()}: a runner's inputs must keep the structure of the inputs its buffers "
        "were built from; pass the same containers and keys, or return a different key_fn value "
        "for this variant so it gets its own buffers and graphs"
    )


def flatten_with_paths(value: Any) -> tuple[list, list[Path], TreeSpec]:
    """Discovers the structure of ``value``.

    Returns:
        ``(leaves, paths, spec)`` with leaves and paths in flattening order (dict insertion order).
    """
    leaves: list = []
    paths: list[Path] = []
    spec = _discover(value, (), leaves, paths)
    return leaves, paths, spec


def _discover(value: Any, path: Path, leaves: list, paths: list[Path]) -> TreeSpec:
    if isinstance(value, (tuple, list)):
        children = tuple(_discover(v, path + (i,), leaves, paths) for i, v in enumerate(value))
        return TreeSpec(_SEQ, type(value), (), children)
    if isinstance(value, dict):
        keys = tuple(value.keys())
        children = tuple(_discover(value[k], path + (k,), leaves, paths) for k in keys)
        return TreeSpec(_DICT, type(value), keys, children)
    leaves.append(value)
    paths.append(path)
    return TreeSpec(_LEAF, None, (), ())


def map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    """Applies ``fn`` to every leaf and rebuilds the structure (not for hot paths)."""
    leaves, _, spec = flatten_with_paths(value)
    return spec.unflatten([fn(leaf) for leaf in leaves])


def resolve_rules(
    rules: Any,
    paths: Sequence[Path],
    *,
    name: str,
    is_rule: Callable[[Any], bool],
) -> list[Any]:
    """Resolves a per-input rule argument (``pad`` or ``batched``) to one rule per leaf path.

    ``rules`` is one of:

    * ``None``: no rule anywhere (every entry is ``None``).
    * a single rule (``is_rule(rules)``): applies to every leaf.
    * a ``dict`` mapping dotted path strings (or ints for positional arguments) to rules.
    * a tuple/list shaped like the positional arguments, with rules (or ``None``) at any depth.

    A rule placed at a path applies to every leaf below it; the most specific path wins.

    Raises:
        ConfigError: A path in the mapping matches no input, or a value is not a valid rule.
    """
    if rules is None:
        return [None] * len(paths)
    if is_rule(rules):
        return [rules] * len(paths)
    known = {
        tuple(str(p) for p in path[:depth]) for path in paths for depth in range(len(path) + 1)
    }
    table: dict[tuple[str, ...], Any] = {}
    if isinstance(rules, dict):
        for key, rule in rules.items():
            table[_parse_path(str(key), known, name)] = rule
    elif isinstance(rules, (tuple, list)):
        _collect_structured(rules, (), table, is_rule)
    else:
        raise ConfigError(
            f"{name}={rules!r} is neither a rule, a dict of input paths to rules, nor a "
            "tuple/list shaped like the inputs; see docs/graph-runner.md for the accepted forms"
        )
    for parts, rule in table.items():
        if parts not in known:
            listing = ", ".join(sorted(path_str(p) for p in paths)) or "(none)"
            raise ConfigError(
                f"{name} names input path {'.'.join(parts)!r}, which matches no input; "
                f"input paths are: {listing}"
            )
        if rule is not None and not is_rule(rule):
            raise ConfigError(f"{name} at {'.'.join(parts)!r} is not a valid rule: {rule!r}")
    resolved = []
    for path in paths:
        parts = tuple(str(p) for p in path)
        rule = None
        for depth in range(len(parts), -1, -1):
            if parts[:depth] in table and table[parts[:depth]] is not None:
                rule = table[parts[:depth]]
                break
        resolved.append(rule)
    return resolved


def _parse_path(text: str, known: set[tuple[str, ...]], name: str) -> tuple[str, ...]:
    """The path a dotted string names: an input path whose dotted form it is (so a dict key
    that contains a dot can be named), else the string split at its dots."""
    matches = [parts for parts in known if ".".join(parts) == text]
    if len(matches) > 1:
        raise ConfigError(
            f"{name} names input path {text!r}, the dotted form of {len(matches)} inputs (a dict "
            "key contains '.'); give this rule in the structured form, shaped like the inputs, "
            f"e.g. {name}=(None, {{'slot.id': 3}})"
        )
    if matches:
        return matches[0]
    return tuple(text.split(".")) if text else ()


def _collect_structured(
    value: Any, prefix: tuple[str, ...], table: dict, is_rule: Callable[[Any], bool]
) -> None:
    if isinstance(value, (tuple, list)) and not is_rule(value):
        for index, item in enumerate(value):
            _collect_structured(item, prefix + (str(index),), table, is_rule)
    elif isinstance(value, dict):
        for key, item in value.items():
            _collect_structured(item, prefix + (str(key),), table, is_rule)
    elif value is not None:
        table[prefix] = value
