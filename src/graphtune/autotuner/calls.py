"""Op calls as the tuner sees them: live (:class:`OpCall`) and in JSON (:class:`CallRecord`).

A :class:`CallRecord` holds enough to re-create a ``choose_one`` call in another process: the op,
the identity of its runners, the config's plain fields (``max_value``, ``timing``, ``cold_l2``,
``warmup``, ``repeat``), each input's shape, dtype, strides and device (or its value, for a
non-tensor) and the keyword arguments. The runners and the config's callables (specs, hooks) come
from whoever rebuilds the call: the op registry of :mod:`graphtune.ops` does for its ops. Tensor
*values* are not recorded (reading them would synchronise with the device, and a miss can happen
while a graph is being captured): re-created tensors hold random floats, and zeros for integer
and bool tensors, which the config's ``inputs_pre_hook`` must make valid when the op needs it.

:class:`MissLog` is the record of the shapes that missed while serving
(``AutoTuner.misses``): one record per missed cache key, with a count, saved as JSON atomically
(and merged with what the file already holds), for ``graphtune tune --from-misses FILE``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import torch

from graphtune.atomic_files import file_id
from graphtune.autotuner import json_update
from graphtune.autotuner.cache_reader import Unusable, read_text
from graphtune.autotuner.config import TuningConfig
from graphtune.autotuner.entries import CacheKey
from graphtune.autotuner.misses_file import (
    MISSES_FORMAT,
    MISSES_VERSION,
    is_misses_doc,
    misses_doc_problem,
    misses_version_problem,
)
from graphtune.autotuner.runner_contract import refuse_reserved_keywords
from graphtune.autotuner.values import decode_value, encode_value, identity_value
from graphtune.errors import CacheFileError, ConfigError, InputError
from graphtune.finite_json import parse_json

logger = logging.getLogger(__name__)

_CONFIG_FIELDS = ("max_value", "timing", "cold_l2", "warmup", "repeat")
# The end of the error for a keyword value (or one nested in it) of no stable text: the advice
# for runner attributes (identity_excludes, cache_key_extras) does not apply to it.
_KWARG_ADVICE = (
    "and keyword arguments are part of the cache key, so they need values with a stable text "
    "(None, bools, ints, finite floats, strings, dtypes, devices, enum members, and tuples, "
    "lists, sets, string-keyed dicts and dataclasses of them); pass tensors in inputs (their "
    "shape and dtype are keyed) and other state on the runner as private attributes (a leading "
    "underscore)."
)


@dataclass(frozen=True)
class OpCall:
    """One ``choose_one`` call as it was made (``AutoTuner.record_calls()``)."""

    op: str
    runners: tuple[Any, ...]
    config: TuningConfig
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def checked(
        cls,
        op: str,
        runners: Iterable[Any],
        config: TuningConfig,
        inputs: Iterable[Any],
        kwargs: dict[str, Any],
        *,
        caller: str = "choose_one",
    ) -> OpCall:
        """The call ``choose_one(op, runners, config, inputs, **kwargs)`` makes, after the
        checks of what it was given (the errors name ``caller``: ``check_tactics`` checks alike).

        Raises:
            ConfigError: ``op`` is not a non-empty str (the cache file stores it as a JSON
                string), ``inputs`` is not a list or tuple (a tensor would be split into its
                rows), ``runners`` is a runner rather than a list of them, no runner, something
                that is not a runner instance, a keyword argument is named ``inputs``,
                ``profile`` or ``tactic`` (graphtune passes those), or is (or holds) a tensor or
                another value with no stable text (an :class:`IdentityError` naming it), or
                ``config`` is not a :class:`TuningConfig`.
        """
        if not isinstance(op, str) or not op:
            # an op that is no string is saved as one, and a load rejects the whole file for it
            raise ConfigError(
                f"{caller}: op {op!r} is not a non-empty str; name the op with a string "
                "(it is part of the cache key, stored as JSON text)."
            )
        if isinstance(inputs, (torch.Tensor, str, bytes, dict)) or not isinstance(inputs, Iterable):
            raise ConfigError(
                f"{caller}({op!r}) takes its inputs as a list, as forward receives them; got "
                f"{type(inputs).__name__} (pass [x] for one tensor)."
            )
        if callable(getattr(runners, "forward", None)) or not isinstance(runners, Iterable):
            raise ConfigError(
                f"{caller}({op!r}) takes its runners as a list; got "
                f"{type(runners).__name__} (pass [runner] for one runner)."
            )
        refuse_reserved_keywords(caller, op, kwargs)  # before tuning calls a runner with them
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):  # identity_value's advice is for runner fields
                raise ConfigError(
                    f"{caller}({op!r}): keyword argument {name!r} is a Tensor, but keyword "
                    "arguments are part of the cache key and need a stable value; pass the "
                    "tensor in inputs (its shape and dtype are keyed) or keep it on the runner "
                    "as a private attribute (a leading underscore)."
                )
            # one nested in a tuple, list or dict: the same advice, not a runner field's
            identity_value(
                value, f"{caller}({op!r}): keyword argument {name}", advice=_KWARG_ADVICE
            )
        runners = list(runners)
        if not runners:
            raise ConfigError(f"{caller}({op!r}) got no runners; pass at least one runner.")
        for runner in runners:
            if isinstance(runner, type) or not callable(getattr(runner, "forward", None)):
                raise ConfigError(
                    f"{caller}({op!r}): {runner!r} is not a runner; pass instances of "
                    "TunableRunner subclasses (with forward and get_valid_tactics)."
                )
        if not isinstance(config, TuningConfig):
            raise ConfigError(f"{caller}({op!r}) needs a TuningConfig, got {config!r}.")
        return cls(op, tuple(runners), config, tuple(inputs), kwargs)


def _describe_input(x: Any) -> dict[str, Any]:
    if isinstance(x, torch.Tensor):
        return {
            "shape": list(x.shape),
            "dtype": str(x.dtype).removeprefix("torch."),
            "stride": list(x.stride()),
            "device": str(x.device),
        }
    return {"value": encode_value(x)}


@dataclass(frozen=True)
class CallRecord:
    """A ``choose_one`` call described in JSON (see the module docstring).

    Attributes:
        op: Op name.
        runners: Identity of each runner offered (``runner_id``).
        config: The config's plain fields.
        inputs: Per input ``{"shape", "dtype", "stride", "device"}`` or ``{"value"}``.
        kwargs: The keyword arguments, in :func:`~graphtune.autotuner.values.encode_value` form.
        key: The cache key the call looked up (JSON form), when known.
        count: How many calls this record stands for.
    """

    op: str
    runners: tuple[str, ...]
    config: dict[str, Any]
    inputs: tuple[dict[str, Any], ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    key: dict[str, Any] | None = None
    count: int = 1

    @classmethod
    def of(cls, call: OpCall, ids: tuple[str, ...], key: CacheKey | None = None) -> CallRecord:
        """Describes a live call whose runners have identities ``ids``."""
        return cls(
            op=call.op,
            runners=tuple(ids),
            config={name: getattr(call.config, name) for name in _CONFIG_FIELDS},
            inputs=tuple(_describe_input(x) for x in call.inputs),
            kwargs={k: encode_value(v) for k, v in call.kwargs.items()},
            key=key.to_json() if key is not None else None,
        )

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "op": self.op,
            "runners": list(self.runners),
            "config": dict(self.config),
            "inputs": [dict(x) for x in self.inputs],
            "kwargs": dict(self.kwargs),
            "key": self.key,
            "count": self.count,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CallRecord:
        """Inverse of :meth:`to_json`; raises ``KeyError`` (naming the missing field),
        ``TypeError`` or ``ValueError``."""
        if not isinstance(data, dict):
            raise TypeError(f"it is a JSON {type(data).__name__}, not an object")
        for name in ("op", "runners", "config", "inputs"):
            if name not in data:
                raise KeyError(name)
        if not isinstance(data["config"], dict):
            raise TypeError(f"field 'config' is {type(data['config']).__name__}, not an object")
        missing = [f"config.{k}" for k in _CONFIG_FIELDS if k not in data["config"]]
        if missing:
            raise KeyError(missing[0])
        inputs = tuple(dict(x) for x in data["inputs"])
        for x in inputs:
            if "value" not in x and not {"shape", "dtype", "stride", "device"} <= set(x):
                raise ValueError(f"malformed input description {x!r}")
        runners, count = data["runners"], data.get("count", 1)
        if not isinstance(data["op"], str):
            raise TypeError(f"field 'op' is {data['op']!r}, not a string")
        # Checked, not converted: str("abc") iterates into three runners, int(2.5) is 2.
        if not isinstance(runners, list) or not all(isinstance(r, str) for r in runners):
            raise TypeError(f"field 'runners' is {runners!r}, not a list of runner ids")
        if type(count) is not int or count < 1:
            raise ValueError(f"field 'count' is {count!r}, not an integer >= 1")
        return cls(
            op=data["op"],
            runners=tuple(runners),
            config={k: data["config"][k] for k in _CONFIG_FIELDS},
            inputs=inputs,
            kwargs=dict(data.get("kwargs", {})),
            key=data.get("key"),
            count=count,
        )

    def call_kwargs(self) -> dict[str, Any]:
        """The keyword arguments with their Python types."""
        return {k: decode_value(v) for k, v in self.kwargs.items()}

    def make_inputs(self, device: torch.device | str | None = None, *, seed: int = 0) -> list[Any]:
        """Inputs with the recorded shapes, dtypes and strides (values: see the module docstring).

        Args:
            device: Where to make the tensors; ``None`` uses each recorded device.
            seed: Seed of the random values.

        Raises:
            InputError: A recorded dtype this torch does not have.
        """
        gen = torch.Generator()
        gen.manual_seed(seed)
        out: list[Any] = []
        for x in self.inputs:
            if "value" in x:
                out.append(decode_value(x["value"]))
                continue
            dtype = getattr(torch, x["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise InputError(
                    f"op {self.op!r}: recorded dtype {x['dtype']!r} is not a torch dtype here; "
                    "re-create the record with this torch version."
                )
            where = _input_device(self.op, device if device is not None else x["device"])
            shape, stride = _sizes(self.op, x, "shape"), _sizes(self.op, x, "stride")
            if len(shape) != len(stride):
                raise InputError(
                    f"op {self.op!r}: a recorded input has shape {list(shape)} but stride "
                    f"{list(stride)}; the misses file was edited or damaged"
                )
            try:
                t = torch.empty_strided(shape, stride, dtype=dtype, device=where)
            except (RuntimeError, MemoryError) as exc:  # torch's allocators' errors
                raise InputError(
                    f"op {self.op!r}: cannot allocate a recorded input of shape {list(shape)} on "
                    f"{where} ({' '.join(str(exc).split())[:160]})"
                ) from None
            if dtype.is_floating_point or dtype.is_complex:
                values = torch.randn(t.shape, generator=gen, dtype=torch.float32)
                t.copy_(values.to(dtype))
            else:
                t.zero_()
            out.append(t)
        return out


def _input_device(op: str, name: Any) -> torch.device:
    """The device a recorded input is made on; :class:`InputError` when it is no device name or
    this machine lacks it."""
    try:
        where = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"op {op!r}: recorded device {name!r} is not a device ({exc})") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise InputError(
            f"op {op!r} was recorded on {where}, and this machine has no CUDA; tune the misses "
            "on a machine like the one that recorded them (a pick is only valid there)"
        )
    return where


def _sizes(op: str, description: dict[str, Any], name: str) -> tuple[int, ...]:
    """A recorded input's shape or stride: non-negative integers, or :class:`InputError`."""
    value = description[name]
    if not isinstance(value, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    ):
        raise InputError(
            f"op {op!r}: a recorded input's {name} is {value!r}, not a list of integers >= 0; "
            "the misses file was edited or damaged"
        )
    return tuple(value)


class MissLog:
    """Thread-safe record of the calls that missed: one :class:`CallRecord` per cache key."""

    def __init__(self) -> None:
        self._records: dict[CacheKey, CallRecord] = {}
        self._unrecordable: set[str] = set()
        self._lock = threading.Lock()
        # Per file, the count of each key already merged into it: a save adds only what came
        # since, so saving again (nested or successive autotune() blocks) never counts a miss
        # twice, while the records stay here for the caller to read.
        self._saved: dict[str, dict[CacheKey, int]] = {}
        self._save_lock = threading.Lock()  # two saves must not both add one delta

    def add(self, key: CacheKey, make: Callable[[], CallRecord]) -> None:
        """Counts a miss of ``key``; ``make`` builds its record the first time only. A call the
        file cannot describe (an argument JSON cannot hold) is left out with one warning per op:
        a miss must never fail the call that missed."""
        with self._lock:
            found = self._records.get(key)
            if found is None:
                try:
                    self._records[key] = make()
                except (TypeError, ValueError) as exc:
                    if key.op not in self._unrecordable:
                        self._unrecordable.add(key.op)
                        logger.warning(
                            "op %r: a missed call is not recorded for `graphtune tune "
                            "--from-misses` (%s); tune it in the workload instead",
                            key.op,
                            exc,
                        )
            else:
                self._records[key] = _with_count(found, found.count + 1)

    def rearm_warnings(self) -> None:
        """Lets each op warn once more about a miss it cannot record (``reset_stats()``)."""
        with self._lock:
            self._unrecordable.clear()

    def records(self) -> list[CallRecord]:
        """A snapshot, in the order the keys first missed."""
        with self._lock:
            return list(self._records.values())

    def clear(self) -> None:
        """Forgets every record (and what was saved of them)."""
        with self._save_lock, self._lock:
            self._records.clear()
            self._saved.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def save(self, path: str | PathLike[str]) -> int:
        """Merges these records into the misses file at ``path``, atomically under its lock.

        Only the misses counted since this log's last save to ``path`` are added: a record
        already in the file (same key) has its count raised by those; records of the file that
        cannot be parsed are kept as they are. A file there that is not a misses file of this
        version is renamed to ``<name>.unusable`` first, with a warning saying so, as a tuning
        cache save does; a tuning cache or a folder there is never moved (the save raises).
        Returns the number of records in the file.

        Raises:
            CacheFileError: The file could not be written (the lock, the disk, a tuning cache,
                folder or device there); the records are then in a fallback file the message
                names (:func:`graphtune.autotuner.json_update.update_json`).
        """
        with self._save_lock:
            where = file_id(path)  # the file written: a link and its target are one
            with self._lock:
                saved = self._saved.get(where, {})
                counts = {k: r.count - saved.get(k, 0) for k, r in self._records.items()}
                mine = [_with_count(r, counts[k]) for k, r in self._records.items() if counts[k]]
            written = self._merge_into(path, mine)
            with self._lock:
                done = self._saved.setdefault(where, {})
                for key, count in counts.items():
                    done[key] = done.get(key, 0) + count
            return written

    def _merge_into(self, path: str | PathLike[str], mine: list[CallRecord]) -> int:
        """Merges ``mine`` into the misses file at ``path``; returns its number of records."""

        def merge(current: Any) -> dict[str, Any]:
            merged: dict[str, CallRecord] = {}
            unreadable: list[Any] = []
            if is_misses_doc(current):
                for item in current["misses"]:
                    try:
                        rec = CallRecord.from_json(item)
                    except (KeyError, TypeError, ValueError):
                        # Kept as it is (nothing is lost); loading the file names it.
                        unreadable.append(item)
                        continue
                    merged[_ident(rec)] = rec
            for rec in mine:
                old = merged.get(_ident(rec))
                merged[_ident(rec)] = (
                    rec if old is None else _with_count(old, old.count + rec.count)
                )
            return {
                "format": MISSES_FORMAT,
                "version": MISSES_VERSION,
                "misses": [r.to_json() for r in merged.values()] + unreadable,
            }

        return len(
            json_update.update_json(path, merge, problem=misses_doc_problem, what="misses record")[
                "misses"
            ]
        )


def _with_count(rec: CallRecord, count: int) -> CallRecord:
    return CallRecord(rec.op, rec.runners, rec.config, rec.inputs, rec.kwargs, rec.key, count)


def _ident(rec: CallRecord) -> str:
    return json.dumps([rec.op, rec.key or [dict(x) for x in rec.inputs]], sort_keys=True)


def load_misses(path: str | PathLike[str]) -> list[CallRecord]:
    """The records of a misses file.

    Raises:
        CacheFileError: The file is missing, not a regular file (a FIFO is never opened),
            not JSON, not a misses file or malformed.
    """
    try:
        # A FIFO or device is refused unopened (reading one would block), as for a cache file.
        doc = parse_json(read_text(Path(path)))
    except Unusable as exc:
        raise CacheFileError(
            f"misses file {path} {exc}; pass the file GRAPHTUNE_MISSES or "
            "AutoTuner.misses.save(path) wrote."
        ) from None
    except (ValueError, RecursionError) as exc:
        raise CacheFileError(f"misses file {path} cannot be read as JSON ({exc}).") from None
    if isinstance(doc, dict) and doc.get("format") == MISSES_FORMAT:
        problem = misses_version_problem(doc)
        if problem is not None:
            raise CacheFileError(
                f"misses file {path} has {problem}; record the misses again with this graphtune."
            )
    if not is_misses_doc(doc):
        raise CacheFileError(
            f"{path} is not a graphtune misses file (format {MISSES_FORMAT!r} version "
            f"{MISSES_VERSION}); write one with AutoTuner.misses.save(path) or "
            "autotune(misses_path=path)."
        )
    records = []
    for index, item in enumerate(doc["misses"]):
        try:
            records.append(CallRecord.from_json(item))
        except (KeyError, TypeError, ValueError) as exc:
            op = f" (op {item['op']!r})" if isinstance(item, dict) and "op" in item else ""
            why = f"field {exc.args[0]!r} is missing" if isinstance(exc, KeyError) else str(exc)
            raise CacheFileError(
                f'misses file {path}: record {index}{op} of its "misses" list (counted from 0) '
                f"is malformed: {why}; fix or delete that record, or record the misses again."
            ) from None
    return records
