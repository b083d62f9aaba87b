"""JSON forms of the values the tuner stores: tactics (lossless) and identities (canonical).

Two encodings, for two jobs:

* :func:`encode_value` / :func:`decode_value` keep a tactic's (or a recorded call's argument's)
  Python type through a JSON file (exact types only: a subclass is refused): a tuple comes back a
  tuple, an int an int, a float a float, a dict with non-string keys a dict with those keys, a
  ``torch.dtype`` or ``torch.device`` itself. JSON has lists and string-keyed objects only, so a
  tuple is written ``{"__tuple__": [...]}``, a dict whose keys are not all plain strings (or that
  could be read as such a tag) ``{"__dict__": [[key, value], ...]}``, a dtype
  ``{"__dtype__": "float16"}`` and a device ``{"__device__": "cuda:0"}``. Every other value is
  written as itself.
* :func:`identity_value` turns configuration (a runner's attributes, ``choose_one`` keyword
  arguments) into canonical JSON for a cache key. It accepts only values whose text is the same
  in every process: ``None``, bools, ints, finite floats (-0.0 as 0.0), strings, tuples and
  lists (one form: a tuple is keyed as the list of its items), sets (sorted), dicts with string
  keys, ``torch.dtype`` (``{"__dtype__": "float16"}``), ``torch.device`` (``{"__device__":
  "cuda:0"}``), enum members (``{"__enum__": "Class.NAME"}``) and dataclass instances
  (``{"__dataclass__": ["Class", {fields}]}``). Those four are tagged, so that none has the text
  of a plain string or dict (``torch.float16`` and ``"torch.float16"`` are two keys); a dict whose
  only key is such a tag is written ``{"__dict__": [[key, value], ...]}`` for the same reason.
  Anything else (a tensor, a lock, an arbitrary object whose ``str`` holds a memory address)
  raises :class:`IdentityError` naming it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import Any

import torch

from graphtune.errors import ConfigError

_TUPLE = "__tuple__"
_DICT = "__dict__"
_DTYPE = "__dtype__"
_DEVICE = "__device__"
_TAGS = (_TUPLE, _DICT, _DTYPE, _DEVICE)
# Identity texts only (a tactic that is an enum member or dataclass is refused, not encoded).
_ENUM = "__enum__"
_DATACLASS = "__dataclass__"
_IDENTITY_TAGS = (_DICT, _DTYPE, _DEVICE, _ENUM, _DATACLASS)


class IdentityError(ConfigError):
    """A value that must be part of a cache key has no stable text across processes."""


def encode_value(value: Any) -> Any:
    """The JSON form of ``value`` that :func:`decode_value` turns back into an equal value of the
    same types.

    Types are matched exactly: a subclass (a namedtuple, an ``IntEnum`` or ``str`` enum member,
    an ``OrderedDict``) would come back as its base type, so it is refused instead.

    Raises:
        TypeError: A value that is not None, a bool, int, float, string, tuple, list, dict,
            torch dtype or device (a subclass of one included).
        ValueError: A non-finite float (JSON has none).
    """
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        if not math.isfinite(value):
            raise ValueError(f"non-finite float {value!r} cannot be stored in JSON")
        return value
    if kind is tuple:
        return {_TUPLE: [encode_value(v) for v in value]}
    if kind is list:
        return [encode_value(v) for v in value]
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {_DEVICE: str(value)}
    if kind is dict:
        # type(k) is str: a str enum key would be written as its value and come back a str
        # (the pairs form below refuses it, as encode_value refuses an enum member itself).
        plain = all(type(k) is str for k in value) and not (
            len(value) == 1 and next(iter(value)) in _TAGS
        )
        if plain:
            return {k: encode_value(v) for k, v in value.items()}
        return {_DICT: [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    raise TypeError(
        f"{kind.__name__} {value!r} is not a JSON value whose type a file keeps; tactics must be "
        "None, bools, ints, floats, strings, torch dtypes or devices, tuples, lists or dicts of "
        "those, not subclasses (a namedtuple, an enum member): pass tuple(t) or t.value"
    )


def decode_value(data: Any) -> Any:
    """Inverse of :func:`encode_value`; raises ``ValueError`` or ``TypeError`` on bad tags."""
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if isinstance(data, dict):
        if len(data) == 1 and _TUPLE in data:
            items = data[_TUPLE]
            if not isinstance(items, list):
                raise ValueError(f"malformed tuple {data!r}")
            return tuple(decode_value(v) for v in items)
        if len(data) == 1 and _DTYPE in data:
            dtype = getattr(torch, str(data[_DTYPE]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown torch dtype {data!r}")
            return dtype
        if len(data) == 1 and _DEVICE in data:
            try:
                return torch.device(str(data[_DEVICE]))
            except RuntimeError as exc:
                raise ValueError(f"unknown torch device {data!r}: {exc}") from None
        if len(data) == 1 and _DICT in data:
            pairs = data[_DICT]
            if not isinstance(pairs, list) or any(
                not isinstance(p, list) or len(p) != 2 for p in pairs
            ):
                raise ValueError(f"malformed dict {data!r}")
            return {_hashable(decode_value(k)): decode_value(v) for k, v in pairs}
        return {k: decode_value(v) for k, v in data.items()}
    return data


#: One-key dicts with these keys are written as their pairs in :func:`comparable_value`: as
#: they are, ``cache unblock --tactic`` (which decodes the text) would read them as the tagged
#: value (``{"__tuple__": [1, 2]}`` as the tuple ``(1, 2)``, whose text is ``[1,2]``).
_COMPARED_TAGS = _TAGS


def comparable_value(value: Any) -> Any:
    """The JSON form by which two tactics are compared (the blocklist, the ranks of a distributed
    run): a tuple as the list of its items, so ``(64, 2)`` and ``[64, 2]`` are one tactic, and a
    dict whose keys are not all strings as its pairs, sorted, under ``__dict__``; a dtype or
    device keeps :func:`encode_value`'s tag, so ``torch.float16`` is never the string
    ``"torch.float16"``, and a dict whose one key is a tag of :func:`encode_value`
    (``{"__tuple__": [1, 2]}``) is written as its pairs too, so it never reads as one. Every
    other plain JSON value is itself. A value of any other type is returned as it is (its text
    is the caller's business: no file holds one)."""
    if isinstance(value, (list, tuple)):
        return [comparable_value(v) for v in value]
    if isinstance(value, (torch.dtype, torch.device)):
        return encode_value(value)
    if isinstance(value, dict):
        plain = all(isinstance(k, str) for k in value) and not (
            len(value) == 1 and next(iter(value)) in _COMPARED_TAGS
        )
        if plain:
            return {k: comparable_value(v) for k, v in value.items()}
        pairs = [[comparable_value(k), comparable_value(v)] for k, v in value.items()]
        return {_DICT: sorted(pairs, key=lambda p: json.dumps(p, sort_keys=True, default=str))}
    return value


def _hashable(key: Any) -> Any:
    if isinstance(key, list):  # cannot be a dict key; encode_value never writes one
        raise TypeError(f"a dict key cannot be a list: {key!r}")
    return key


#: What the error for a value of no stable text tells the owner of a runner attribute to do.
_RUNNER_ADVICE = (
    "so it cannot be part of the runner's cache key. Make it private (a leading underscore), "
    "list it in the runner class's identity_excludes, or override cache_key_extras() to "
    "state the runner's key."
)


def identity_value(value: Any, where: str, *, advice: str = _RUNNER_ADVICE) -> Any:
    """The canonical JSON form of configuration ``value`` (see the module docstring).

    Args:
        value: The value.
        where: What it is, for the error (e.g. ``"attribute 'block' of MyRunner"``).
        advice: The end of the error for a value (or one nested in it) of a type with no stable
            text, after "which has no stable value across processes, ": what to do instead.

    Raises:
        IdentityError: The value (or one nested in it) has no stable text.
    """
    # Typed values are tagged, as encode_value tags them: as bare text a dtype, device or enum
    # member would share its key with the string of that text, and a call passing one would be
    # served the pick tuned for the other.
    if isinstance(value, enum.Enum):  # first: an IntEnum or str enum member is an int or str too
        return {_ENUM: f"{type(value).__qualname__}.{value.name}"}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise IdentityError(f"{where} is {value!r}; a cache key needs a finite number.")
        # -0.0 == 0.0 (the hit memo holds them one key): one text too, "0.0", or a call's pick
        # would depend on which sign was looked up first.
        return value + 0.0
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {_DEVICE: str(value)}
    if isinstance(value, (tuple, list)):
        return [identity_value(v, f"{where}[{i}]", advice=advice) for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        items = [identity_value(v, f"{where} item", advice=advice) for v in value]
        return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise IdentityError(
                f"{where} has the non-string key {bad[0]!r}; a cache key needs string keys."
            )
        fields = {k: identity_value(v, f"{where}[{k!r}]", advice=advice) for k, v in value.items()}
        if len(fields) == 1 and next(iter(fields)) in _IDENTITY_TAGS:  # would read as a tag
            return {_DICT: [[k, v] for k, v in fields.items()]}
        return fields
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        # Tagged: as {"Class": {fields}} it had the text of that plain dict.
        return {
            _DATACLASS: [type(value).__qualname__, identity_value(fields, where, advice=advice)]
        }
    raise IdentityError(
        f"{where} is a {type(value).__qualname__}, which has no stable value across processes, "
        + advice
    )


def canonical_text(value: Any) -> str:
    """Compact JSON with sorted keys: equal configurations give equal text in every process."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
