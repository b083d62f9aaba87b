"""An op call resolved to what its cache keys are made of, and the key of its memoised hit.

:class:`ResolvedCall` is computed once per slow-path look-up (and per tuning run): the runners'
identities, the device, the timing mode (the key's ``timing``: the timer's name, with cold L2 or
not), the runners' source digest and the keyword arguments' text. :func:`memo_key` is what a
cache hit of an exact call signature depends on, and :class:`HitMemo` keeps those hits, so that a
decode step's repeated look-ups skip bucketing and key building.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphtune.autotuner.cache import TuningCache
from graphtune.autotuner.calls import OpCall
from graphtune.autotuner.config import TuningConfig
from graphtune.autotuner.entries import CacheKey
from graphtune.autotuner.identity import identity_attributes
from graphtune.autotuner.profiles import Profile, input_type_text, profile_for
from graphtune.autotuner.runner import TunableRunner


def device_of(inputs: Sequence[Any]) -> torch.device:
    """The device the op's work runs on: that of the first tensor input not on the CPU (the CPU
    when there is none). A host-side input (lengths, counts) may come before the device tensors,
    and timing device work with a host timer would not wait for the device."""
    for x in inputs:
        if isinstance(x, torch.Tensor) and not x.is_cpu:
            return x.device
    return torch.device("cpu")


_SCALARS = (bool, int, float, str)


class _SameRunners:
    """The runners of a call, equal only to the very same objects in the same order: runners
    whose ``==`` ignores part of their identity (a dataclass field with ``compare=False``) must
    not share a hit, which would return the other runner and its tactic. The key holds the
    runners, so their ids are not reused while the memo has it."""

    __slots__ = ("runners", "_hash")

    def __init__(self, runners: Sequence[TunableRunner]) -> None:
        self.runners = tuple(runners)
        self._hash = hash(tuple(map(id, self.runners)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _SameRunners) or len(other.runners) != len(self.runners):
            return False
        return all(a is b for a, b in zip(self.runners, other.runners, strict=True))


_GONE = object()
#: Marks a non-contiguous tensor's strides in a memo key (no other part of the key is it).
_STRIDED = object()


class RunnerStates:
    """What the identity of each runner of a memoised hit was (:func:`runner_id`), checked on
    every hit: the memo compares runners as objects, and a runner whose public attribute was
    changed in place (``r.block = 32``) is another runner for the cache, whose pick the hit
    must not return.

    Of a runner with the default ``cache_key_extras`` it keeps a copy of each identity attribute
    (public, not in ``identity_excludes``) and its layout (one attribute added or removed changes
    the identity too: :func:`_layout`); of a runner that overrides ``cache_key_extras``, a copy
    of what that returned. Comparing those is much cheaper than building ``runner_id`` again. An
    attribute's value changed inside it (``r.sizes.append(8)``) is seen too, since the copy is
    deep.
    """

    __slots__ = ("states",)

    def __init__(self, runners: Sequence[TunableRunner]) -> None:
        self.states = tuple(_state(r) for r in runners)

    def current(self) -> bool:
        """Whether every runner still has the identity it had when this was made."""
        try:
            for runner, layout, items in self.states:
                if items is None:  # an overridden cache_key_extras: what it returned then
                    if not same_value(runner.cache_key_extras(), layout):
                        return False
                    continue
                if _layout(runner) != layout:
                    return False
                for name, value in items:
                    if not same_value(getattr(runner, name, _GONE), value):
                        return False
        except Exception:  # noqa: BLE001 - a value that cannot be compared: look it up again
            return False
        return True


def same_value(now: Any, then: Any) -> bool:
    """Whether ``now`` equals ``then`` with the same types all the way down (``1``, ``1.0`` and
    ``True`` differ inside lists, tuples and dicts too, as in a runner's identity text). Dicts
    compare in order and sets by their items' type and text: a reordered one reads as changed,
    which only costs a cache look-up."""
    if now is then:
        return True
    if type(now) is not type(then):
        return False
    if isinstance(now, (list, tuple)):
        return len(now) == len(then) and all(map(same_value, now, then))
    if isinstance(now, dict):
        return same_value(list(now.items()), list(then.items()))
    if isinstance(now, (set, frozenset)):
        return sorted((type(x).__name__, repr(x)) for x in now) == sorted(
            (type(x).__name__, repr(x)) for x in then
        )
    return bool(now == then)


_HAS_SLOTS: dict[type, bool] = {}


def _has_slots(cls: type) -> bool:
    found = _HAS_SLOTS.get(cls)
    if found is None:
        found = _HAS_SLOTS[cls] = any("__slots__" in c.__dict__ for c in cls.__mro__[:-1])
    return found


def _layout(runner: TunableRunner) -> Any:
    """What changes when an attribute is added or removed: the instance dict's size, and for a
    class with ``__slots__`` also the names of its identity attributes that are set (a slot
    assigned later adds one without touching ``__dict__``)."""
    count = len(getattr(runner, "__dict__", ()))
    if not _has_slots(type(runner)):
        return count
    return count, tuple(identity_attributes(runner))


def _state(runner: TunableRunner) -> tuple[TunableRunner, Any, Any]:
    """``(runner, its layout, ((name, copy of value), ...))``, or ``(runner, copy of
    cache_key_extras(), None)`` for a runner that overrides it; see :class:`RunnerStates`."""
    if type(runner).cache_key_extras is not TunableRunner.cache_key_extras:
        return runner, copy.deepcopy(runner.cache_key_extras()), None
    items = tuple(
        (name, copy.deepcopy(getattr(runner, name))) for name in identity_attributes(runner)
    )
    return runner, _layout(runner), items


def memo_key(
    op: str,
    runners: Sequence[TunableRunner],
    config: TuningConfig,
    inputs: Sequence[Any],
    kwargs: dict[str, Any],
) -> tuple[Any, ...] | None:
    """What a cache hit depends on, or ``None`` (no memo) when ``runners`` or ``inputs`` is not a
    list or tuple, an input is not a tensor, ``None`` or a scalar, or a keyword value is not
    ``None`` or a scalar. The runners count by identity (the same objects), not by ``==``, and
    :class:`HitMemo` checks their configuration on each hit (:class:`RunnerStates`). A
    tensor adds its shape, dtype and device type, a scalar its type and
    itself (``1``, ``1.0`` and ``True`` are equal in Python but are other keys, as in the cache
    key's text; only tensors add a ``torch.Size``, so the flat key is unambiguous), and a
    non-contiguous tensor its strides too, after a marker of its own. The key may
    still be unhashable (a config): hashing it raises ``TypeError``, which :class:`HitMemo` treats
    as no memo. Hashing the key is cheap because a
    config hashes its fields once (``TuningConfig.__hash__``). This runs on every look-up, so it
    avoids what costs there: ``tensor.device`` builds a new object per call."""
    if not isinstance(runners, (list, tuple)) or not isinstance(inputs, (list, tuple)):
        return None
    parts: list[Any] = [op, config, _SameRunners(runners)]
    for x in inputs:
        if x is None:
            parts.append(None)
        elif isinstance(x, torch.Tensor):
            device = "cuda" if x.is_cuda else "cpu" if x.is_cpu else x.device.type
            parts += (x.shape, x.dtype, device)
            if not x.is_contiguous():  # its layout is part of the cache key (tensor_layout)
                parts.append((_STRIDED, x.stride()))
        elif isinstance(x, _SCALARS):
            parts += (type(x), x)
        else:
            return None
    if kwargs:
        if not all(v is None or isinstance(v, _SCALARS) for v in kwargs.values()):
            return None  # nested values may hide 1 and True alike: the slow path tells them apart
        parts.append(tuple(sorted((k, type(v), v) for k, v in kwargs.items())))
    return tuple(parts)


class HitMemo:
    """The cache hits of exact call signatures (:func:`memo_key`), so a decode step's repeated
    look-ups skip bucketing and key building.

    An entry is valid for one cache at one version: any change to the cache (a new pick, a
    load, a clear) makes every entry miss. Past ``limit`` entries the memo starts again empty.
    """

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._entries: dict[tuple[Any, ...], tuple[TuningCache, int, Any, RunnerStates]] = {}

    def get(self, key: tuple[Any, ...] | None, cache: TuningCache) -> Any:
        """The memoised pick of ``key`` in ``cache`` at its current version, or ``None``; also
        ``None`` when a runner's identity changed since (:class:`RunnerStates`)."""
        if key is None:
            return None
        try:
            entry = self._entries.get(key)
        except TypeError:  # an unhashable config: look up the slow way
            return None
        if entry is None or entry[0] is not cache or entry[1] != cache.version:
            return None
        if not entry[3].current():
            return None
        return entry[2]

    def put(
        self, key: tuple[Any, ...] | None, cache: TuningCache, version: int, found: Any
    ) -> None:
        """Remembers ``found`` (a ``(runner, tactic)`` pick) for ``key`` in ``cache`` at
        ``version``, the cache's version read before the look-up that found it: a change to the
        cache in between then leaves the entry stale (a miss), never an old pick that looks
        current."""
        if key is None:
            return
        if len(self._entries) >= self.limit:
            self._entries.clear()
        try:
            states = RunnerStates(key[2].runners)  # memo_key's runners
        except Exception:  # noqa: BLE001 - an attribute deepcopy cannot copy: no memo
            return
        try:
            self._entries[key] = (cache, version, found, states)
        except TypeError:  # unhashable: nothing to remember
            pass


@dataclass(frozen=True)
class ResolvedCall:
    """A call with what its cache keys are made of (computed once per slow-path look-up)."""

    call: OpCall
    ids: tuple[str, ...]
    device: torch.device
    mode: str
    sources: str
    kwargs_text: str

    def key(self, profile: Profile) -> CacheKey:
        """The cache key of one of the call's profiles."""
        return CacheKey(
            self.call.op,
            self.ids,
            profile.shapes,
            profile.dtypes,
            self.mode,
            self.sources,
            self.kwargs_text,
            self.device.type,
        )

    def live_key(self) -> CacheKey | None:
        """The key the live inputs look up (``None``: a size without a bucket)."""
        profile = profile_for(self.call.config, self.call.inputs)
        return self.key(profile) if profile is not None else None


def distinct_profiles(calls: Iterable[ResolvedCall]) -> Iterator[ResolvedCall]:
    """The calls whose profiles have keys no earlier call's profiles have: of calls with one
    op, runners, mode, runner sources, keyword arguments, device type, tuning config and input
    shapes, dtypes and strides of the non-contiguous ones (a repeated layer's call), the first
    only. A call whose config cannot be hashed is always kept."""
    seen: set[tuple[Any, ...]] = set()
    for resolved in calls:
        shapes = tuple(
            # Strides, not the layout class: the layouts at other buckets scale the live
            # tensor's gaps (tensor_layout), which the class does not hold.
            (tuple(x.shape), x.dtype, None if x.is_contiguous() else x.stride())
            if isinstance(x, torch.Tensor)
            else input_type_text(x)
            for x in resolved.call.inputs
        )
        call = resolved.call
        signature = (
            call.op,
            resolved.ids,
            resolved.mode,
            resolved.sources,
            resolved.kwargs_text,
            resolved.device.type,
        )
        try:
            key = (*signature, call.config, shapes)
            if key in seen:
                continue
            seen.add(key)
        except TypeError:
            pass
        yield resolved
