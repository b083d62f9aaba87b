"""What the tuning cache holds: keys, picks and blocked tactics, with their JSON forms.

A key holds the identity of every runner offered (class and configuration, see
:mod:`graphtune.autotuner.identity`), a digest of their source files, the bucketed shapes and
dtypes, the device type of the inputs, the timing mode (cold L2 or not) and the ``choose_one``
keyword arguments, so changing any of them never reuses a stale pick. The value names the
winning runner by identity as well as by index, so a look-up can check it still matches. Tactics
are stored with their Python types (:func:`~graphtune.autotuner.values.encode_value`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from graphtune.autotuner.values import comparable_value, decode_value, encode_value


@dataclass(frozen=True)
class CacheKey:
    """Identity of one tuned (op, profile).

    Attributes:
        op: Op name given to ``choose_one``.
        runners: Identity of each runner offered, in order (see ``runner_id``).
        shapes: Bucketed shape of each input (``None`` for non-tensors).
        dtypes: dtype name of each tensor input, type name of each other input (with its
            tensors' dtypes and shapes for a list, tuple or dict holding tensors).
        timing: Name of the timer the times come from (``graph``, ``events``, ``wallclock``...),
            followed by :data:`COLD_L2_SUFFIX` when they were taken with cold-L2 rotation
            (:func:`key_timing`).
        sources: Digest of the runners' source files (``sources_digest``); ``""`` for none.
        kwargs: Canonical JSON of the ``choose_one`` keyword arguments; ``""`` when there are
            none.
        device: Device type the inputs live on (``"cpu"``, ``"cuda"``: the type of
            ``resolved.device_of(inputs)``). ``""`` is unknown: a key read from a file saved
            before the field existed whose timing could have run on any device
            (:func:`key_from_before_devices`); no look-up uses it.
    """

    op: str
    runners: tuple[str, ...]
    shapes: tuple[tuple[int, ...] | None, ...]
    dtypes: tuple[str, ...]
    timing: str
    sources: str = ""
    kwargs: str = ""
    device: str = ""

    def to_json(self) -> dict[str, Any]:
        """JSON form (lists instead of tuples; ``kwargs`` only when there are some)."""
        data: dict[str, Any] = {
            "op": self.op,
            "runners": list(self.runners),
            "sources": self.sources,
            "shapes": [list(s) if s is not None else None for s in self.shapes],
            "dtypes": list(self.dtypes),
            "device": self.device,
            "timing": self.timing,
        }
        if self.kwargs:
            data["kwargs"] = self.kwargs
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CacheKey:
        """Inverse of :meth:`to_json`. A key without ``device`` (saved before the field
        existed) gets the device its timing implies: ``"cuda"`` for ``graph`` and ``events``,
        which only run on CUDA, else ``""`` (unknown: :func:`entry_problems` says so).

        Raises:
            ValueError: A field is missing or of the wrong JSON type (a number where a string
                belongs would never equal a key made by ``choose_one``), or the shapes and
                dtypes differ in count.
        """
        shapes = tuple(
            None
            if s is None
            else tuple(_typed(d, int, "a size") for d in _typed(s, list, "a shape"))
            for s in _field(data, "shapes", list)
        )
        timing = _field(data, "timing", str)
        device = _field(data, "device", str, default=None)
        key = cls(
            op=_field(data, "op", str),
            runners=tuple(_typed(r, str, "a runner") for r in _field(data, "runners", list)),
            shapes=shapes,
            dtypes=tuple(_typed(d, str, "a dtype") for d in _field(data, "dtypes", list)),
            timing=timing,
            sources=_field(data, "sources", str),
            kwargs=_field(data, "kwargs", str, default=""),
            device=key_from_before_devices(timing) if device is None else device,
        )
        if len(key.shapes) != len(key.dtypes) or not key.runners:
            raise ValueError(
                f"{len(key.shapes)} shapes for {len(key.dtypes)} dtypes and {len(key.runners)} "
                "runners (shapes and dtypes pair up, and a key has at least one runner)"
            )
        return key


#: Timing modes that only run on CUDA: a key saved without ``device`` and timed so was tuned on
#: CUDA (the other modes, ``wallclock`` and a custom timer's name, run on any device).
CUDA_ONLY_TIMINGS = ("graph", "events")

#: Ends a key's ``timing`` when its times were taken with cold-L2 rotation
#: (``TuningConfig.cold_l2``): ``graph+cold_l2``. Times from cold and warm caches differ, so a
#: pick of one is never served to a call configured for the other, and ``cache merge`` never
#: compares their times. Warm-L2 keys have none, so existing files keep their keys.
COLD_L2_SUFFIX = "+cold_l2"


def key_timing(timer: str, cold_l2: bool) -> str:
    """The ``timing`` of a key tuned by the timer named ``timer``, with cold-L2 rotation or
    not."""
    return timer + COLD_L2_SUFFIX if cold_l2 else timer


def split_timing(timing: str) -> tuple[str, bool]:
    """``(timer name, cold L2)`` of a key's ``timing`` (inverse of :func:`key_timing`)."""
    if timing.endswith(COLD_L2_SUFFIX):
        return timing[: -len(COLD_L2_SUFFIX)], True
    return timing, False


def key_from_before_devices(timing: str) -> str:
    """The device type of a key saved without one (before the key held it): ``"cuda"`` when
    ``timing`` only runs on CUDA, else ``""`` (unknown, so the entry is ignored and re-tuned
    rather than served on a device it was not tuned on)."""
    return "cuda" if split_timing(timing)[0] in CUDA_ONLY_TIMINGS else ""


@dataclass(frozen=True)
class CacheEntry:
    """The pick for one key.

    Attributes:
        runner_id: Identity of the winning runner.
        runner_index: Its position in the runner list of the key.
        tactic: Winning tactic (a JSON value, with its Python types).
        time_us: Its measured per-call time; ``None`` when it was the only candidate (not timed).
        fallback_us: Time of ``(runners[0], -1)``, the untuned choice; ``None`` when that was not
            a timed candidate or failed. A median like ``time_us``, except where the fallback
            left the race after one sample (``AutoTuner.history`` has its sample count; the
            summary table marks such a time ``(1 sample)``).
        tuned_by: How distributed tuning made the pick, ``{"strategy": ..., "world_size": ...}``;
            ``None`` when the tuner was not distributed (then the file has no such field).
    """

    runner_id: str
    runner_index: int
    tactic: Any
    time_us: float | None
    fallback_us: float | None
    tuned_by: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    @property
    def speedup(self) -> float | None:
        """``fallback_us / time_us``, or ``None`` when either is unknown."""
        if not self.time_us or self.fallback_us is None or not math.isfinite(self.fallback_us):
            return None
        return self.fallback_us / self.time_us

    def to_json(self) -> dict[str, Any]:
        """JSON form (the tactic in :func:`~graphtune.autotuner.values.encode_value` form)."""
        data = {
            "runner_id": self.runner_id,
            "runner_index": self.runner_index,
            "tactic": encode_value(self.tactic),
            "time_us": self.time_us,
            "fallback_us": self.fallback_us,
        }
        if self.tuned_by is not None:  # only then, so other files keep their exact layout
            data["tuned_by"] = dict(self.tuned_by)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CacheEntry:
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: A field is missing or of the wrong JSON type.
        """
        time_us = _field(data, "time_us", float, optional=True)
        fallback_us = _field(data, "fallback_us", float, optional=True)
        tuned_by = _field(data, "tuned_by", dict, optional=True, default=None)
        if tuned_by is not None:
            tuned_by = {
                "strategy": _field(tuned_by, "strategy", str),
                "world_size": _field(tuned_by, "world_size", int),
            }
        if "tactic" not in data:
            raise ValueError("missing field 'tactic'")
        return cls(
            runner_id=_field(data, "runner_id", str),
            runner_index=_field(data, "runner_index", int),
            tactic=decode_value(data["tactic"]),
            time_us=None if time_us is None else float(time_us),
            fallback_us=None if fallback_us is None else float(fallback_us),
            tuned_by=tuned_by,
        )


def entry_problems(key: CacheKey, entry: CacheEntry) -> list[str]:
    """Why a well-formed entry cannot be used for its key (empty when it can): a runner that is
    not the key's, a tactic that is not JSON, a time that is not finite and positive. Loading
    ignores such an entry; ``graphtune cache verify`` lists each."""
    problems = []
    if not key.device:
        problems.append(
            f"its key has no device type (saved by a graphtune that did not key it) and its "
            f"timing {key.timing!r} runs on any device, so it may be another device's pick; "
            "re-tune to replace it"
        )
    index = entry.runner_index
    if not 0 <= index < len(key.runners) or key.runners[index] != entry.runner_id:
        problems.append(
            f"runner_index {index} / runner_id {entry.runner_id!r} do not name a runner of the "
            "key, so look-ups never use it"
        )
    try:  # in the file's form: a dict with tuple keys is stored as its pairs
        json.dumps(encode_value(entry.tactic), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        problems.append(f"tactic is not JSON-serialisable ({exc})")
    for name in ("time_us", "fallback_us"):
        value = getattr(entry, name)
        if value is not None and (not math.isfinite(value) or value <= 0):
            problems.append(f"{name} is {value}; times must be finite and > 0 (or null)")
    return problems


_JSON_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    list: "a list",
    dict: "an object",
}
_MISSING = object()


def _field(
    data: Any, name: str, kind: type, *, optional: bool = False, default: Any = _MISSING
) -> Any:
    """``data[name]`` checked by :func:`_typed`; ``default`` when the field may be absent.

    Raises:
        ValueError: ``data`` is not an object, or the field is missing or of another type.
    """
    if not isinstance(data, dict):
        raise ValueError(f"expected an object holding {name!r}, got {type(data).__name__}")
    if name not in data:
        if default is _MISSING:
            raise ValueError(f"missing field {name!r}")
        return default
    return _typed(data[name], kind, f"field {name!r}", optional=optional)


def _typed(value: Any, kind: type, what: str, *, optional: bool = False) -> Any:
    """``value`` when it is of JSON type ``kind`` (``float`` takes integers too; a bool is no
    number), or ``None`` where ``optional``.

    Raises:
        ValueError: Another type; the message names ``what``.
    """
    if value is None and optional:
        return None
    kinds = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) or not isinstance(value, kinds):
        expected = _JSON_TYPE_NAMES[kind] + (" or null" if optional else "")
        raise ValueError(f"{what} is {json.dumps(value)[:60]}, expected {expected}")
    return value


def tactic_text(tactic: Any) -> str:
    """Canonical JSON text of a tactic (:func:`~graphtune.autotuner.values.comparable_value`):
    tuples become lists, dict keys are sorted, dtypes and devices keep their tags.

    Two spellings of one tactic (``(64, 2)`` and ``[64, 2]``, or dicts in another key order) give
    the same text, so the blocklist and the ranks of a distributed run match a tactic however a
    runner spells it; a dict with non-string keys keeps them apart from their string forms, and
    ``torch.float16`` is apart from ``"torch.float16"``. A plain JSON tactic's text is its own
    compact JSON with sorted keys.
    """
    # default=str only for a value no file can hold (a tuner refuses to store such a tactic):
    # its text then serves in messages and compile-error keys, never in a file.
    return json.dumps(comparable_value(tactic), sort_keys=True, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class BlockedTactic:
    """A (runner, tactic) that must not be timed again: it crashed, hung or broke the context.

    Attributes:
        runner_id: Identity of the runner (see ``runner_id``).
        tactic: The tactic (a JSON value).
        reason: Why it was blocked, e.g. ``"timeout after 60.0 s"`` or ``"crash: exit code -11"``.
        op: The op being tuned when it failed (for people reading the file).
        shapes: The profile being tuned when it failed (``describe()`` form), for the same reason.
    """

    runner_id: str
    tactic: Any
    reason: str
    op: str = ""
    shapes: str = ""

    @property
    def ident(self) -> tuple[str, str]:
        """``(runner_id, canonical tactic text)``: what the blocklist is keyed by."""
        return (self.runner_id, tactic_text(self.tactic))

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "runner_id": self.runner_id,
            "tactic": encode_value(self.tactic),
            "reason": self.reason,
            "op": self.op,
            "shapes": self.shapes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BlockedTactic:
        """Inverse of :meth:`to_json`; raises ``ValueError`` on malformed data."""
        if not isinstance(data, dict):
            raise ValueError(f"a blocklist item must be an object, got {type(data).__name__}")
        if "tactic" not in data:
            raise ValueError("missing field 'tactic'")
        return cls(
            runner_id=_field(data, "runner_id", str),
            tactic=decode_value(data["tactic"]),
            reason=_field(data, "reason", str),
            op=_field(data, "op", str, default=""),
            shapes=_field(data, "shapes", str, default=""),
        )


Blocklist = dict[tuple[str, str], BlockedTactic]
